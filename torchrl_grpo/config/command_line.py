"""Overrides Hydra cannot apply (a misspelt key, a config group option that does not exist, broken override
syntax) as one line and exit code 2, like every other bad input. Hydra itself prints such an error in six
lines and exits with 1, before any of our code runs; so an entry point composes its command line once
first (a sweep with the first value of each swept key), which costs a fraction of a second. The Python API's
keyword settings are checked against the composed config the same way (:func:`apply_settings`).
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torchrl_grpo.core.errors import ConfigError, exit_with_one_line


def check_overrides(config_dir: str, config_name: str, argv: list[str]) -> None:
    """A ConfigError naming the override when ``argv`` (a script's arguments) does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.info or args.cfg or args.shell_completion or args.experimental_rerun:
        return  # Hydra answers those itself
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except Exception as err:  # OverrideParseException: broken syntax
        raise ConfigError(f"{_lines(err)}; see `python grpo.py --help` for the override syntax") from None
    first_values = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                    else o.input_line for o in parsed]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=args.config_path or config_dir, version_base="1.3"):
            extra = [f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]"] if args.config_dir else []
            compose(config_name=args.config_name or config_name, overrides=first_values + extra)
    except Exception as err:  # a key or a group option that is not there
        message = _lines(err)
        if message.startswith("Could not override"):  # a new key is refused later anyway: most are typos
            message += "; check the key's spelling (config/grpo_gsm8k.yaml names every key)"
        raise ConfigError(message) from None
    finally:
        GlobalHydra.instance().clear()


def compose_config(config_dir: str, config_name: str, overrides: list[str]):
    """The config as the command line composes it (after :func:`check_overrides` said it does), outside Hydra's
    entry point (the Python API)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def group_choices(config_dir: str, settings: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The Python API's keyword ``settings`` split into the choices of config groups (a string at a group's name,
    ``model="tiny"``: overrides ``model=tiny``) and the values to set (:func:`apply_settings`)."""
    choices, values = [], {}
    for key, value in settings.items():
        if isinstance(value, str) and (Path(config_dir) / key).is_dir():
            choices.append(f"{key}={value}")
        else:
            values[key] = value
    return choices, values


def apply_settings(cfg, values: Mapping[str, Any]) -> None:
    """Set ``values`` (keyword settings: a section's keys as a dict, nested as the config nests them) in the
    composed ``cfg``; a key the config does not have is a ConfigError naming it, as on the command line, but for
    ``env``'s: a task's own keys (``+env.<key>`` on the command line) are added, and its settings class checks them
    before anything loads (:func:`torchrl_grpo.tasks.check_env`)."""
    from omegaconf import OmegaConf

    for key, value in _leaves(cfg, values, ""):
        OmegaConf.update(cfg, key, value, merge=False, force_add=key.startswith(TASK_SECTION))


_ABSENT = object()
TASK_SECTION = "env."  # a task's keys: its settings class checks them


def _leaves(cfg, values: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for each value to set: a dict is followed into the section of that name, where the
    config has a section there (elsewhere it is the value, e.g. a judge's settings where the default is null)."""
    from omegaconf import DictConfig, OmegaConf

    for name, value in values.items():
        key = f"{prefix}{name}"
        node = OmegaConf.select(cfg, key, default=_ABSENT)
        if node is _ABSENT and key.startswith(TASK_SECTION):
            yield key, value
            continue
        if node is _ABSENT:
            raise ConfigError(f"{key}: no such key in the config; check its spelling (config/grpo_gsm8k.yaml names "
                              "every key)")
        if isinstance(value, Mapping) and isinstance(node, DictConfig):
            yield from _leaves(cfg, value, f"{key}.")
        else:
            yield key, value


def _lines(err: Exception) -> str:
    """Hydra's message on one line: the items listed after a line ending in ':' joined by commas, the config
    search path and the stack-trace hint dropped."""
    parts: list[str] = []
    listing = False  # after a line ending in ':', each line is an item of that list
    for line in (line.strip() for line in str(err).splitlines()):
        if line.startswith("Config search path") or "HYDRA_FULL_ERROR" in line:
            break
        if line and listing:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
        elif line:
            parts.append(line)
            listing = line.endswith(":")
    return " ".join(parts)[:500]


def checked_command_line(config_dir: str, config_name: str):
    """Decorate a ``@hydra.main`` entry point: its command line is checked (:func:`check_overrides`) first."""

    def decorate(main):
        @functools.wraps(main)
        def wrapper():
            exit_with_one_line(check_overrides)(config_dir, config_name, sys.argv[1:])
            return main()

        return wrapper

    return decorate
