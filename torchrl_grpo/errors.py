"""Errors the entry points turn into a one-line message instead of a traceback."""


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
