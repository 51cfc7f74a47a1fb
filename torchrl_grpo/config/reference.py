"""The configuration reference (docs/config-reference.md), written from the schema and the shipped defaults.

Every key of :mod:`torchrl_grpo.config.schema`: its kind and range, whether null is allowed, its default in
``config/grpo_gsm8k.yaml`` (the async keys: with ``config/mode/async.yaml``) and its meaning. The page is
generated, never edited by hand: ``python -m torchrl_grpo.config.reference > docs/config-reference.md``;
``tests/config/test_schema.py`` fails when the page and the schema part.
"""
from __future__ import annotations

import json

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.config.schema import ASYNC_SECTIONS, SECTIONS, section_keys

KINDS = {  # schema kind -> what a reader is told
    "int": "integer", "int>0": "integer > 0", "int>=0": "integer >= 0", "num>0": "number > 0", "num>1": "number > 1",
    "num>=0": "number >= 0", "auto|num>=0": "auto or number >= 0",
    "prob": "number in (0, 1]", "share": "number in [0, 1)", "unit": "number in [0, 1]",
    "bool": "true / false", "str": "string", "any": "any",
}

HEADER = """# Configuration reference

Every key the trainer reads, section by section: what it may hold, its default in `config/grpo_gsm8k.yaml`
(the `ray` section and the async `train` keys: `config/mode/async.yaml`, which `grpo-async.py` adds) and what it
means. Other shipped configs (`--config-name grpo_arithmetic`, `grpo_python_tool`, `grpo_ifeval`, `grpo_openr1`,
`grpo_math`, `grpo_countdown`) and the groups under `config/` (`model=`, `env=`, `loss=`) change defaults, never
the keys. A bad value, a missing key or an unknown one is a one-line error naming it (exit code 2). Besides the
`env` keys below, each task reads its own, declared by its settings class and checked the same way
([tasks](tasks.md#add-your-own-task)).

This page is generated from `torchrl_grpo/config/schema.py`:
`python -m torchrl_grpo.config.reference > docs/config-reference.md`.
"""


def _defaults() -> tuple[dict, dict]:
    """The default config and the async one, resolved, as plain dicts."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        sync = OmegaConf.to_container(compose(config_name="grpo_gsm8k"), resolve=True)
        asynchronous = OmegaConf.to_container(compose(config_name="grpo_gsm8k", overrides=["mode=async"]),
                                              resolve=True)
    return sync, asynchronous


def _plain(value) -> str:
    """A value as YAML writes it: true, null, 0.1, auto."""
    return value if isinstance(value, str) else json.dumps(value)


def _value(value) -> str:
    return "null" if value is None else f"`{_plain(value)}`".replace("|", "\\|")


def _kind(rule: dict) -> str:
    kind = " \\| ".join(map(_plain, rule["choices"])) if rule["kind"] == "choice" else KINDS[rule["kind"]]
    return f"{kind} or null" if rule["null"] else kind


def reference_markdown() -> str:
    """The whole page."""
    sync, asynchronous = _defaults()
    parts = [HEADER]
    for sections, defaults, note in ((SECTIONS, sync, ""), (ASYNC_SECTIONS, asynchronous, " (async)")):
        for section, schema in sections:
            parts.append(f"\n## `{section}`{note}\n\n| key | value | default | meaning |\n|---|---|---|---|")
            for name, rule in section_keys(section, schema):
                meaning = rule["doc"].replace("|", "\\|")
                parts.append(f"| `{section}.{name}` | {_kind(rule)} | {_value(defaults[section][name])} | {meaning} |")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
