"""Which builder makes the task, and the ``env`` keys it reads, checked.

A builder is a function ``build(settings) -> Task``; :func:`register_task` declares its settings class (a frozen
dataclass, one field per ``env`` key it reads, each with its default and, made with :func:`setting`, its meaning).
``env.dataset`` names a builder: one a module of this package registers, or one a pip-installed package declares as
an entry point of the group ``torchrl_grpo.tasks`` (``mytask = "mypkg.tasks:build_my_task"``), loaded only when that
name is asked for. Your own builder needs no package: ``env._target_`` names it by import path, as ``env.rewards``
entries name functions.
"""
from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import field, fields, is_dataclass
from typing import Any

from torchrl_grpo.core.errors import ConfigError, import_target, one_line

ENTRY_POINTS = "torchrl_grpo.tasks"
# env.dataset -> builder, filled by @register_task where each task is defined (and by the entry points asked for)
TASK_BUILDERS: dict[str, Callable[[Any], Any]] = {}
# the keys build_task reads for every task that the env schema (torchrl_grpo/config/schema.py) leaves out, as
# (what it may hold, its meaning): an env group may leave them out
SHARED_KEYS = {
    "rewards": ("list", "reward functions besides the task's own: [{_target_: a function's import path, weight "
                "(1), name (the function's), its keyword arguments}] (docs/tasks.md)"),
    "reward_weights": ("mapping or null", "the weight of each of the task's rewards by name, e.g. {accuracy: 1.0, "
                       "answer_format: 0.5}; null = the task's own"),
    "eval": ("mapping", "the env keys of the evaluation split (evaluate.py, logging.eval_frequency): any key of the "
             "task's, merged over env's, e.g. env.eval.split=test"),
}
# the keys build_task reads for every task (besides the one that names the builder)
TASK_KEYS = frozenset({"reward_errors", "reward_model", "judge", "chat_template_kwargs", "examples", *SHARED_KEYS})
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
          list: "a list"}


def register_task(*names: str, settings: type) -> Callable:
    """Decorator: ``fn(settings) -> Task`` builds the task of ``env.dataset=<each name>`` (none: it is named by
    ``env._target_`` or an entry point) from ``settings``, a frozen dataclass of the ``env`` keys it reads."""
    if not is_dataclass(settings):
        raise TypeError(f"task settings {settings!r}: give a frozen dataclass, one field per env key")

    def register(fn: Callable) -> Callable:
        fn.task_settings = settings
        TASK_BUILDERS.update(dict.fromkeys(names, fn))
        return fn

    return register


def setting(default: Any, doc: str) -> Any:
    """A field of a task's settings class: its default and its meaning, which docs/config-reference.md shows."""
    return field(default=default, metadata={"doc": doc})


def chosen_builder(env: Mapping[str, Any], default: str) -> tuple[str, Callable]:
    """(how the config names it, the builder): ``env._target_``'s import path, or ``env.dataset``'s name (``default``
    where there is neither)."""
    if env.get("_target_") is not None or ("_target_" in env and env.get("dataset") is None):  # env=custom's
        fn = import_target(env, "env", "task builder", "mypkg.tasks.build_my_task")
        label = f"env._target_={env['_target_']}"
    else:
        dataset = default if env.get("dataset") is None else env["dataset"]
        fn = TASK_BUILDERS.get(dataset) if isinstance(dataset, str) else None
        fn = fn or _entry_point(dataset)
        label = f"env.dataset={dataset}"
    if not is_dataclass(getattr(fn, "task_settings", None)):
        raise ConfigError(f"{label}: {getattr(fn, '__qualname__', fn)!r} is no task builder; decorate it with "
                          "@torchrl_grpo.tasks.register_task(settings=<its settings class>) (docs/tasks.md)")
    return label, fn


def _entry_point(dataset: Any) -> Callable:
    """The builder an installed package declares for ``dataset`` (group ``torchrl_grpo.tasks``), registered."""
    from importlib.metadata import entry_points

    found = entry_points(group=ENTRY_POINTS)
    points = list(found.select(name=dataset)) if isinstance(dataset, str) else []
    if not points:
        names = ", ".join(sorted({*TASK_BUILDERS, *found.names}))
        raise ConfigError(f"env.dataset={dataset!r}: choose one of {names}, or name your own builder with "
                          "env._target_=mypkg.tasks.build_my_task (docs/tasks.md)")
    try:
        fn = points[0].load()
    except Exception as err:
        raise ConfigError(f"env.dataset={dataset}: loading its entry point {points[0].value} raised "
                          f"{one_line(err)}") from None
    TASK_BUILDERS[dataset] = fn
    return fn


def task_settings(env: Mapping[str, Any], label: str, settings: type, shared: Collection[str] | None = None,
                  prefix: str = "env") -> Any:
    """``settings`` from the ``env`` keys it declares, each checked against its type (null: the default). With
    ``shared`` (the keys other parts of the run read), a key that is neither the task's nor shared is refused too:
    ``label`` says which task was chosen, ``prefix`` where the keys are."""
    hints = typing.get_type_hints(settings)
    declared = {f.name for f in fields(settings)}
    if shared is not None:
        known = declared | TASK_KEYS | set(shared) | {label.split("=")[0].removeprefix("env.")}  # its selector
        for key in env:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(declared | TASK_KEYS | set(shared)), n=1)
                guess = f" (did you mean {prefix}.{close[0]}?)" if close else ""
                fix = " (your own task: start from env=custom)" if label.startswith("env._target_") else ""
                raise ConfigError(f"{prefix}.{key}: {label} reads no such key{guess}; its own: "
                                  f"{', '.join(sorted(declared)) or 'none'}; drop it{fix} or fix its name "
                                  "(docs/tasks.md)")
    values = {}
    for key in declared & set(env):
        value = env[key]
        if value is None:
            continue
        if not _accepts(value, hints[key]):
            raise ConfigError(f"{prefix}.{key}={value!r}: must be {_kind(hints[key])} (null: the default)")
        values[key] = value
    return settings(**values)


def _accepts(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, arg) for arg in typing.get_args(hint))
    if origin is bool:
        return isinstance(value, bool)
    if origin in (int, float):
        return isinstance(value, (int, float) if origin is float else int) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, Mapping)
    if origin is list:
        return isinstance(value, Sequence) and not isinstance(value, str)
    return origin is Any or isinstance(value, origin)


def _kind(hint: Any) -> str:
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    return " or ".join(_KINDS.get(typing.get_origin(arg) or arg, getattr(arg, "__name__", str(arg))) for arg in args)
