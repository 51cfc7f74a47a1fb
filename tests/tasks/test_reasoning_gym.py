"""env=reasoning_gym: several reasoning-gym datasets pooled, scored by their own checkers, with a held-out
evaluation split; and the per-task metrics of mixed-task batches."""
import pytest
from omegaconf import OmegaConf

from helpers import SMALL, cfg_with, metric_rows, needs_vllm, run
from torchrl_grpo.config.spec import eval_env
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks import build_task, per_task_means
from torchrl_grpo.tasks.reasoning_gym_tasks import answer_text


def env(**overrides):
    base = {"dataset": "reasoning_gym", "tasks": ["syllogism", "leg_counting"], "size": 6, "seed": 3,
            "system_prompt": None, "reward_weights": None, "rewards": []}
    return OmegaConf.create({**base, **overrides})


def test_rows_interleave_the_tasks_and_hold_what_scoring_needs():
    task = build_task(env())
    assert len(task) == 12 and task.success_reward == "accuracy"
    assert task.rows["task"] == ["syllogism", "leg_counting"] * 6
    assert task.rows["index"] == [i for i in range(6) for _ in range(2)]
    import reasoning_gym

    gen = reasoning_gym.create_dataset("leg_counting", size=6, seed=3)
    assert task.rows[5]["question"] == gen[2]["question"] and task.rows[5]["answer"] == str(gen[2]["answer"])
    assert "<answer>" in task.system_prompt  # reasoning-gym's default prompt asks for the answer tags


def test_scores_use_the_datasets_own_checker_on_the_last_answer_block():
    task = build_task(env())
    row = task.rows[1]  # leg_counting: a number
    right, wrong = row["answer"], str(int(row["answer"]) + 1)
    assert task.score(f"<answer>{right}</answer>", row) == {"accuracy": 1.0, "answer_format": 1.0}
    assert (task.score(f"<answer>{right}</answer> then <answer>{wrong}</answer>", row)
            == {"accuracy": 0.0, "answer_format": 1.0})
    assert task.score(f"the answer is {right}", row) == {"accuracy": 0.0, "answer_format": 0.0}
    assert task.total({"accuracy": 1.0, "answer_format": 1.0}) == 1.5
    assert answer_text("x <answer> 7 </answer>") == "7"


def test_a_row_from_other_generation_settings_is_refused():
    task = build_task(env())
    row = dict(task.rows[0])
    with pytest.raises(ConfigError, match="env.tasks, env.size and env.seed"):
        task.score("<answer>Yes</answer>", {**row, "question": "something else"})
    with pytest.raises(ConfigError, match="not one of this run's"):
        task.score("<answer>Yes</answer>", {**row, "index": 99})


def test_held_out_evaluation_split_from_the_default_config():
    cfg = cfg_with("env=reasoning_gym", "env.size=4", "env.eval.size=2")
    train, held = build_task(cfg.env), build_task(eval_env(cfg.env))
    train_tasks, eval_tasks = set(train.rows["task"]), set(held.rows["task"])
    assert train_tasks == {"number_filtering", "string_insertion", "family_relationships", "maze"}
    assert eval_tasks == train_tasks | {"base_conversion"}
    assert len(held) == 10 and not set(held.rows["question"]) & set(train.rows["question"])


@pytest.mark.parametrize("tasks, message", [
    ([], "env.tasks is empty"),
    (["syllogism", "no_such_task"], r"env.tasks\[1\]='no_such_task': not a reasoning-gym dataset"),
    (["syllogism", "syllogism"], r"env.tasks\[1\]='syllogism': listed twice"),
    ([{"name": "leg_counting", "bogus_key": 1}], r"env.tasks\[0\] \(leg_counting\): reasoning-gym refused"),
    ([{"size": 3}], r"env.tasks\[0\]="),
])
def test_bad_task_lists_name_the_key(tasks, message):
    with pytest.raises(ConfigError, match=message):
        build_task(env(tasks=tasks))


def test_entries_carry_their_own_size_and_dataset_config():
    task = build_task(env(tasks=[{"name": "leg_counting", "size": 2, "min_animals": 1, "max_animals": 1}, "syllogism"]))
    assert task.rows["task"] == ["leg_counting", "syllogism"] * 2 + ["syllogism"] * 4


def test_per_task_means_by_hand():
    rows = [{"task": "a"}, {"task": "b"}, {"task": "a"}]
    components = [{"accuracy": 1.0}, {"accuracy": 0.0}, {"accuracy": 0.0}]
    assert per_task_means(rows, components, [1.5, 0.5, 0.25]) == {
        "task/a/accuracy": 0.5, "task/a/reward": 0.875, "task/b/accuracy": 0.0, "task/b/reward": 0.5}
    assert per_task_means([{"question": "q"}], [{"accuracy": 1.0}], [1.0]) == {}  # single-task rows: nothing


@needs_vllm
def test_grpo_py_trains_on_reasoning_gym_and_evaluates_held_out_tasks(tmp_path):
    """The trainer on env=reasoning_gym with evaluation every 2 steps: per-task training metrics, and eval/
    rows before the first step, at step 2 and after the last step, covering the held-out task."""
    args = [a for a in SMALL if not a.startswith("env")] + [
        "env=reasoning_gym", "env.size=8", "env.eval.size=2", "env.num_envs=2", "env.repeats=4",
        "train.total_dialog_turns=24", "logging.eval_frequency=2", "eval.num_prompts=5",
        f"hydra.run.dir={tmp_path / 'run'}"]
    out = run(args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    table = metric_rows(tmp_path / "run")
    assert [r["step"] for r in table] == ["0", "1", "2", "3"]
    evaluated = [r["step"] for r in table if r.get("eval/accuracy") not in (None, "")]
    assert evaluated == ["0", "2", "3"]
    assert all(float(table[0][f"eval/{t}/reward"]) >= 0 for t in ("maze", "base_conversion"))
    assert table[0].get("reward") in (None, "")  # the step-0 row is the evaluation alone
    trained = {key.split("/")[1] for r in table[1:] for key, v in r.items() if key.startswith("task/") and v != ""}
    assert trained and trained <= {"number_filtering", "string_insertion", "family_relationships", "maze"}
    assert "eval at step 0: accuracy" in out.stdout
    assert "  eval, step 0 -> step 3: accuracy " in out.stdout  # the end-of-run summary: before vs after
