"""What ``auto`` means for the precision keys, decided in one place.

The trained model's master weights are float32 on every device (``train_model.torch_dtype=auto``): an AdamW step
moves each entry by about the learning rate, which is below half a bf16 ulp of most weights, so bf16 master
weights drop most updates (at lr 2e-5, 96% of SmolLM2's weight-matrix entries; the README's job then never learned
its answer format). Asked for anyway, :func:`lost_update_share` says how many a step loses, once.

bf16 compute (autocast over the float32 weights) is used where the hardware runs it natively: a GPU, or a CPU with
AVX-512 BF16 or AMX. There it trains about twice as fast as float32 and learned at least as well on
``grpo_arithmetic`` over three seeds (docs/benchmarks.md). On other CPUs torch emulates bf16, slower than float32,
so ``auto`` stays float32 there. When the trainer computes in bf16:

* ``inference_model.torch_dtype=auto`` samples in bf16 too: on the CPU, a float32 engine would be the slow
  half of a step, and it would not sample the policy the trainer scores;
* ``loss.old_log_probs=auto`` is ``trainer``: the ratio's denominator is the trainer's own bf16 log-probs
  (``Trainer.prepare``), so that a ratio is 1 where the policy has not moved. The engine's kernels differ from
  the trainer's by more than one update moves the policy: with the engine's log-probs as the denominator, bf16
  training collapsed (docs/benchmarks.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.objective.registry import MISMATCH_CORRECTIONS

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Precision:
    """The precision keys resolved once, for the devices the run's roles take (:func:`resolve_precision`)."""

    train_weights: torch.dtype    # train_model.torch_dtype: the trained model's weights (its master copy)
    autocast_bf16: bool           # train.mixed_precision: the trainer computes under bf16 autocast
    reference: torch.dtype        # ref_model.torch_dtype
    engine: torch.dtype           # inference_model.torch_dtype: the rollout engines' weights and compute
    trainer_old_log_probs: bool   # loss.old_log_probs: the ratio's denominator is the trainer's own log-probs

    def describe(self, cfg: DictConfig) -> str:
        """The resolved choices, for the console, each with the key it comes from."""
        weights = dtype_name(self.train_weights)
        compute = f"bf16 autocast over {weights} weights" if self.autocast_bf16 else weights
        old = "the trainer's" if self.trainer_old_log_probs else "the engine's"
        return (f"trainer {compute} (train.mixed_precision={cfg.train.mixed_precision}), "
                f"engine {dtype_name(self.engine)} "
                f"(inference_model.torch_dtype={cfg.inference_model.torch_dtype}), old log-probs {old} "
                f"(loss.old_log_probs={cfg.loss.old_log_probs})")


def resolve_precision(cfg: DictConfig, train_on: str, engine_on: str, ref_on: str) -> Precision:
    """``auto`` (module docstring) and the explicit values of the precision keys, for a trainer on ``train_on``,
    engines on ``engine_on`` and a reference on ``ref_on``; a one-line ConfigError for a dtype name torch lacks
    and for the loss options that need the trainer's old log-probs when they are the engine's."""
    train_weights = resolve_dtype(cfg.train_model.torch_dtype, train_on, master=True)
    mode = cfg.train.mixed_precision
    autocast = native_bf16(train_on) if mode == "auto" else bool(mode)
    low = autocast or train_weights in LOW_PRECISION  # the trainer computes in bf16 or fp16
    engine_name = cfg.inference_model.torch_dtype
    if engine_name in (None, "auto") and not engine_on.startswith("cuda"):
        # a float32 engine beside a low-precision trainer would be the slow half of a CPU step, and would not
        # sample the policy the trainer scores
        engine = torch.bfloat16 if low else torch.float32
    else:
        engine = resolve_dtype(engine_name, engine_on)
    old = cfg.loss.old_log_probs
    precision = Precision(train_weights, autocast, resolve_dtype(cfg.ref_model.torch_dtype, ref_on), engine,
                          low if old == "auto" else old == "trainer")
    _check_old_log_probs(cfg, precision)
    return precision


def native_bf16(device: str) -> bool:
    """Whether bf16 matmuls run natively on ``device`` (elsewhere torch emulates them, slower than float32)."""
    return device.startswith("cuda") or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_dtype(name: str | None, device: str, master: bool = False) -> torch.dtype:
    """A ``torch_dtype`` key: ``auto`` is float32 for the trained model's master weights (``master``; its compute
    follows ``train.mixed_precision``), and for the models that are not trained (reference, engines) bfloat16 on
    GPUs and float32 on the CPU."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") and not master else torch.float32
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch_dtype={name!r}: use auto, float32, bfloat16 or float16")
    return dtype


def _check_old_log_probs(cfg: DictConfig, precision: Precision) -> None:
    """Truncated sampling (top_p, top_k, min_p) and the mismatch corrections (TIS, MIS) need the trainer's old
    log-probs: refused, naming the keys, with the engine's."""
    if precision.trainer_old_log_probs:
        return
    old_log_probs = f"loss.old_log_probs={cfg.loss.old_log_probs}"
    if cfg.loss.old_log_probs == "auto":
        old_log_probs += " (the engine's, as training runs in float32 here)"
    inference = cfg.inference_model
    for name, value, off in (("top_p", inference.top_p, 1), ("top_k", inference.top_k, 0),
                             ("min_p", inference.min_p, 0)):
        if value != off:
            raise ConfigError(
                f"inference_model.{name}={value} with {old_log_probs}: the engine's log-probs are then of the "
                f"truncated distribution and the ratio is biased; set loss.old_log_probs=trainer (or {name}={off})"
            )
    for key in MISMATCH_CORRECTIONS:
        if cfg.loss.get(key) is not None:
            raise ConfigError(
                f"loss.{key}={cfg.loss[key]} with {old_log_probs}: its weight exp(old - sample) is 1 unless the old "
                f"log-probs are the trainer's; set loss.old_log_probs=trainer (or loss.{key}=null)"
            )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how configs and engines name a dtype."""
    return str(dtype).removeprefix("torch.")


def lost_update_share(parameters, lr: float, dtype: torch.dtype = torch.bfloat16) -> float:
    """The share of the weight-matrix entries (2-D and larger) of ``parameters`` held in ``dtype`` that a step of size
    ``lr`` (about what one AdamW step moves each entry by) leaves unchanged: those where ``lr`` is below half an ulp of
    the weight, so the sum rounds back to it. 0.0 with no such entries."""
    eps, lost, total = torch.finfo(dtype).eps, 0, 0
    for p in parameters:
        if p.dim() < 2:
            continue
        w = p.detach().to(dtype).float()
        # w = m * 2^e with 0.5 <= |m| < 1: its ulp is eps * 2^(e-1), and rounding to nearest keeps w below half that
        half_ulp = eps * torch.ldexp(torch.ones_like(w), torch.frexp(w).exponent - 2)
        lost += int((half_ulp > lr).logical_and(w != 0).sum())
        total += w.numel()
    return lost / total if total else 0.0
