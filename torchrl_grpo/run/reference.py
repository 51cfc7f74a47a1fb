"""The configuration reference (docs/config-reference.md), written from the schema, the task settings classes and
the shipped defaults.

One row per key that holds a value (a nested section's keys each their own, ``train_model.lora.r``): its kind and
range, whether null is allowed, its default in ``config/grpo_gsm8k.yaml`` (the async keys: with
``config/mode/async.yaml``) and its meaning, from :mod:`torchrl_grpo.config.schema`; then the keys every task reads
(:data:`torchrl_grpo.tasks.registry.SHARED_KEYS`) and each built-in task's own, from its settings class. It lives in
``run`` because it reads both the config and the tasks. The page is generated, never edited by hand:
``python -m torchrl_grpo.run.reference > docs/config-reference.md``; ``tests/config/test_schema.py`` fails when the
page and the schema part.
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import fields
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.config.schema import ASYNC_SECTIONS, MODE, SECTIONS, leaf_keys
from torchrl_grpo.tasks import TASK_BUILDERS
from torchrl_grpo.tasks.registry import SHARED_KEYS

KINDS = {  # schema kind -> what a reader is told
    "int": "integer", "int>0": "integer > 0", "int>=0": "integer >= 0", "num>0": "number > 0", "num>1": "number > 1",
    "num>=0": "number >= 0", "auto|num>=0": "auto or number >= 0",
    "prob": "number in (0, 1]", "auto|prob": "auto or number in (0, 1]", "share": "number in [0, 1)",
    "unit": "number in [0, 1]",
    "bool": "true / false", "auto|bool": "auto / true / false", "auto|int>0": "auto or integer > 0",
    "str": "string", "names": "string or list of strings", "any": "any",
}
TYPES = {str: "string", Path: "string", int: "integer", float: "number", bool: "true / false", dict: "mapping",
         list: "list"}  # a task setting's type -> what a reader is told

HEADER = """# Configuration reference

Every key the trainer reads, section by section, one row per key that holds a value (a mapping of fixed keys,
such as `train_model.lora`, has a row for each of them): what it may hold, its default in `config/grpo_gsm8k.yaml`
(the `ray` section and the async `train` keys: `config/mode/async.yaml`, which `grpo-async.py` adds) and what it
means. Other shipped configs (`--config-name grpo_arithmetic`, `grpo_python_tool`, `grpo_ifeval`, `grpo_openr1`,
`grpo_math`, `grpo_countdown`) and the groups under `config/` (`model=`, `env=`, `loss=`) change defaults, never
the keys. A bad value, a missing key or an unknown one is a one-line error naming it (exit code 2). Besides the
`env` keys below, each task reads its own, declared by its settings class and checked the same way: the built-in
tasks' are [at the end of this page](#the-keys-of-each-built-in-task), your own task's are yours
([tasks](tasks.md#add-your-own-task)).

This page is generated from `torchrl_grpo/config/schema.py` and the task settings classes:
`python -m torchrl_grpo.run.reference > docs/config-reference.md`.
"""

TASKS_HEADER = """
## The keys of each built-in task

The `env` keys a task reads besides the ones above, as its settings class declares them; `env.dataset` names the
task (its names are the heading). A key left out or null takes the default. `env.eval` may set any of them for the
evaluation split."""

TABLE = "| key | value | default | meaning |\n|---|---|---|---|"


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


def _cell(text: str) -> str:
    """Text in a table cell: a bar would end it, a ``<`` begin an HTML tag (``<think>``, ``<run dir>``)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _value(value) -> str:
    return "null" if value is None else _cell(f"`{_plain(value)}`")


def _kind(rule: dict) -> str:
    kind = " \\| ".join(map(_plain, rule["choices"])) if rule["kind"] == "choice" else KINDS[rule["kind"]]
    return f"{kind} or null" if rule["null"] else kind


def _at(defaults: dict, dotted: str):
    for part in dotted.split("."):
        defaults = defaults[part]
    return defaults


def _type(hint) -> str:
    """A task setting's type hint as the page says it: ``str | Path | None`` is "string or null"."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    names = dict.fromkeys(TYPES.get(typing.get_origin(a) or a, getattr(a, "__name__", str(a)))
                          for a in args if a is not type(None))
    return " or ".join([*names, *(["null"] if type(None) in args else [])])


def _row(key: str, kind: str, default: str, meaning: str) -> str:
    return f"| `{key}` | {kind} | {default} | {_cell(meaning)} |"


def _task_tables() -> list[str]:
    """One table per built-in builder, headed by the ``env.dataset`` names it is registered under."""
    names: dict = {}
    for name, builder in TASK_BUILDERS.items():
        names.setdefault(builder, []).append(name)
    parts = [TASKS_HEADER]
    for builder, registered in names.items():
        settings = builder.task_settings
        hints = typing.get_type_hints(settings)
        heading = ", ".join(f"`{name}`" for name in registered)
        parts.append(f"\n### {heading}\n\n`{settings.__name__}` in `{builder.__module__}`.\n\n{TABLE}")
        parts += [_row(f"env.{f.name}", _type(hints[f.name]), _value(f.default), f.metadata["doc"])
                  for f in fields(settings)]
    return parts


def reference_markdown() -> str:
    """The whole page."""
    sync, asynchronous = _defaults()
    parts = [HEADER, f"\n## `mode`\n\n{TABLE}", _row("mode", _kind(MODE), _value(sync["mode"]), MODE["doc"])]
    for sections, defaults, note in ((SECTIONS, sync, ""), (ASYNC_SECTIONS, asynchronous, " (async)")):
        for section, schema in sections:
            parts.append(f"\n## `{section}`{note}\n\n{TABLE}")
            parts += [_row(name, _kind(rule), _value(_at(defaults, name)), rule["doc"])
                      for name, rule in leaf_keys(section, schema)]
            if section == "env":
                parts += [_row(f"env.{name}", kind, _value(defaults["env"].get(name)), doc)
                          for name, (kind, doc) in SHARED_KEYS.items()]
    return "\n".join(parts + _task_tables()) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
