"""Errors the entry points turn into a one-line message instead of a traceback."""
import functools
import sys


class ConfigError(Exception):
    """Bad user input: printed as one line naming the config key and the fix; the scripts exit with code 2."""


class RunError(Exception):
    """The run cannot go on (a rollout actor died, training diverged): printed as one line after a checkpoint;
    the scripts exit with code 1."""


def one_line(err: BaseException) -> str:
    """An exception as one short line (its type and the first line of its text), for messages that must
    stay one line."""
    text = str(err).strip().splitlines()
    return type(err).__name__ + (f": {text[0][:200]}" if text else "")


def import_target(spec, key: str, what: str, example: str):
    """The object a config entry names by import path (``{_target_: pkg.module.name, ...}``), or a one-line
    ConfigError naming ``key`` (``what`` it should name, an ``example`` path)."""
    from hydra.utils import get_object

    target = spec.get("_target_") if hasattr(spec, "get") else None
    if not isinstance(target, str):
        raise ConfigError(f"{key}: give the {what}'s import path as _target_ (e.g. {example})")
    try:
        return get_object(target)
    except Exception as err:  # ImportError, AttributeError, ValueError from hydra
        raise ConfigError(f"{key}._target_={target}: cannot import it ({type(err).__name__}); check the module is on "
                          "PYTHONPATH and the name") from None


def exit_with_one_line(main):
    """Print a ConfigError (exit code 2) or a RunError (exit code 1) as one line on stderr, no traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ConfigError, RunError) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(2 if isinstance(err, ConfigError) else 1)

    return wrapper
