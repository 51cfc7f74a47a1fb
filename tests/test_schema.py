"""The config schema (torchrl_grpo/schema.py) against the real config tree: the YAML and the schema name the
same keys, and a bad value of each kind fails in one line naming the key, with the fix."""
from dataclasses import fields

import pytest

from torchrl_grpo.config import validate
from torchrl_grpo.errors import ConfigError
from torchrl_grpo.schema import ASYNC_SECTIONS, SECTIONS, check_schema, section_keys
from helpers import cfg_with as composed


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_yaml_and_schema_name_the_same_keys(mode):
    cfg = composed(f"mode={mode}")
    for section, schema in SECTIONS + (ASYNC_SECTIONS if mode == "async" else ()):
        declared, present = {name for name, _ in section_keys(section, schema)}, set(cfg[section].keys())
        assert declared <= present, (section, declared - present)
        if section not in ("env", "train"):  # env is open (each task reads its own keys); train has mode keys
            assert present == declared, (section, present - declared)
    train_keys = {f.name for s, schema in SECTIONS + ASYNC_SECTIONS if s == "train" for f in fields(schema)}
    assert set(composed("mode=async").train.keys()) == train_keys


def test_every_schema_field_says_what_it_means():
    for section, schema in SECTIONS + ASYNC_SECTIONS:
        for name, rule in section_keys(section, schema):
            assert len(rule["doc"]) > 8, f"{section}.{name}"


@pytest.mark.parametrize("override, message", [
    ("train.seed=abc", "train.seed='abc': must be an integer"),
    ("env.num_envs=1.5", "env.num_envs=1.5: must be a positive integer"),
    ("logging.checkpoint_frequency=-1", "logging.checkpoint_frequency=-1: must be an integer >= 0"),
    ("train.kl_to_ref_coeff=-0.1", "train.kl_to_ref_coeff=-0.1: must be a number >= 0"),
    ("train.entropy_coeff=true", "train.entropy_coeff=True: must be a number >= 0"),
    ("optimizer.lr=0", "optimizer.lr=0: must be a number > 0"),
    ("inference_model.gpu_memory_utilization=1.5", "inference_model.gpu_memory_utilization=1.5: must be in (0, 1]"),
    ("train.sync_iter=maybe", "train.sync_iter='maybe': must be true or false"),
    ("optimizer.name=Lion", "optimizer.name='Lion': choose one of AdamW, Adam, SGD"),
    ("loss.tis_cap=0", "loss.tis_cap=0: must be a number > 0 (e.g. 2), or null to turn TIS off"),
    ("loss.off_policy_mask_threshold=-1", "loss.off_policy_mask_threshold=-1: must be a number > 0 (e.g. 0.5)"),
    ("optimizer.clip_grad_norm=-1", "optimizer.clip_grad_norm=-1: must be > 0, or null for no clipping"),
    ("eval.temperature=-1", "eval.temperature=-1: must be a number >= 0 (0 = greedy)"),
    ("~train.epochs", "train.epochs is missing from the config"),
])
def test_a_bad_value_of_each_kind_names_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError) as err:
        validate(composed(override))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_null_only_where_the_schema_allows_it():
    check_schema(composed("loss.tis_cap=null", "optimizer.clip_grad_norm=null", "eval.num_prompts=null"))
    with pytest.raises(ConfigError, match=r"^optimizer.lr=None: must be a number > 0"):
        check_schema(composed("optimizer.lr=null"))


@pytest.mark.parametrize("override, message", [
    ("ray.num_actors=0", "ray.num_actors=0: must be a positive integer"),
    ("train.max_staleness=-1", "train.max_staleness=-1: must be a number >= 0"),
    ("ray.collect_timeout_s=0", "ray.collect_timeout_s=0: must be a number of seconds > 0"),
])
def test_async_keys_are_checked_in_async_mode_only(override, message):
    with pytest.raises(ConfigError) as err:
        validate(composed("mode=async", override))
    assert str(err.value).startswith(message)
    validate(composed("mode=async"))
    validate(composed())  # sync mode has no ray: block and needs none
