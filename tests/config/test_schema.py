"""The config schema (torchrl_grpo/config/schema.py) against the real config tree: the YAML and the schema name the
same keys, every key says what it means, null only where allowed (bad values: tests/config/test_bad_inputs.py), a
nested section's keys checked alike, and docs/config-reference.md is what the schema and the defaults give, with a
row for every key of the default config."""
import re
from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from helpers import ROOT
from helpers import cfg_with as composed
from torchrl_grpo.config.schema import ASYNC_SECTIONS, SECTIONS, check_schema, leaf_keys, section_keys
from torchrl_grpo.config.validate import check_lora, validate
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.run.reference import reference_markdown
from torchrl_grpo.tasks import TASK_BUILDERS


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_yaml_and_schema_name_the_same_keys(mode):
    cfg = composed(f"mode={mode}")
    for section, schema in SECTIONS + (ASYNC_SECTIONS if mode == "async" else ()):
        declared, present = {name for name, _ in section_keys(section, schema)}, set(cfg[section].keys())
        assert declared <= present, (section, declared - present)
        if section not in ("env", "train"):  # env has its task's keys too (tasks.check_env); train has mode keys
            assert present == declared, (section, present - declared)
    train_keys = {f.name for s, schema in SECTIONS + ASYNC_SECTIONS if s == "train" for f in fields(schema)}
    assert set(composed("mode=async").train.keys()) == train_keys


def test_every_schema_field_and_task_setting_says_what_it_means():
    for section, schema in SECTIONS + ASYNC_SECTIONS:
        for name, rule in leaf_keys(section, schema):
            assert len(rule["doc"]) > 8, name
    for builder in set(TASK_BUILDERS.values()):
        for field in fields(builder.task_settings):
            assert len(field.metadata.get("doc", "")) > 8, (builder.task_settings.__name__, field.name)


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


@pytest.mark.parametrize("overrides, message", [
    (["~train_model.lora.r"], r"^train_model.lora.r is missing from the config"),
    (["train_model.lora.r=0"], r"^train_model.lora.r=0: must be a positive integer \(e.g. 8\)$"),
    (["train_model.lora.sync=both"], r"^train_model.lora.sync='both': choose one of auto, adapter, merged$"),
    (["+train_model.lora.rank=8"], r"^train_model.lora.rank: unknown key; drop it"),
    (["logging.wandb.mode=cloud"], r"^logging.wandb.mode='cloud': choose one of auto, online, offline, disabled$"),
    (["+logging.wandb.entity=me"], r"^logging.wandb.entity: unknown key; drop it"),
    (["~logging.wandb.project"], r"^logging.wandb.project is missing from the config"),
    (["logging.mlflow.tracking_uri=3"], r"^logging.mlflow.tracking_uri=3: must be a string$"),
    (["logging.mlflow=3"], r"^logging.mlflow=3: give a mapping of enabled, tracking_uri, experiment$"),
])
def test_a_nested_sections_keys_are_checked_by_their_dotted_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_schema(composed(*overrides))


def test_a_python_callers_partial_lora_takes_the_defaults_and_the_schemas_checks():
    assert check_lora({"enabled": True, "r": 4, "target_modules": ["q_proj"]}) == {
        "r": 4, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"], "rslora": False, "modules_to_save": None,
        "sync": "auto"}
    with pytest.raises(ConfigError, match=r"^train_model.lora.alpha=0: must be a positive number \(e.g. 2\*r\)$"):
        check_lora({"alpha": 0})
    with pytest.raises(ConfigError, match=r"^train_model.lora.rank: unknown key"):
        check_lora({"rank": 4})


def test_the_configuration_reference_is_the_schema_and_the_defaults():
    """A key added, dropped, re-documented or given another default without regenerating the page fails here."""
    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert page == reference_markdown(), (
        "docs/config-reference.md is stale: python -m torchrl_grpo.run.reference > docs/config-reference.md")
    for section, schema in SECTIONS + ASYNC_SECTIONS:
        for name, _ in leaf_keys(section, schema):
            assert f"| `{name}` |" in page


def _leaves(node: dict, prefix: str = ""):
    """The dotted key of each value of ``node`` that is no mapping (an empty mapping is one)."""
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_key_of_the_default_config_has_a_row_in_the_reference(mode):
    """Its own row, or its parent's where that holds free keyword arguments (``ray.init``) or the evaluation
    split's env keys (``env.eval``); a task's keys are in its table."""
    rows = set(re.findall(r"^\| `([\w.]+)` \|", (ROOT / "docs" / "config-reference.md").read_text(), re.M))
    cfg = OmegaConf.to_container(composed(f"mode={mode}"), resolve=True)
    missing = [key for key in _leaves(cfg)
               if not any(".".join(key.split(".")[:n]) in rows for n in range(1, key.count(".") + 2))]
    assert not missing
    assert {"train_model.lora.r", "logging.wandb.mode", "logging.mlflow.experiment", "env.split"} <= rows
