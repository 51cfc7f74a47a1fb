"""The config schema (torchrl_grpo/config/schema.py) against the real config tree: the YAML and the schema name the
same keys, every key says what it means, null only where allowed (bad values: tests/config/test_bad_inputs.py), and
docs/config-reference.md is what the schema and the defaults give."""
from dataclasses import fields

import pytest

from helpers import ROOT
from helpers import cfg_with as composed
from torchrl_grpo.config.reference import reference_markdown
from torchrl_grpo.config.schema import ASYNC_SECTIONS, SECTIONS, check_schema, section_keys
from torchrl_grpo.config.validate import validate
from torchrl_grpo.core.errors import ConfigError


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


def test_every_schema_field_says_what_it_means():
    for section, schema in SECTIONS + ASYNC_SECTIONS:
        for name, rule in section_keys(section, schema):
            assert len(rule["doc"]) > 8, f"{section}.{name}"


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


def test_the_configuration_reference_is_the_schema_and_the_defaults():
    """A key added, dropped, re-documented or given another default without regenerating the page fails here."""
    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert page == reference_markdown(), (
        "docs/config-reference.md is stale: python -m torchrl_grpo.config.reference > docs/config-reference.md")
    for section, schema in SECTIONS + ASYNC_SECTIONS:
        for name, _ in section_keys(section, schema):
            assert f"| `{section}.{name}` |" in page
