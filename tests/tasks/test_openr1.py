"""Open-R1's rewards (torchrl_grpo/tasks/openr1.py), each against values worked out by hand on small inputs, and
its recipe (--config-name grpo_openr1) run offline on a local file of OpenR1-Math-220k's columns."""
import json
import math

import pytest

from helpers import metric_rows, needs_vllm, run
from torchrl_grpo.tasks import build_task
from torchrl_grpo.tasks.openr1 import (
    CosineScaled,
    RepetitionPenalty,
    SoftOverlong,
    accuracy,
    length,
    reasoning_steps,
    tag_count,
)
from torchrl_grpo.tasks.openr1 import format as format_reward

GOOD = "<think>\nhalf of one\n</think>\n<answer>\n$\\boxed{\\frac{1}{2}}$\n</answer>"


def test_accuracy_checks_the_answer_against_the_solution_by_math_verify():
    solutions = ["So it is $\\frac{1}{2}$.", "So it is $\\frac{1}{2}$.", "no latex here"]
    got = accuracy([GOOD, "\\boxed{0.25}", "\\boxed{1}"], solution=solutions)
    assert got == [1.0, 0.0, None]  # the third's gold does not parse: not applicable
    assert accuracy([[{"role": "assistant", "content": GOOD}]], solution=solutions[:1]) == [1.0]  # messages too


def test_format_tag_count_and_reasoning_steps_by_hand():
    assert format_reward([GOOD, "<think>x</think><answer>y</answer>", GOOD + " trailing"]) == [1.0, 0.0, 0.0]
    assert tag_count([GOOD, "<think>\nx\n</think>\n", "nothing", GOOD + "\n<answer>\n"]) == [1.0, 0.5, 0.0, 0.75]
    steps = "Step 1: add.\nStep 2: divide.\n- check\nFinally, done."
    assert reasoning_steps([steps, "First, think.", "none"]) == [1.0, 1 / 3, 0.0]


def test_length_is_kimis_over_the_batch():
    solution = ["$\\frac{1}{2}$"] * 3
    right_short, right_long, wrong = "\\boxed{0.5}", "\\boxed{0.5}" + " " * 19, "\\boxed{3}" + " " * 7
    lengths = [11, 30, 16]  # lam = 0.5 - (len - 11) / 19
    lam = [0.5 - (n - 11) / 19 for n in lengths]
    assert length([right_short, right_long, wrong], solution=solution) == pytest.approx(
        [lam[0], lam[1], min(0.0, lam[2])])
    assert length(["\\boxed{1}", "\\boxed{2}"], solution=solution[:2]) == [0.0, 0.0]  # one length: all 0


def test_cosine_scaled_rewards_short_right_answers_most():
    reward = CosineScaled(max_len=100)
    right, wrong = "\\boxed{0.5}" + "x" * 39, "\\boxed{2}" + "x" * 91  # 50 and 100 characters
    got = reward([right, wrong], solution=["$\\frac{1}{2}$"] * 2)
    # right at half the length: 0.5 + 0.5 * 0.5 * (1 + cos(pi/2)) = 0.75; wrong at max_len: -0.5 + 0.5 * (-0.5) * 0
    assert got == pytest.approx([0.5 + 0.25 * (1 + math.cos(math.pi / 2)), -0.5 + 0.5 * (-1.0 + 0.5) * 0.0])


def test_repetition_penalty_and_soft_overlong_by_hand():
    # 2-grams of "a b c a b c": ab bc ca ab bc -> 3 distinct of 5
    assert RepetitionPenalty(ngram_size=2, max_penalty=-1.0)(["a b c A B c", "one", ""]) == pytest.approx(
        [-(1 - 3 / 5), 0.0, 0.0])
    with pytest.raises(ValueError, match="must not be positive"):
        RepetitionPenalty(max_penalty=0.5)
    overlong = SoftOverlong(max_completion_len=10, soft_punish_cache=4)
    assert overlong([""] * 4, completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 11]) == [0.0, -0.5, -1.0, -1.0]


def test_parameterised_rewards_are_made_from_their_config_entries(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"problem": "Half of 1?", "solution": "$\\frac{1}{2}$"}) + "\n")
    task = build_task({"dataset": "prompts", "data_path": str(path), "prompt_column": "problem", "rewards": [
        {"_target_": "torchrl_grpo.tasks.openr1.CosineScaled", "max_len": 100, "name": "cosine"},
        {"_target_": "torchrl_grpo.tasks.openr1.RepetitionPenalty", "ngram_size": 2, "max_penalty": -0.5},
        {"_target_": "torchrl_grpo.tasks.openr1.accuracy"}]})
    assert task.reward_names == ["cosine", "RepetitionPenalty", "accuracy"]
    scores = task.score_batch(["\\boxed{0.5}" + "x" * 39], [task.rows[0]], [[1, 2, 3]])[0]
    assert scores == {"cosine": pytest.approx(0.75), "RepetitionPenalty": 0.0, "accuracy": 1.0}


@needs_vllm
def test_the_recipe_runs_offline_on_a_local_sample_of_its_dataset(tmp_path):
    rows = [{"problem": f"What is {i} + {i}?", "solution": f"Adding gives $\\boxed{{{2 * i}}}$.", "answer": str(2 * i),
             "problem_type": "Algebra", "source": "synthetic"} for i in range(8)]
    data = tmp_path / "openr1_sample.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run(["--config-name", "grpo_openr1", "model=tiny", f"env.data_path={data}", "env.num_envs=2",
               "env.repeats=4", "train.optim_batch_size=4", "train.gradient_accumulation_steps=2",
               "train.total_dialog_turns=16", "optimizer.warmup_steps=1", "inference_model.max_tokens=16",
               "inference_model.max_model_len=512", "train_model.gradient_checkpointing=false",
               "logging.progress_bar=false", "hydra.run.dir=run"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    table = metric_rows(tmp_path / "run")
    assert len(table) == 2 and all(r["reward/format"] == "0.0" for r in table)  # a random model writes no tags
    assert all(0.0 <= float(r["reward/accuracy"]) <= 1.0 for r in table) and float(table[0]["lr"]) == 0.0
