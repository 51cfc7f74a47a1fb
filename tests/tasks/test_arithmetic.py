"""env=arithmetic: reasoning-gym's numeric problems checked as GSM8K is, with a test split of questions that
training never sees."""
import shlex

import pytest
from omegaconf import OmegaConf

from helpers import FIRST_COMMAND, cfg_with, metric_rows, needs_vllm, run
from torchrl_grpo.config.spec import eval_env
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks import build_task
from torchrl_grpo.tasks.arithmetic import split_of


def env(**overrides):
    base = {"dataset": "arithmetic", "tasks": [{"name": "products", "min_terms": 2, "max_terms": 2,
                                                "min_digits": 1, "max_digits": 1}, "leg_counting"],
            "size": 40, "seed": 5, "split": "train", "system_prompt": None, "reward_weights": None, "rewards": []}
    return OmegaConf.create({**base, **overrides})


def test_rows_are_the_generated_problems_of_one_split_each_once():
    import reasoning_gym

    gen = reasoning_gym.create_dataset("products", size=40, seed=5, min_terms=2, max_terms=2, min_digits=1,
                                       max_digits=1)
    expected = {}
    for i in range(40):
        expected.setdefault(gen[i]["question"], str(gen[i]["answer"]))
    for split in ("train", "test"):
        task = build_task(env(split=split))
        mine = [i for i, t in enumerate(task.rows["task"]) if t == "products"]
        questions = [task.rows[i]["question"] for i in mine]
        assert len(set(questions)) == len(questions)
        assert {q: task.rows[i]["answer"] for q, i in zip(questions, mine)} == \
            {q: a for q, a in expected.items() if split_of(q) == split}
        assert "#### <number>" in task.system_prompt
    assert set(build_task(env()).rows["task"]) == {"products", "leg_counting"}


def test_the_test_split_is_a_quarter_of_the_questions_by_their_text():
    import zlib

    questions = [f"q{i}" for i in range(400)]
    test = [q for q in questions if split_of(q) == "test"]
    assert test == [q for q in questions if zlib.crc32(q.encode()) % 4 == 0] and 70 < len(test) < 130


def test_default_config_evaluates_on_questions_never_trained_on():
    cfg = cfg_with("env=arithmetic")
    train, test = build_task(cfg.env), build_task(eval_env(cfg.env))
    assert not set(train.rows["question"]) & set(test.rows["question"])
    assert set(test.rows["task"]) == {"products", "chain_sum"} and len(test) >= 50


def test_scores_the_last_number_whatever_the_format():
    task = build_task(env())
    row = next(r for r in task.rows if r["task"] == "products")
    right, wrong = row["answer"], str(int(row["answer"]) + 1)
    assert task.score(f"#### {right}", row) == {"accuracy": 1.0, "answer_format": 1.0}
    assert task.score(f"It is {wrong}, no: {right}.", row) == {"accuracy": 1.0, "answer_format": 0.0}
    assert task.score(f"#### {right} or {wrong}", row) == {"accuracy": 0.0, "answer_format": 1.0}


@pytest.mark.parametrize("overrides, message", [
    ({"tasks": []}, "env.tasks is empty"),
    ({"tasks": ["syllogism"]}, "syllogism answers .*not a number.*env=reasoning_gym"),
    ({"split": "valid"}, "env.split='valid': choose train or test"),
    ({"size": 0}, "env.size=0"),
    ({"tasks": ["no_such_task"]}, r"env.tasks\[0\]='no_such_task'"),
])
def test_bad_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_task(env(**overrides))


@needs_vllm
def test_the_readme_first_command_runs_with_the_tiny_model(tmp_path):
    """`grpo.py --config-name grpo_arithmetic` (the README's first command) end to end, the model swapped for the
    tiny one and the run cut to 2 steps: per-task metrics, the greedy evaluation on the 70 test questions
    before and after, the step timings, and the figures."""
    out = run([*shlex.split(FIRST_COMMAND)[2:], "model=tiny", "train.total_dialog_turns=32",
               "logging.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    table = metric_rows(tmp_path / "run")
    assert [r["step"] for r in table] == ["0", "1", "2"]
    assert [float(table[i]["eval/responses"]) for i in (0, 2)] == [70.0, 70.0]
    assert {"score_time", "optimizer_time"} <= set(table[1])
    tasks = {key.split("/")[1] for r in table[1:] for key, v in r.items() if key.startswith("task/") and v != ""}
    assert tasks and tasks <= {"products", "chain_sum"}  # the step's 2 questions: either task, or both
    assert "  eval, step 0 -> step 2: accuracy " in out.stdout
    assert (tmp_path / "run" / "plots" / "eval.png").is_file()
