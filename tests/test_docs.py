"""The documentation stays true: the site builds with no broken link or anchor, the README's and the home
page's commands are the ones the tests run, the Python the pages show runs, and the tests the reliability page
names exist."""
import re
import shlex
import subprocess
import sys

import pytest

from helpers import FIRST_COMMAND, ROOT, cfg_with, metric_rows, needs_vllm, run
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.run.build import check_task_keys
from torchrl_grpo.tasks import build_task

TEST_COMMAND = ".venv/bin/python -m pytest -q tests"  # .ci/run runs it


def blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / page).read_text(), flags=re.S | re.M)


def commands(page: str) -> list[str]:
    """The command lines of a page's bash blocks, comments and ``./setup.sh &&`` left out."""
    lines = [line.split("#")[0].strip() for block in blocks(page, "bash") for line in block.splitlines()]
    return [line.removeprefix("./setup.sh && ") for line in lines if line]


def test_the_docs_site_builds_with_no_broken_link_or_anchor(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "config-reference" / "index.html").is_file()


def test_the_front_pages_give_the_commands_the_tests_run():
    readme = commands("README.md")
    assert readme[:2] == [FIRST_COMMAND, TEST_COMMAND]
    assert ".venv/bin/python -m pytest -q tests" in (ROOT / ".ci" / "run").read_text()
    assert commands("docs/index.md")[0::2] == [FIRST_COMMAND, TEST_COMMAND]


@needs_vllm
def test_the_home_pages_smoke_run_runs_as_written(tmp_path):
    [smoke] = [c for c in commands("docs/index.md") if "model=tiny" in c]
    args = shlex.split(smoke.removeprefix(".venv/bin/python grpo.py "))
    done = run([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == ["1", "2"]


def test_the_environment_example_of_the_tasks_page_plugs_in_by_import_path(tmp_path, monkeypatch):
    """docs/tasks.md's mypkg/envs.py as written: its TurnEnv by env.turn_env, its transform by env.transforms."""
    from torchrl.envs import Transform

    [example] = [b for b in blocks("docs/tasks.md", "python") if "mypkg/envs.py" in b]
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "envs.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    task, turns = build_episode_task({"dataset": "gsm_symbolic", "size": 4, "max_steps": 2,
                                      "turn_env": {"_target_": "mypkg.envs.Hint"}})
    row = task.rows[0]
    wrong = turns.env.step(task, row, [*task.messages(row), {"role": "assistant", "content": "#### -1"}])
    assert not wrong.done and wrong.counts == {"hints": 1}
    assert wrong.messages[0]["content"] == f"Hint: the answer has {len(row['answer'])} digits."
    answer = {"role": "assistant", "content": f"#### {row['answer']}"}
    assert turns.env.step(task, row, [*task.messages(row), answer]).done
    _, with_tool = build_episode_task({"dataset": "gsm_symbolic", "size": 4, "max_steps": 3,
                                       "transforms": [{"_target_": "mypkg.envs.calculator"}]})
    from mypkg.envs import calculator

    assert with_tool.transforms and isinstance(calculator(), Transform)


def test_the_own_task_example_of_the_tasks_page_is_chosen_by_its_command_line(tmp_path, monkeypatch):
    """docs/tasks.md's mypkg/tasks.py as written, chosen by the page's env._target_ command line: its keys are
    checked against its settings class, and it builds its rows and reward."""
    [example] = [b for b in blocks("docs/tasks.md", "python") if "mypkg/tasks.py" in b]
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tasks.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mypkg", "mypkg.tasks"):  # another test's mypkg
        monkeypatch.delitem(sys.modules, name, raising=False)
    [command] = [c for c in commands("docs/tasks.md") if "env._target_=mypkg.tasks.build_sums" in c]
    args = ["model=tiny", *shlex.split(command.removeprefix("python grpo.py "))]
    spec = resolve_run(cfg_with(*args))
    check_task_keys(spec)
    task = build_task(spec.task)
    row = task.rows[0]
    assert task.name == "sums" and len(task.rows) == 500 and len(row["question"]) == len("1 + 2 = ?")
    assert task.score(f"It is {row['answer']}", row) == {"exact": 1.0}
    with pytest.raises(ConfigError, match=r"^env.digts: env._target_=mypkg.tasks.build_sums reads no such key "
                                          r"\(did you mean env.digits\?\)"):
        check_task_keys(resolve_run(cfg_with(*args, "+env.digts=2")))


def test_every_test_the_reliability_page_names_exists():
    """docs/reliability.md holds each guarantee to a test by name: a renamed or dropped test fails here."""
    page = (ROOT / "docs" / "reliability.md").read_text()
    named = re.findall(r"`(test_\w+\.py)(?:::(test_\w+))?`|`::(test_\w+)`", page)
    assert len(named) > 20
    current = None
    for module, test, same_module_test in named:
        current = module or current
        [path] = (ROOT / "tests").rglob(current)  # tests/<subpackage>/<module>
        source = path.read_text()
        for name in (test, same_module_test):
            assert not name or re.search(rf"^def {name}\(", source, flags=re.M), f"{current}::{name}"
