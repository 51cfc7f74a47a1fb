"""Secrets kept out of what a run writes, as a last line of defence: the values of the environment variables whose
names say key, token, secret or password (``WANDB_API_KEY``, ``HF_TOKEN``, the judge's ``api_key_env``, ...) are
replaced by ``***`` in the console, ``grpo.log``, ``samples.jsonl``, the trackers' sample tables, the run's saved
config and its checkpoints' config, and in every tool's reply before the model reads it. A policy that learns to
print a secret, or a prompt that holds one, leaks nothing to the files users share. The sandbox
(:mod:`torchrl_grpo.episodes.sandbox`) is what keeps model-written code from reading them in the first place.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
MIN_LENGTH = 8  # a shorter value ("true", "0") would mask ordinary text
MASK = "***"


def secret_values(environ: Mapping[str, str] = os.environ, names: Iterable[str] = ()) -> list[str]:
    """The values to mask: those of the variables whose names say secret, and of ``names``, longest first."""
    named = set(names)
    found = {value for name, value in environ.items()
             if (SECRET_NAME.search(name) or name in named) and len(value) >= MIN_LENGTH}
    return sorted(found, key=len, reverse=True)


def secret_names(env: Mapping[str, Any]) -> list[str]:
    """The variables a run's ``env`` section names as secret although their names may not say so: the judge's key."""
    judge = env.get("judge") or {}
    return [judge["api_key_env"]] if judge.get("api_key_env") else []


class Masker:
    """Replaces each of ``secrets`` in text, in nested containers and in files."""

    def __init__(self, secrets: list[str]):
        self.secrets = secrets

    def text(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def tree(self, value: Any) -> Any:
        """``value`` with every string in it masked (dicts, lists and tuples walked)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {k: self.tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.tree(v) for v in value)
        return value

    def file(self, path: Path) -> None:
        """Rewrite a text file masked (one a library wrote before the masks were on, e.g. Hydra's config.yaml)."""
        text = path.read_text()
        if (masked := self.text(text)) != text:
            path.write_text(masked)


class MaskingStream:
    """A text stream whose writes are masked (the console)."""

    def __init__(self, stream, masker: Masker):
        self.stream, self.masker = stream, masker

    def write(self, text: str) -> int:
        return self.stream.write(self.masker.text(text))

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class MaskingFilter(logging.Filter):
    """A log record's message and traceback masked, for every handler it then reaches."""

    def __init__(self, masker: Masker):
        super().__init__()
        self.masker = masker

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self.masker.text(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self.masker.text(logging.Formatter().formatException(record.exc_info))
        return True


_MASKER = Masker([])


def masker() -> Masker:
    """The process's masker (:func:`mask_output`): no secrets until it is called."""
    return _MASKER


def mask_output(names: Iterable[str] = ()) -> Masker:
    """From here on this process's console and log handlers are masked (again for handlers added since: idempotent);
    ``names``: more variables whose values are secret (e.g. the judge's ``api_key_env``)."""
    _MASKER.secrets = secret_values(names=names)
    for name in ("stdout", "stderr"):
        if not isinstance(getattr(sys, name), MaskingStream):
            setattr(sys, name, MaskingStream(getattr(sys, name), _MASKER))
    handlers = [h for logger in (logging.getLogger(), *map(logging.getLogger, logging.root.manager.loggerDict))
                if isinstance(logger, logging.Logger) for h in logger.handlers]
    for handler in handlers:
        if not any(isinstance(f, MaskingFilter) for f in handler.filters):
            handler.addFilter(MaskingFilter(_MASKER))
    return _MASKER
