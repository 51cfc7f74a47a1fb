"""Custom rewards named by import path in the config, combined and logged apart."""
import os
from pathlib import Path

import pytest

from helpers import SMALL, cfg_with, metric_rows, needs_vllm, run
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.tasks import build_task


def shouting(completion: str, row) -> float:
    return float(completion.isupper())


def test_length_example_config_builds_the_trl_length_reward():
    task = build_task(cfg_with("env=length_reward").env)
    assert task.reward_names == ["accuracy", "answer_format", "length"]
    assert task.reward_weights == {"accuracy": 0.0, "answer_format": 0.0, "length": 1.0}
    row = task.rows[0]
    parts = task.score("x" * 26, row)
    assert parts["length"] == -6.0 and task.total(parts) == -6.0


def test_several_custom_rewards_combine_with_their_weights():
    env = {"dataset": "gsm_symbolic", "size": 8, "rewards": [
        {"_target_": "test_custom_rewards.shouting", "weight": 2.0},
        {"_target_": "torchrl_grpo.tasks.examples.length_reward", "name": "len20", "weight": 0.5},
    ]}
    task = build_task(env)
    parts = task.score("#### 7" + "A" * 14, task.rows[0])
    assert parts["shouting"] == 1.0 and parts["len20"] == 0.0
    assert task.total(parts) == pytest.approx(1.0 * parts["accuracy"] + 0.5 * parts["answer_format"] + 2.0)


@pytest.mark.parametrize("entry, message", [
    ({"_target_": "no_such_module.fn"}, r"^env.rewards\[0\]._target_=no_such_module.fn: cannot import it"),
    ({"weight": 1.0}, r"^env.rewards\[0\]: give the reward function's import path as _target_"),
    ({"_target_": "test_custom_rewards.shouting", "weight": "x"}, r"^env.rewards\[0\].weight='x': must be a number"),
    ({"_target_": "test_custom_rewards.shouting", "name": "accuracy"}, r"^env.rewards\[0\].name='accuracy'"),
])
def test_bad_custom_rewards_name_the_key(entry, message):
    with pytest.raises(ConfigError, match=message):
        build_task({"dataset": "gsm_symbolic", "size": 4, "rewards": [entry]})


CALLS = {"n": 0}


def fails_on_the_twelfth_call(completion: str, row) -> float:
    """A user's reward with a bug that shows on some row: the 12th completion scored (step 2 of SMALL's 8)."""
    CALLS["n"] += 1
    if CALLS["n"] == 12:
        raise ZeroDivisionError("division by zero")
    return 0.0


def broken(completion: str, row) -> float:
    return {}["missing"]


def test_a_reward_that_raises_names_itself_and_the_row_or_scores_zero(caplog):
    env = {"dataset": "gsm_symbolic", "size": 4, "rewards": [{"_target_": "test_custom_rewards.broken"}]}
    task = build_task(env)
    row = task.rows[0]
    with pytest.raises(RunError) as err:
        task.score("#### 1", row)
    message = str(err.value)
    assert message.startswith("reward 'broken' (test_custom_rewards.broken) raised KeyError: 'missing' on the row "
                              f"whose prompt starts {row['question'][:60]!r}; fix the function, or set "
                              "env.reward_errors=zero")
    assert "\n" not in message
    task = build_task({**env, "reward_errors": "zero"})
    with caplog.at_level("WARNING"):
        first, second = task.score("#### 1", row), task.score("#### 2", row)
    assert first["broken"] == 0.0 and second["broken"] == 0.0 and task.reward_error_count == 2
    logged = [r for r in caplog.records if "reward 'broken'" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # the first traceback, once


@needs_vllm
def test_a_reward_that_raises_stops_the_run_after_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    out = run([*SMALL, "train.total_dialog_turns=32", "logging.checkpoint_frequency=0",
               "env.rewards=[{_target_: test_custom_rewards.fails_on_the_twelfth_call}]", f"hydra.run.dir={run_dir}"],
              cwd=tmp_path, env_extra={"PYTHONPATH": os.pathsep.join(str(Path(__file__).parents[i]) for i in (0, 1))})
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: reward 'fails_on_the_twelfth_call' (test_custom_rewards.fails_on_the_twelfth_"
                                "call) raised ZeroDivisionError: division by zero on the row whose prompt starts")
    assert f"stopped (checkpoint of step 1 saved in {run_dir / 'checkpoints'}" in lines[-1]
    assert (run_dir / "checkpoints" / "step_000001" / "trainer_state.pt").is_file()
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == [1]
