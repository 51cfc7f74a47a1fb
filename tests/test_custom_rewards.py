"""Custom rewards named by import path in the config, combined and logged apart."""
import pytest

from helpers import cfg_with
from torchrl_grpo.errors import ConfigError
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
