"""The loss presets (config/loss/*.yaml) through Hydra and validate(), and bad loss keys named in one line."""

import pytest
from omegaconf import OmegaConf

from helpers import CONFIG_DIR, cfg_with
from loss_cases import TableLM
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.run.build import build_loss

# ---------------------------------------------------------------------------------------------------
# presets (config/loss/*.yaml) through Hydra and validate()
# ---------------------------------------------------------------------------------------------------

PRESETS = tuple(sorted(path.stem for path in (CONFIG_DIR / "loss").glob("*.yaml")))


def test_every_preset_sets_every_loss_key():
    keys = {name: set(OmegaConf.load(CONFIG_DIR / "loss" / f"{name}.yaml")) for name in PRESETS}
    assert all(k == keys["grpo"] for k in keys.values()), keys
    assert {"importance_level", "tis_cap", "overlong", "overlong_buffer", "off_policy_mask_threshold",
            "dynamic_sampling", "max_resample_rounds"} <= keys["grpo"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_compose_validate_and_build(name):
    cfg = cfg_with(f"loss={name}")
    loss = build_loss(resolve_run(cfg).loss, TableLM())
    assert loss.aggregation == cfg.loss.aggregation and loss.importance_level == cfg.loss.importance_level
    assert loss.clip_epsilon_high == pytest.approx(cfg.loss.clip_epsilon_high)
    assert loss.aggregation_constant == cfg.inference_model.max_tokens
    resolve_run(cfg_with(f"loss={name}", "model=qwen2.5-1.5b-instruct"))


def test_preset_values():
    dapo, dr, gspo, grpo = (cfg_with(f"loss={n}").loss for n in ("dapo", "dr_grpo", "gspo", "grpo"))
    assert (dapo.clip_epsilon_low, dapo.clip_epsilon_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
    assert dapo.overlong == "soft" and dapo.dynamic_sampling is True and dapo.max_resample_rounds == 3
    assert (dr.reward_scale, dr.aggregation) == ("none", "constant_sum")
    assert (gspo.importance_level, gspo.aggregation) == ("sequence", "sequence_mean")
    assert (gspo.clip_epsilon_low, gspo.clip_epsilon_high) == (3e-4, 4e-4)
    assert (grpo.aggregation, grpo.reward_scale, grpo.kl_estimator) == ("sequence_mean", "group", "k3")
    assert grpo.overlong == "none" and grpo.dynamic_sampling is False and grpo.importance_level == "token"
    sapo, gmpo, rpp = (cfg_with(f"loss={n}").loss for n in ("sapo", "gmpo", "reinforce_pp"))
    assert (sapo.importance_level, sapo.tau_pos, sapo.tau_neg) == ("sapo", 1.0, 1.05)
    assert (gmpo.importance_level, gmpo.aggregation, gmpo.clip_epsilon_low, gmpo.clip_epsilon_high) == (
        "gmpo", "sequence_mean", 0.4, 0.4)
    assert (rpp.reward_scale, rpp.aggregation) == ("reinforce_pp", "token_mean")
    ppo = cfg_with("loss=ppo").loss
    assert (ppo.advantage, ppo.reward_scale, ppo.importance_level, ppo.aggregation) == ("gae", "none", "token",
                                                                                        "token_mean")
    assert {cfg_with(f"loss={n}").loss.advantage for n in PRESETS if n != "ppo"} == {"group"}
    assert set(PRESETS) >= {"grpo", "dapo", "dr_grpo", "gspo", "cispo", "rloo", "sapo", "gmpo", "reinforce_pp", "ppo"}


@pytest.mark.parametrize("overrides, key", [
    (["loss.importance_level=seq"], "loss.importance_level='seq'"),
    (["loss=gspo", "loss.aggregation=token_mean"], "loss.aggregation=token_mean with loss.importance_level=sequence"),
    (["loss.tis_cap=2", "loss.old_log_probs=engine"], "loss.tis_cap=2 with loss.old_log_probs=engine: "),
    (["loss.tis_cap=0", "loss.old_log_probs=trainer"], "loss.tis_cap=0"),
    (["loss.mis_cap=2", "loss.old_log_probs=engine"], "loss.mis_cap=2 with loss.old_log_probs=engine: "),
    (["loss.mis_cap=1", "loss.old_log_probs=trainer"], "loss.mis_cap=1: must be a number > 1"),
    (["loss.mis_cap=2", "loss.tis_cap=2", "loss.old_log_probs=trainer"], "loss.tis_cap=2 with loss.mis_cap=2: "),
    (["loss=gmpo", "loss.aggregation=token_mean"], "loss.aggregation=token_mean with loss.importance_level=gmpo"),
    (["loss.tau_neg=0"], "loss.tau_neg=0"),
    (["loss.overlong=cut"], "loss.overlong='cut'"),
    (["loss=dapo", "loss.overlong_buffer=24"], "loss.overlong_buffer=24 with inference_model.max_tokens=24"),
    (["loss.overlong_buffer=0"], "loss.overlong_buffer=0"),
    (["loss.off_policy_mask_threshold=-1"], "loss.off_policy_mask_threshold=-1"),
    (["loss.dynamic_sampling=3"], "loss.dynamic_sampling=3"),
    (["loss.max_resample_rounds=-1"], "loss.max_resample_rounds=-1"),
    (["loss.max_resample_rounds=1.5"], "loss.max_resample_rounds=1.5"),
    (["loss.advantage=critic"], "loss.advantage='critic'"),
    (["loss=ppo", "loss.importance_level=sequence", "loss.aggregation=sequence_mean"],
     "loss.advantage=gae with loss.importance_level=sequence: a critic gives an advantage per token"),
    (["loss=ppo", "loss.reward_scale=group"], "loss.advantage=gae with loss.reward_scale=group: the critic is"),
    (["loss=ppo", "loss.off_policy_mask_threshold=0.5"], "loss.advantage=gae with loss.off_policy_mask_threshold"),
    (["loss=ppo", "critic.lmbda=1.5"], "critic.lmbda=1.5: must be in [0, 1]"),
    (["loss=ppo", "critic.value_clip=0"], "critic.value_clip=0: must be a number > 0, or null"),
    (["loss=ppo", "critic.lr=0"], "critic.lr=0"),
])
def test_bad_loss_variant_keys_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        resolve_run(cfg_with(*overrides))
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_good_loss_variant_combinations_validate():
    resolve_run(cfg_with("loss.tis_cap=2", "loss.old_log_probs=trainer"))
    resolve_run(cfg_with("loss=gspo", "loss.tis_cap=1.5", "loss.old_log_probs=trainer",
                         "loss.off_policy_mask_threshold=0.5"))
    resolve_run(cfg_with("loss=dapo", "loss.overlong_buffer=8"))
    resolve_run(cfg_with("loss.overlong=mask", "loss.overlong_buffer=100"))  # the buffer only matters with soft
    resolve_run(cfg_with("loss=ppo", "env.repeats=1", "env.num_envs=4", "critic.value_clip=null", "critic.lmbda=0"))
    resolve_run(cfg_with("loss=ppo", "loss.importance_level=cispo", "loss.tis_cap=2", "loss.old_log_probs=trainer"))
