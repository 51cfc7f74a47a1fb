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
    import importlib

    target = spec.get("_target_") if hasattr(spec, "get") else None
    if not isinstance(target, str):
        raise ConfigError(f"{key}: give the {what}'s import path as _target_ (e.g. {example})")
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception as err:  # the module itself fails
            raise ConfigError(f"{key}._target_={target}: importing {'.'.join(parts[:cut])} "
                              f"raised {one_line(err)}") from None
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
        except AttributeError:
            break
        return found
    raise ConfigError(f"{key}._target_={target}: cannot import it; check the module is on PYTHONPATH and the name")


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
