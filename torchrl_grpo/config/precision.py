"""What ``auto`` means for the precision keys, decided in one place.

bf16 is used where the hardware runs it natively: a GPU, or a CPU with AVX-512 BF16 or AMX. There it trains
about twice as fast as float32 and learned at least as well on ``grpo_arithmetic`` over three seeds (README,
"Speed"). On other CPUs torch emulates bf16, slower than float32, so ``auto`` stays float32 there. When the
trainer computes in bf16:

* ``inference_model.torch_dtype=auto`` samples in bf16 too: on the CPU, a float32 engine would be the slow
  half of a step, and it would not sample the policy the trainer scores;
* ``loss.old_log_probs=auto`` is ``trainer``: the ratio's denominator is the trainer's own bf16 log-probs
  (``Trainer.prepare``), so that a ratio is 1 where the policy has not moved. The engine's kernels differ from
  the trainer's by more than one update moves the policy: with the engine's log-probs as the denominator, bf16
  training collapsed (README, "Speed").
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig

from torchrl_grpo.core.errors import ConfigError

LOW_PRECISION = (torch.bfloat16, torch.float16)


def native_bf16(device: str) -> bool:
    """Whether bf16 matmuls run natively on ``device`` (elsewhere torch emulates them, slower than float32)."""
    return device.startswith("cuda") or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def train_device() -> str:
    """Where the trained model runs (:func:`torchrl_grpo.config.placement.place`): a GPU if there is one."""
    return "cuda" if torch.cuda.device_count() > 0 else "cpu"


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    """A ``torch_dtype`` key: ``auto`` is bfloat16 on GPUs and float32 on the CPU (the trained model's float32
    master weights; its compute follows ``train.mixed_precision``)."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch_dtype={name!r}: use auto, float32, bfloat16 or float16")
    return dtype


def autocast_bf16(cfg: DictConfig, device: str) -> bool:
    """``train.mixed_precision``: ``auto`` is bf16 autocast where bf16 is native on the train ``device``."""
    mode = cfg.train.mixed_precision
    return native_bf16(device) if mode == "auto" else bool(mode)


def trains_in_low_precision(cfg: DictConfig, device: str) -> bool:
    """The trainer computes in bf16 (autocast) or in bf16/fp16 weights."""
    return autocast_bf16(cfg, device) or resolve_dtype(cfg.train_model.torch_dtype, device) in LOW_PRECISION


def engine_dtype_on(cfg: DictConfig, device: str, train_on: str) -> torch.dtype:
    """``inference_model.torch_dtype`` for an engine on ``device``: ``auto`` is bfloat16 on a GPU; on the CPU,
    bfloat16 when the trainer (on ``train_on``) computes in low precision, else float32."""
    name = cfg.inference_model.torch_dtype
    if name in (None, "auto") and not device.startswith("cuda"):
        return torch.bfloat16 if trains_in_low_precision(cfg, train_on) else torch.float32
    return resolve_dtype(name, device)


def recompute_old_log_probs(cfg: DictConfig, device: str) -> bool:
    """``loss.old_log_probs``: ``auto`` is ``trainer`` when the trainer computes in low precision on ``device``."""
    chosen = cfg.loss.old_log_probs
    return trains_in_low_precision(cfg, device) if chosen == "auto" else chosen == "trainer"


def describe(cfg: DictConfig, train_on: str, engine_on: str) -> str:
    """The resolved choices, for the console: what the three keys mean on this machine."""
    weights = str(resolve_dtype(cfg.train_model.torch_dtype, train_on)).removeprefix("torch.")
    compute = f"bf16 autocast over {weights} weights" if autocast_bf16(cfg, train_on) else f"{weights}"
    engine = str(engine_dtype_on(cfg, engine_on, train_on)).removeprefix("torch.")
    old = "the trainer's" if recompute_old_log_probs(cfg, train_on) else "the engine's"
    return (f"trainer {compute} (train.mixed_precision={cfg.train.mixed_precision}), engine {engine} "
            f"(inference_model.torch_dtype={cfg.inference_model.torch_dtype}), old log-probs {old} "
            f"(loss.old_log_probs={cfg.loss.old_log_probs})")
