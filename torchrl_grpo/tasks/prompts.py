"""Your own prompts (``env=prompts``): a local .jsonl / .json / .parquet / .csv file or folder, or a hub dataset
id, whose prompt column is text or chat messages (TRL's "standard" and "conversational" prompt-only formats).
The task has no reward of its own: ``env.rewards`` (or ``train(reward_funcs=...)``) gives them, and every other
column of a row reaches them (``row`` for ``fn(completion, row)``, keyword lists for TRL's signature).

Evaluation uses the hub dataset's other split (``env.eval.split``), or prompts held out of training:
``env.holdout`` is their share, picked by a hash of the prompt text, so the same prompts on every machine and
run; ``env.part`` says which part a split is (``env.eval`` sets ``part: holdout``).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks.base import Task
from torchrl_grpo.tasks.registry import register_task, setting
from torchrl_grpo.tasks.sources import load_rows

FOLDER_PATTERNS = (("json", "*.jsonl"), ("parquet", "*.parquet"), ("csv", "*.csv"))
PARTS = ("train", "holdout", "all")


@dataclass
class PromptsTask(Task):
    """A task whose prompt is one column of the row, as text or as chat messages."""

    prompt_column: str = "prompt"

    def prompt_messages(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        prompt = row[self.prompt_column]
        if isinstance(prompt, str):
            return super().prompt_messages({"question": prompt})
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": m["role"], "content": m["content"]} for m in prompt]

    def prompt_text(self, row: Mapping[str, Any]) -> str:
        prompt = row[self.prompt_column]
        if isinstance(prompt, str):
            return prompt
        return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])


@dataclass(frozen=True)
class PromptsSettings:
    """The ``env`` keys of your own prompts."""

    data_path: str | Path | None = setting(None, "a .jsonl/.parquet/.csv file or folder, or a hub dataset id")
    prompt_column: str = setting("prompt", "the column of the prompts: text, or chat messages [{role, content}, ...]")
    split: str = setting("train", "a hub dataset's split")
    holdout: float = setting(0.0, "share of prompts held out of training (by a hash of each)")
    part: str = setting("train", "the prompts used: train | holdout | all")
    system_prompt: str | None = setting(None, "the system prompt; null = none (text prompts only)")


@register_task("prompts", settings=PromptsSettings)
def build_prompts_task(s: PromptsSettings) -> Task:
    """Your prompts: the task has no reward of its own (``env.rewards`` gives them)."""
    source, column, holdout, part = s.data_path, s.prompt_column, s.holdout, s.part
    if not source:
        raise ConfigError("env.data_path: env=prompts needs your prompts: a .jsonl/.parquet/.csv file or folder, "
                          "or a hub dataset id")
    rows, where = _load(str(source), s.split)
    if column not in rows.column_names:
        raise ConfigError(f"env.prompt_column={column}: {where} has no such column; its columns are "
                          f"{', '.join(rows.column_names)}")
    conversational = _check_prompts(rows[column], column, where)
    if not 0 <= holdout < 1:
        raise ConfigError(f"env.holdout={holdout!r}: the share of prompts held out for evaluation, in [0, 1)")
    if part not in PARTS:
        raise ConfigError(f"env.part={part!r}: choose one of {', '.join(PARTS)}")
    task = PromptsTask(name=Path(str(source)).stem if Path(str(source)).exists() else str(source), rows=rows,
                       system_prompt=s.system_prompt or None, conversational=conversational, prompt_column=column)
    if part != "all":
        keep = [i for i, row in enumerate(rows) if (_held_out(task.prompt_text(row), holdout)) == (part == "holdout")]
        if not keep:
            raise ConfigError(f"env.holdout={holdout}: no prompt of {where} is in the {part} part; hold out a "
                              "larger share (e.g. env.holdout=0.1), or evaluate on another split (env.eval.split)")
        task.rows = rows.select(keep)
    return task


def _load(source: str, split: str):
    path = Path(source).expanduser()
    if path.exists() or path.suffix or source.count("/") != 1:  # a path; else a hub id (owner/name)
        return load_rows(source, path, split, folder_patterns=FOLDER_PATTERNS, expected="a .jsonl, .parquet or "
                         ".csv file of prompts, or a folder of them", hub_splits=(split,), offline_hint="")
    return load_rows(source, None, split, folder_patterns=FOLDER_PATTERNS, expected="", hub_splits=(split,),
                     offline_hint="download it where the hub is reachable and point env.data_path at the file")


def _check_prompts(prompts: list, column: str, where: str) -> bool:
    """Whether the prompts are chat messages; a ConfigError naming the first row that is neither text nor
    messages with role and content, or that differs in kind from the first row."""
    def is_messages(p):
        return (isinstance(p, list) and p and
                all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in p))

    conversational = is_messages(prompts[0]) if prompts else False
    for i, prompt in enumerate(prompts):
        if not (is_messages(prompt) if conversational else isinstance(prompt, str) and prompt.strip()):
            kind = "chat messages ([{role, content}, ...])" if conversational else "non-empty text"
            raise ConfigError(f"env.prompt_column={column}: row {i} of {where} is {str(prompt)[:60]!r}, not "
                              f"{kind} as the first row; fix the row or pick another column")
    return conversational


def _held_out(text: str, share: float) -> bool:
    """Whether a prompt is in the held-out part: a hash of its text, the same on every machine and run (SHA-256:
    a CRC of prompts that differ in a digit or two is far from uniform)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2 ** 64 < share
