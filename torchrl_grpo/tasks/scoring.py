"""Calling a task's reward functions on a batch of completions, in both shapes users bring:

- ours, one completion at a time: ``fn(completion: str, row: dict) -> float``;
- TRL's, the whole batch at once: ``fn(completions, prompts=..., completion_ids=..., **columns) -> list``, the
  dataset's columns as keyword lists (a function that takes ``**kwargs`` ignores those it does not use).

Either may return ``None`` for "not applicable" (TRL's meaning): that component is NaN for the completion and
left out of its total. Either may be ``async def``: every call of a batch then runs concurrently in one event
loop (in a thread of its own where the caller's thread already runs one, as in a notebook kernel).
"""
from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")


def takes_batch(fn: Callable) -> bool:
    """Whether ``fn`` has TRL's signature (a ``completions`` parameter) rather than ``fn(completion, row)``."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: ours
        return False


def call_rewards(rewards, texts: Sequence[str], rows: Sequence[Mapping[str, Any]], prompts: Sequence[Any],
                 completion_ids: Sequence[Sequence[int]] | None, conversational: bool) -> dict[str, list]:
    """Each reward's raw results, by name: per completion a value, ``None``, or the exception its call raised.
    ``prompts``: each completion's prompt as TRL passes it (text, or messages when ``conversational``)."""
    n = len(texts)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key not in TRL_ARGUMENTS} if rows else {}
    ids = [list(c) for c in completion_ids] if completion_ids is not None else None
    batched = {reward.name: takes_batch(reward.fn) for reward in rewards}
    slots: dict[str, Any] = {}
    for reward in rewards:
        if batched[reward.name]:
            slots[reward.name] = _call(reward.fn, completions=completions, prompts=list(prompts), completion_ids=ids,
                                       **columns)
        else:
            slots[reward.name] = [_call(reward.fn, texts[i], rows[i]) for i in range(n)]
    _await_all(slots)
    return {name: _one_per_completion(slot, n) if batched[name] else slot for name, slot in slots.items()}


def _call(fn: Callable, *args, **kwargs) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # judged by the task's reward_errors, with the row it happened on
        return err


def _await_all(slots: dict[str, Any]) -> None:
    """Replace every awaitable in ``slots`` (values or list items) by its result (or exception), concurrently."""
    where = [(name, None) for name, v in slots.items() if inspect.isawaitable(v)]
    where += [(name, i) for name, v in slots.items() if isinstance(v, list) for i, x in enumerate(v)
              if inspect.isawaitable(x)]
    if not where:
        return

    async def gather():
        pending = [slots[name] if i is None else slots[name][i] for name, i in where]
        return await asyncio.gather(*pending, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        results = asyncio.run(gather())
    else:  # this thread runs a loop already (a notebook kernel): run ours beside it
        with ThreadPoolExecutor(1) as pool:
            results = pool.submit(asyncio.run, gather()).result()
    for (name, i), result in zip(where, results):
        if i is None:
            slots[name] = result
        else:
            slots[name][i] = result


def _one_per_completion(result: Any, n: int) -> list:
    """A batched reward's result checked to be one value per completion (an exception stands for all)."""
    if isinstance(result, Exception):
        return [result] * n
    if not isinstance(result, (list, tuple)) or len(result) != n:
        got = f"{len(result)} values" if isinstance(result, (list, tuple)) else type(result).__name__
        return [ValueError(f"returned {got} for {n} completions; return a list of one float (or None) per "
                           "completion")] * n
    return list(result)


def as_component(value: Any) -> float:
    """A reward's value as a float; ``None`` (not applicable) is NaN."""
    if value is None:
        return math.nan
    return float(value)


def nan_mean(values) -> float:
    """The mean of the values that are not NaN (a component's mean over the completions it applies to); NaN
    when none is."""
    kept = [float(v) for v in values if not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else math.nan
