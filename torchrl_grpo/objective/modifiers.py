"""Surrogate modifiers (``loss.<name>``, on when not null): detached weights and masks on the per-token
surrogate, for the engine/trainer mismatch (truncated or masked importance sampling) and for completions the
policy has already moved away from (the off-policy mask). They apply in registration order, which fixes the
order of their float operations."""
from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from torchrl_grpo.objective.aggregation import aggregate, completion_mean, per_token, wide
from torchrl_grpo.objective.registry import REGISTRIES, register
from torchrl_grpo.objective.surrogates import COMPLETION_LEVELS, SurrogateInputs

# Each takes the per-token surrogate [N, L], its parameter and the SurrogateInputs, and returns the
# modified surrogate and its diagnostics.
Modified = tuple[Float[Tensor, "N L"], dict[str, Tensor]]
# a mismatch correction's weight and where it bit: per token, or per completion at the sequence level
Weights = tuple[Float[Tensor, "N L"], Bool[Tensor, "N L"]] | tuple[Float[Tensor, " N"], Bool[Tensor, " N"]]

@torch.no_grad()
def tis_weights(old_log_probs: Float[Tensor, "N L"], sample_log_probs: Float[Tensor, "N L"], cap: float,
                mask: Bool[Tensor, "N L"], level: str = "token") -> Weights:
    """Truncated importance sampling (TIS) for the engine/trainer mismatch, a detached weight on the surrogate.

    * token level: ``rho_it = min(exp(logp_old_it - logp_sample_it), C)`` [N, L];
    * sequence level (with GSPO and GMPO): ``rho_i = min(exp((1/|y_i|) sum_t (logp_old_it - logp_sample_it)), C)``
      [N], the same length normalisation as their ratios.

    ``logp_old`` must be the trainer's recomputed log-probs (``loss.old_log_probs=trainer``): with the
    engine's the weight is 1. Returns ``(weight, capped)``; ``capped`` marks where the cap bit. Outside
    ``mask`` the weight is 1 and nothing is capped (unless ``C < 1``).
    """
    raw = mismatch_ratio(old_log_probs, sample_log_probs, mask, level)
    return raw.clamp(max=cap), raw > cap


@torch.no_grad()
def mis_weights(old_log_probs: Float[Tensor, "N L"], sample_log_probs: Float[Tensor, "N L"], cap: float,
                mask: Bool[Tensor, "N L"], level: str = "token") -> Weights:
    """Masked importance sampling (MIS; IcePop's band): the same ratio ``rho`` as :func:`tis_weights`, kept
    where ``1/C <= rho <= C`` and 0 outside: a token (or at the sequence level a completion) on which engine
    and trainer disagree that much leaves the loss instead of being capped. Returns ``(weight, masked)``;
    outside ``mask`` the weight is 1."""
    raw = mismatch_ratio(old_log_probs, sample_log_probs, mask, level)
    masked = (raw < 1.0 / cap) | (raw > cap)
    return torch.where(masked, torch.zeros_like(raw), raw), masked


def mismatch_ratio(old_log_probs: Float[Tensor, "N L"], sample_log_probs: Float[Tensor, "N L"],
                   mask: Bool[Tensor, "N L"], level: str) -> Float[Tensor, " N"] | Float[Tensor, "N L"]:
    """``exp(logp_old_it - logp_sample_it)`` [N, L] (1 outside ``mask``), or at the sequence level
    ``exp((1/|y_i|) sum_t (logp_old_it - logp_sample_it))`` [N]."""
    diff = wide(old_log_probs) - wide(sample_log_probs)
    if level == "sequence":
        return torch.exp(completion_mean(diff, mask))
    if level == "token":
        return torch.exp(torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device)))
    raise ValueError(f"mismatch correction level {level!r} not in ('token', 'sequence')")


def correction_level(importance_level: str) -> str:
    """The level of the mismatch corrections: per completion with the :data:`COMPLETION_LEVELS`, else per token."""
    return "sequence" if importance_level in COMPLETION_LEVELS else "token"


@torch.no_grad()
def off_policy_keep(logp: Float[Tensor, "N L"], sample_log_probs: Float[Tensor, "N L"],
                    advantages: Float[Tensor, " N"], mask: Bool[Tensor, "N L"], threshold: float
                    ) -> tuple[Bool[Tensor, " N"], Float[Tensor, " N"]]:
    """Off-policy sequence masking (DeepSeek-V3.2; TRL's ``off_policy_mask_threshold``).

    ``D_i = (1/|y_i|) sum_t (logp_sample_it - logp_it)`` (detached): a single-sample estimate of
    KL(pi_sample || pi_theta) along the sampled completion, ``logp_sample`` being the policy that generated
    it (the engine; TRL's ``sampling_per_token_logps``). A completion is dropped (``M_i = 0`` on all its
    tokens) iff ``A_i < 0`` and ``D_i > delta``: a bad answer the current policy already moved away from.
    The mask multiplies the surrogate only; the aggregation's denominators are unchanged.
    Returns ``(keep [N] bool, D [N])``; an empty completion has ``D = 0`` and is kept.
    """
    divergence = completion_mean(wide(sample_log_probs) - wide(logp), mask)
    keep = (advantages.to(divergence.device) >= 0) | (divergence <= threshold)
    return keep, divergence


def _token_share(flags: Bool[Tensor, "N #L"], mask: Bool[Tensor, "N L"]) -> Float[Tensor, ""]:  # noqa: F821 (#L)
    """The share of the loss tokens where ``flags`` is set (per token, or [N, 1]: per completion)."""
    return (flags & mask).sum() / mask.sum().clamp(min=1)


@register("surrogate_modifier", "tis_cap", hint="must be a number > 0 (e.g. 2), or null to turn TIS off",
          mismatch=True)
def truncated_importance_sampling(surrogate: Float[Tensor, "N L"], cap: float, s: SurrogateInputs) -> Modified:
    """``l <- min(exp(logp_old - logp_sample), C) l`` at :func:`correction_level`, detached (:func:`tis_weights`).
    Diagnostics: ``tis_truncated_fraction`` (tokens whose weight hit the cap), ``tis_weight_mean``."""
    weight, capped = tis_weights(s.logp_old, s.logp_sample, cap, s.mask, correction_level(s.importance_level))
    weight, capped = per_token(weight, s.mask), per_token(capped, s.mask)
    return surrogate * weight, {
        "tis_truncated_fraction": _token_share(capped, s.mask),
        "tis_weight_mean": aggregate(weight, s.mask, "token_mean"),
    }


@register("surrogate_modifier", "mis_cap", above=1.0, mismatch=True,
          hint="must be a number > 1 (e.g. 2: tokens whose exp(old - sample) leaves [0.5, 2] leave the loss), "
               "or null to turn masked importance sampling off")
def masked_importance_sampling(surrogate: Float[Tensor, "N L"], cap: float, s: SurrogateInputs) -> Modified:
    """``l <- rho l`` where ``1/C <= rho <= C``, ``l <- 0`` outside, ``rho = exp(logp_old - logp_sample)`` at
    :func:`correction_level`, detached (:func:`mis_weights`). Diagnostics: ``mis_masked_fraction`` (tokens
    that left the loss), ``mis_weight_mean``."""
    weight, masked = mis_weights(s.logp_old, s.logp_sample, cap, s.mask, correction_level(s.importance_level))
    weight, masked = per_token(weight, s.mask), per_token(masked, s.mask)
    return surrogate * weight, {
        "mis_masked_fraction": _token_share(masked, s.mask),
        "mis_weight_mean": aggregate(weight, s.mask, "token_mean"),
    }


@register("surrogate_modifier", "off_policy_mask_threshold",
          hint="must be a number > 0 (e.g. 0.5), or null to turn the off-policy mask off")
def off_policy_mask(surrogate: Float[Tensor, "N L"], threshold: float, s: SurrogateInputs) -> Modified:
    """``l_it <- M_i l_it``, ``M_i = 0`` iff ``A_i < 0`` and ``mean_t(logp_sample_it - logp_it) > delta``
    (:func:`off_policy_keep`). Diagnostic: ``off_policy_masked_fraction`` (tokens dropped)."""
    keep, _ = off_policy_keep(s.logp, s.logp_sample, s.advantages, s.mask, threshold)
    return surrogate * keep.unsqueeze(-1).to(surrogate.dtype), {
        "off_policy_masked_fraction": _token_share(~keep.unsqueeze(-1), s.mask),
    }


SURROGATE_MODIFIERS = tuple(REGISTRIES["surrogate_modifier"])
