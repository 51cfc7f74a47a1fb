"""Errors the entry points turn into a one-line message instead of a traceback."""


class ConfigError(Exception):
    """Bad user input: printed as one line naming the config key and the fix; the scripts exit with code 2."""
