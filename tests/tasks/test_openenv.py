"""env=openenv against a real OpenEnv server started here (tests/openenv_guess.py: guess a digit, replies "Higher."
or "Lower.", on demand a step that hangs or raises): episodes token in and token out, their returns, the server's
faults under env.reward_errors, one-line errors before any work, and grpo.py / grpo-async.py end to end."""
import contextlib
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from helpers import (
    ROOT,
    SMALL,
    ScriptedPolicy,
    cfg_with,
    failure_excerpt,
    free_port,
    metric_rows,
    needs_ray,
    ray_processes,
    rendered,
    run,
)
from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.trajectories import PromptSampler

pytestmark = pytest.mark.needs("openenv")


@contextlib.contextmanager
def guess_server():
    """The game's server on a free port of localhost: its address, once it answers."""
    port, log = free_port(), tempfile.TemporaryFile("w+")  # a file: a pipe nobody reads would fill and stall it
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "openenv_guess.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the OpenEnv test server did not start: {log.read()[-2000:]}")
                time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server_url():
    with guess_server() as url:
        yield url


def collector(tokenizer, policy, url, *overrides):
    """The collector of env=openenv at ``url``: seeds 3 and 4 (digits 3 and 4), two episodes each."""
    cfg = cfg_with("model=tiny", "env=openenv", f"env.url={url}", "env.first_seed=3", "env.size=2", "env.num_envs=2",
                   "env.repeats=2", "train.optim_batch_size=4", "inference_model.max_tokens=16", *overrides)
    task, turns = build_episode_task(cfg.env)
    return Collector(task, tokenizer, policy, PromptSampler(2, seed=0), resolve_run(cfg).collect, turns)


def test_an_episode_holds_the_sampled_and_the_servers_ids_and_earns_its_return(tokenizer, server_url):
    """Guesses 5, 3, 4 in turn: seed 3's episodes end on the server's "Right!" after two turns, seed 4's go to the
    third turn (env.max_steps), which is played when the episode is scored. Every episode's return is 1."""
    policy = ScriptedPolicy(tokenizer, ["5", "3", "4"])
    c = collector(tokenizer, policy, server_url)
    groups, stats = c.sample_groups()
    batch, metrics, _ = c.collect(0, (groups, stats))
    assert {e.conversation[0]["content"] for g in groups for e in g.episodes} == {
        "I am thinking of a digit from 0 to 9. Guess it: reply with one digit."}  # the reset's observation
    played = {len(e.conversation): e for g in groups for e in g.episodes}
    two, three = played[4], played[6]  # the opening, then 2 or 3 (assistant, user) exchanges
    assert [m["content"] for m in two.conversation[1:]] == ["5", "Lower.", "3"]
    assert [m["content"] for m in three.conversation[1:]] == ["5", "Lower.", "3", "Higher.", "4"]
    assert two.ended == "answer" and three.ended == "max_steps"
    for episode in (two, three):  # the ids: the conversation as it renders, the server's replies inserted
        whole = rendered(tokenizer, episode.conversation)
        ids = episode.episode.tokens
        assert ids == whole[: len(ids)] and tokenizer.decode(whole[len(ids):]) == "\n"
    assert batch["reward"].tolist() == [1.0] * 4 and metrics["turns/env_errors"] == 0
    assert metrics["turns/engine_turns"] == 2.5
    assert not c.task.server.idle and not c.task.server.ended  # every session closed, nothing kept


def test_a_step_that_raises_or_hangs_ends_its_episode_as_env_reward_errors_says(tokenizer, server_url):
    policy = ScriptedPolicy(tokenizer, ["crash", "3"])
    c = collector(tokenizer, policy, server_url)
    with pytest.raises(RunError, match=r"reward 'env_reward' .* raised ServerError: OpenEnv server http://127.0.0.1:"
                                       r"\d+: step failed \(RuntimeError: Server error: the game crashed"):
        c.collect(0, c.sample_groups())
    c = collector(tokenizer, ScriptedPolicy(tokenizer, ["hang"]), server_url, "env.reward_errors=zero",
                  "env.timeout_s=1")
    started = time.time()
    batch, metrics, _ = c.collect(0, c.sample_groups())
    assert batch["reward"].tolist() == [0.0] * 4 and metrics["turns/env_errors"] == 1
    assert metrics["reward_errors"] == 4 and time.time() - started < 30  # each timed out after 1 s
    server = c.task.server
    assert server.turn(3, (), "hang") is None and server.failed(3, ("hang",))
    with pytest.raises(Exception, match=r"step timed out after 1 s \(env.timeout_s\)"):
        server.episode_return(3, ("hang",))


def test_a_server_that_goes_away_mid_episode_ends_it_with_an_error(tokenizer):
    with guess_server() as url:
        task, _ = build_episode_task(cfg_with("model=tiny", "env=openenv", f"env.url={url}", "env.size=1",
                                              "env.timeout_s=5").env)
        server = task.server
        assert server.turn(0, (), "5") == "Lower."
    assert server.turn(0, ("5",), "0") is None and server.failed(0, ("5", "0"))
    with pytest.raises(Exception, match=rf"OpenEnv server {url}: step failed"):
        server.episode_return(0, ("5", "0"))


def test_no_server_a_missing_field_or_a_missing_extra_is_one_line_before_any_work(server_url, monkeypatch):
    port = free_port()
    with pytest.raises(ConfigError, match=rf"^env.url=http://127.0.0.1:{port}: OpenEnv server http://127.0.0.1:{port}: "
                                          r"connecting failed \(.*\); start the server, or point env.url at it$"):
        build_episode_task(cfg_with("env=openenv", f"env.url=http://127.0.0.1:{port}", "env.timeout_s=2").env)
    with pytest.raises(ConfigError, match=r"^env.observation_field=text: the reset's observation has no such field; "
                                          r"it has prompt$"):
        build_episode_task(cfg_with("env=openenv", f"env.url={server_url}", "env.observation_field=text").env)
    with pytest.raises(ConfigError, match=r"^env.url='localhost': give the OpenEnv server's address"):
        build_episode_task(cfg_with("env=openenv", "env.url=localhost").env)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openenv" else real(name, *a))
    with pytest.raises(ConfigError,
                       match=r"openenv-core\) is not installed; pip install -e \"\.\[openenv\]\" \(beside "):
        build_episode_task(cfg_with("env=openenv", f"env.url={server_url}").env)


ARGS = [*SMALL, "env=openenv", "env.size=8", "inference_model.backend=transformers", "train.total_dialog_turns=16",
        "logging.eval_frequency=2", "eval.num_prompts=2"]


@pytest.mark.parametrize("script", ["grpo.py", pytest.param("grpo-async.py", marks=needs_ray)])
def test_the_entry_points_train_on_an_openenv_server(script, server_url, tmp_path):
    """grpo.py, and grpo-async.py, whose rollout actor opens its own sessions in its own process; both evaluate on
    held-out seeds."""
    run_dir = tmp_path / "run"
    done = run([*ARGS, f"env.url={server_url}", f"hydra.run.dir={run_dir}"], cwd=tmp_path, script=script)
    assert done.returncode == 0, failure_excerpt(done)
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == ["0", "1", "2"] and all(r["reward/env_reward"] for r in rows[1:])
    assert float(rows[1]["turns/engine_turns"]) > 1 and float(rows[-1]["eval/prompts"]) == 2
    assert "reward/env_reward" in done.stdout
    assert script == "grpo.py" or not ray_processes()  # grpo.py starts no Ray (the suite's Ray tests may run beside it)
