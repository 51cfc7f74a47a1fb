"""The Python API's keyword settings: the same config as the command line's override strings, one-line errors."""
import pytest
from omegaconf import OmegaConf

from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.config.command_line import apply_settings, compose_config, group_choices
from torchrl_grpo.core.errors import ConfigError


def composed(overrides=(), **settings):
    choices, values = group_choices(str(CONFIG_DIR), settings)
    cfg = compose_config(str(CONFIG_DIR), "grpo_arithmetic", [*choices, *overrides])
    apply_settings(cfg, values)
    return OmegaConf.to_container(cfg)


def test_keyword_settings_compose_the_config_the_override_strings_do():
    strings = composed(["model=tiny", "loss=dapo", "optimizer.lr=1e-05", "env.num_envs=4", "train.seed=3",
                        "env.system_prompt='Answer: {x}, then stop.'",
                        "env.rewards=[{_target_:torchrl_grpo.tasks.rewards.answer_format,weight:0.5}]"])
    keywords = composed(model="tiny", loss="dapo", optimizer={"lr": 1e-5}, train={"seed": 3},
                        env={"num_envs": 4, "system_prompt": "Answer: {x}, then stop.",
                             "rewards": [{"_target_": "torchrl_grpo.tasks.rewards.answer_format", "weight": 0.5}]})
    assert keywords == strings
    assert keywords["loss"]["clip_epsilon_high"] != composed()["loss"]["clip_epsilon_high"]  # dapo was chosen


def test_keyword_settings_and_strings_mix():
    assert composed(["model=tiny"], optimizer={"lr": 0.5})["optimizer"]["lr"] == 0.5


@pytest.mark.parametrize("settings, message", [
    ({"optimizer": {"lrr": 1e-5}}, "optimizer.lrr: no such key in the config; check its spelling"),
    ({"optimzer": {"lr": 1e-5}}, "optimzer: no such key in the config"),
])
def test_a_misspelt_keyword_setting_is_one_line_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        composed(**settings)


def test_a_tasks_own_keys_are_added_and_its_settings_check_them():
    """``env`` keys the config lacks are a task's own (``+env.<key>`` on the command line): added, then checked by
    the task's settings class before anything loads, a misspelt one named in one line."""
    from torchrl_grpo.config.spec import resolve_run
    from torchrl_grpo.run.build import check_task_keys

    def checked(overrides=(), **settings):
        choices, values = group_choices(str(CONFIG_DIR), settings)
        cfg = compose_config(str(CONFIG_DIR), "grpo_arithmetic", [*choices, *overrides])
        apply_settings(cfg, values)
        check_task_keys(resolve_run(cfg))
        return cfg

    # env=custom has no key of the task's own: they are added (a builder by import path, as users name theirs)
    own = {"_target_": "torchrl_grpo.tasks.gsm8k.build_gsm8k_task", "dataset": "gsm_symbolic", "size": 64}
    assert checked(["env=custom"], env=own).env.size == 64
    with pytest.raises(ConfigError, match=r"^env\.num_env: env\.dataset=arithmetic reads no such key \(did you mean "
                                          r"env\.num_envs\?\)"):
        checked(env={"judge": {"model": "m"}, "num_env": 4})
