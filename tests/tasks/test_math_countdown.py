"""env=math (MATH competition problems: the last \\boxed{} checked against the gold answer, loaded from local
files here) and env=countdown (reasoning-gym's Countdown, offline), with their whole configs grpo_math and
grpo_countdown; grpo.py end to end on local MATH files."""
import json
import math

import pytest
from omegaconf import OmegaConf

from helpers import SMALL, cfg_with, metric_rows, needs_vllm, run
from torchrl_grpo.config.spec import eval_env
from torchrl_grpo.config.validate import validate
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks import build_task
from torchrl_grpo.tasks.competition_math import equivalent, last_boxed, normalize_answer

# hand-written rows in MATH's layout (problem, level, type, solution) and in MATH-500's (answer, subject)
MATH_ROWS = [
    {"problem": "What is $1+1$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We add: $1+1=\\boxed{2}$."},
    {"problem": "Simplify $\\frac{2}{4}$.", "level": "Level 1", "type": "Algebra",
     "solution": "Divide by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$."},
    {"problem": "Where is the vertex of $y=(x-1)^2+2$?", "level": "Level 2", "type": "Algebra",
     "solution": "It is at $\\boxed{(1, 2)}$."},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("text, boxed", [
    ("so $x=\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # nested braces
    ("first \\boxed{1}, then \\boxed{ 2 }", " 2 "),  # the last one
    ("\\boxed 5 is it", "5"),
    ("\\fbox{7}", "7"),
    ("\\boxed{\\text{(B)}}", "\\text{(B)}"),
    ("\\boxed{1", None),  # never closed
    ("the answer is 5", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("predicted, gold", [
    ("0.5", "\\frac{1}{2}"), ("\\dfrac12", "1/2"), ("-\\frac{3}{4}", "-0.75"), ("1,000", "1000"),
    ("1{,}000", "1000"), ("10\\%", "10"), ("90^\\circ", "90"), ("\\$5.00", "5"), ("x = 3", "3"),
    ("5\\text{ cm}", "5"), ("\\left( 1, 2 \\right)", "(1,2)"), ("\\text{(A)}", "(A)"), ("2\\sqrt2", "2\\sqrt{2}"),
    ("3.", "3"), ("\\frac{6}{4}", "\\frac{3}{2}"),
])
def test_equivalent_answers(predicted, gold):
    assert equivalent(predicted, gold) and equivalent(gold, predicted)


@pytest.mark.parametrize("predicted, gold", [
    ("\\frac{1}{3}", "0.33"), ("(1,2)", "(2,1)"), ("2", "3"), ("1,2", "12"), ("x^2", "x^3"),
    ("\\sqrt{8}", "2\\sqrt{2}"),  # the fallback attempts no symbolic equivalence (math-verify does)
    ("1/0", "0"), ("\\frac{1}{0}", "\\frac{2}{0}"),  # no value: compared as text only
])
def test_different_answers(predicted, gold):
    assert not equivalent(predicted, gold) and not equivalent(gold, predicted)


def test_normalize_answer_by_hand():
    assert normalize_answer(" \\left[ 2, \\dfrac{1}{2} \\right) ") == "[2,\\frac{1}{2})"
    assert normalize_answer("y = 1{,}234\\text{ dollars}.") == "1234"


def math_env(path, **overrides):
    return OmegaConf.create({"dataset": "math", "data_path": str(path), "split": "train", "system_prompt": None,
                             "reward_weights": None, "rewards": [], **overrides})


def test_local_math_rows_and_rewards(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", MATH_ROWS)
    task = build_task(math_env(tmp_path))
    assert task.rows["answer"] == ["2", "\\frac{1}{2}", "(1, 2)"]
    assert task.rows["task"] == ["Prealgebra", "Algebra", "Algebra"] and task.rows["level"][2] == "Level 2"
    assert "\\boxed{}" in task.system_prompt and task.success_reward == "accuracy"
    row = task.rows[1]
    assert task.score("Halve both: $\\boxed{0.5}$", row) == {"accuracy": 1.0, "answer_format": 1.0, "math_verify": 1.0}
    assert task.score("\\boxed{0.5} no, \\boxed{2}", row) == {"accuracy": 0.0, "answer_format": 1.0, "math_verify": 1.0}
    unanswered = task.score("it is 1/2", row)  # no answer: math-verify decided nothing (not applicable)
    assert unanswered["accuracy"] == unanswered["answer_format"] == 0.0 and math.isnan(unanswered["math_verify"])
    assert task.total({"accuracy": 1.0, "answer_format": 1.0, "math_verify": 1.0}) == pytest.approx(1.2)


def test_math_500_layout_takes_its_answer_column(tmp_path):
    rows = [{"problem": "What is $2 \\cdot 3$?", "solution": "It is $\\boxed{6}$.", "answer": "6",
             "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"}]
    task = build_task(math_env(write_jsonl(tmp_path / "math500.jsonl", rows)))
    assert task.rows["answer"] == ["6"] and task.rows["task"] == ["Prealgebra"] and task.rows["level"] == ["1"]


@pytest.mark.parametrize("rows, message", [
    ([{"question": "q", "answer": "1"}], "MATH rows need a 'problem' column and an 'answer' or 'solution' column"),
    ([{"problem": "p", "solution": "no box here"}], "row 0 has no final answer"),
])
def test_bad_math_files_name_the_file(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as err:
        build_task(math_env(path))
    assert str(err.value).startswith(f"env.data_path={path}: {message}")


def test_grpo_math_and_grpo_countdown_compose_and_validate():
    math_cfg = cfg_with(name="grpo_math")
    assert (math_cfg.env.dataset, math_cfg.model.name, math_cfg.inference_model.max_tokens) == \
        ("math", "Qwen/Qwen2.5-1.5B-Instruct", 1024)
    assert eval_env(math_cfg.env)["split"] == "test"
    countdown = cfg_with(name="grpo_countdown")
    assert countdown.env.tasks[0].name == "countdown" and countdown.inference_model.max_tokens == 512
    for cfg in (math_cfg, countdown):
        validate(cfg)


def test_countdown_is_generated_offline_and_scored_by_its_checker():
    env = cfg_with("env=countdown", "env.size=20", "env.eval.size=5").env
    task, held_out = build_task(env), build_task(eval_env(env))
    assert len(task) == 20 and len(held_out) == 5 and set(task.rows["task"]) == {"countdown"}
    assert not set(task.rows["question"]) & set(held_out.rows["question"])
    row = task.rows[0]
    numbers = [int(n) for n in row["question"].split("numbers: ")[1].split(".")[0].split(", ")]
    assert 3 <= len(numbers) <= 4 and all(1 <= n <= 99 for n in numbers)
    assert task.score(f"<answer>{row['answer']}</answer>", row) == {"accuracy": 1.0, "answer_format": 1.0}
    assert task.score(f"<answer>{numbers[0]}</answer>", row)["accuracy"] < 1.0


@needs_vllm
def test_grpo_py_trains_on_local_math_files_with_per_subject_metrics(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", MATH_ROWS)
    write_jsonl(tmp_path / "test.jsonl", MATH_ROWS[:2])
    args = [a for a in SMALL if not a.startswith("env")] + [
        "env=math", f"env.data_path={tmp_path}", "env.num_envs=2", "env.repeats=4", "train.total_dialog_turns=16",
        "logging.eval_frequency=2", f"hydra.run.dir={tmp_path / 'run'}"]
    out = run(args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    table = metric_rows(tmp_path / "run")
    assert [r["step"] for r in table] == ["0", "1", "2"]
    assert table[0]["eval/accuracy"] != "" and table[2]["eval/accuracy"] != ""
    subjects = {key.split("/")[1] for r in table[1:] for key, v in r.items() if key.startswith("task/") and v != ""}
    assert subjects and subjects <= {"Prealgebra", "Algebra"}
