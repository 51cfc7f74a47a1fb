"""Symbolic answer checking with Hugging Face's ``math-verify`` (the ``math`` extra), as Open-R1, TRL's
``accuracy_reward`` and TorchRL check math: LaTeX, fractions, sets, intervals, units, symbolic equivalence.

math-verify bounds its parsing and its sympy work with ``signal.alarm``, which only works on a process's main
thread; elsewhere (the sync loop's prefetch thread, a thread pool) it raises. Off the main thread the check runs
in a helper process of its own (started on first use, where math-verify is on that process's main thread), and a
check that outlives ``timeout_s`` there kills the helper: that answer falls back to the caller's check.
"""
from __future__ import annotations

import atexit
import functools
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from torchrl_grpo.core.errors import ConfigError

TIMEOUT_S = 5  # math-verify's own bound on parsing and on verifying, each
_helper: ProcessPoolExecutor | None = None
_helper_lock = threading.Lock()


def require_math_verify(key: str) -> None:
    """A ConfigError naming ``key`` and the extra where math-verify is not installed."""
    import importlib.util

    if importlib.util.find_spec("math_verify") is None:
        raise ConfigError(f"{key}: answers are checked with math-verify, which is not installed; "
                          "pip install -e \".[math]\"")


def check_here(predicted: str, gold: str, timeout_s: int = TIMEOUT_S) -> bool | None:
    """math-verify's verdict on the thread it is called from (the main one): None where it parses either side
    to nothing (or runs out of time)."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s)
    predicted_parsed = parse(f"${predicted}$", parsing_timeout=timeout_s)
    if not gold_parsed or not predicted_parsed:
        return None
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout_s))


@functools.lru_cache(maxsize=8192)
def math_verify_equal(predicted: str, gold: str) -> bool | None:
    """Whether ``predicted`` and ``gold`` (the contents of two ``\\boxed{}``) are the same answer by math-verify;
    None where it cannot tell (it parses either to nothing, or runs out of time). Cached: a component and the
    accuracy ask about the same pair."""
    return on_a_main_thread(check_here, predicted, gold)


def on_a_main_thread(check: Callable, *args, timeout_s: float = 2 * TIMEOUT_S + 5):
    """``check(*args)`` here on the main thread, else in the helper process (where math-verify's signals work)."""
    if threading.current_thread() is threading.main_thread():
        return check(*args)
    return check_in_helper(check, *args, timeout_s=timeout_s)


def check_in_helper(check: Callable, *args, timeout_s: float):
    """``check(*args)`` in the helper process; None (and the helper killed) past ``timeout_s``."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        helper = _helper
    future = helper.submit(check, *args)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        _stop_helper(helper)
        return None


def _stop_helper(helper: ProcessPoolExecutor) -> None:
    global _helper
    with _helper_lock:
        if _helper is helper:
            _helper = None
    for process in list(getattr(helper, "_processes", {}).values()):  # a check stuck in sympy never returns
        process.kill()
    helper.shutdown(wait=False, cancel_futures=True)


@atexit.register
def _stop_at_exit() -> None:
    if _helper is not None:
        _stop_helper(_helper)
