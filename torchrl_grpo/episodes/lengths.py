"""Prompts that cannot fit the engine's context, found before any engine starts.

A row fits when its chat-templated prompt (with the system prompt) plus the completion budget
(``inference_model.max_tokens`` times the episode's turns) is at most ``inference_model.max_model_len``. Rows
that do not fit are dropped (``env.overlong_prompts=drop``, one warning line, as verl's overlong-prompt filter
does) or refused (``error``); when no row fits the keys contradict each other: one line naming them. Without this
check vLLM refuses such a prompt with a long traceback after it has started, or cuts the completion short.
"""
from __future__ import annotations

from dataclasses import dataclass

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.episodes.trajectories import prompt_token_ids
from torchrl_grpo.tasks import Task

_BATCH = 512  # rows templated and tokenized at a time


@dataclass(frozen=True)
class Overlong:
    """What :func:`fit_prompts` dropped: ``count`` of ``total`` rows, the longest prompt of them in tokens."""

    count: int
    total: int
    longest: int
    message: str  # the warning's text, naming the keys


def fit_prompts(task: Task, tokenizer, max_tokens: int, max_model_len: int, overlong: str = "drop",
                where: str = "env", max_turns: int = 1) -> Overlong | None:
    """Drop from ``task.rows`` (in place) the rows whose prompt + ``max_tokens`` x ``max_turns`` exceeds
    ``max_model_len``; what was dropped, or None when every row fits. A ConfigError (one line naming the keys)
    when no row fits, or when ``overlong`` is ``error`` and some do not. ``where``: the rows' key prefix in
    messages (``env``, ``env.eval``)."""
    budget = max_tokens * max_turns
    lengths = [len(ids) for start in range(0, len(task.rows), _BATCH)
               for ids in prompt_token_ids(task, tokenizer, task.rows.select(range(start, min(start + _BATCH,
                                                                                               len(task.rows)))))]
    keep = [i for i, n in enumerate(lengths) if n + budget <= max_model_len]
    if len(keep) == len(lengths):
        return None
    turns = f" x env.max_steps={max_turns} turns" if max_turns > 1 else ""
    completion = f"inference_model.max_tokens={max_tokens}{turns}"
    if not keep:
        shortest = min(lengths)
        raise ConfigError(
            f"no {where} row fits inference_model.max_model_len={max_model_len}: the shortest prompt has {shortest} "
            f"tokens and a completion may take {completion} more; set inference_model.max_model_len to at least "
            f"{shortest + budget} or lower inference_model.max_tokens")
    dropped = [n for n in lengths if n + budget > max_model_len]
    longest = max(dropped)
    what = (f"{len(dropped)} of {len(lengths)} {where} rows do not fit inference_model.max_model_len={max_model_len} "
            f"(prompt + {completion}; the longest prompt has {longest} tokens)")
    if overlong == "error":
        raise ConfigError(f"{what}: set inference_model.max_model_len to at least {longest + budget}, or "
                          f"env.overlong_prompts=drop to leave them out")
    task.rows = task.rows.select(keep)
    return Overlong(len(dropped), len(lengths), longest,
                    f"warning: {what}: left out (env.overlong_prompts=error refuses them instead)")
