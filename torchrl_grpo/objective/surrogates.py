"""Importance levels (``loss.importance_level``): the policy-gradient surrogate of each variant, from the
ratio of the trained policy to ``logp_old`` (per token, per completion, or a weight) and its clip or gate.
The default, GRPO's clipped token ratio, is :func:`token_ratio` (:func:`clipped_surrogate`), which
:meth:`~torchrl_grpo.objective.loss.GRPOLoss.forward` calls."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from torchrl_grpo.objective.aggregation import completion_mean, wide
from torchrl_grpo.objective.registry import REGISTRIES, register

# what an importance-level term returns, (loss, ratio, clipped_low, clipped_high): per token, or per completion
TokenTerm = tuple[Float[Tensor, "N L"], Float[Tensor, "N L"], Bool[Tensor, "N L"], Bool[Tensor, "N L"]]
CompletionTerm = tuple[Float[Tensor, " N"], Float[Tensor, " N"], Bool[Tensor, " N"], Bool[Tensor, " N"]]
GeometricTerm = tuple[Float[Tensor, " N"], Float[Tensor, " N"], Bool[Tensor, "N L"], Bool[Tensor, "N L"]]  # GMPO's


@dataclass(frozen=True)
class SurrogateInputs:
    """What the importance-level terms and the surrogate modifiers read: log-probs with zeros outside the
    completions (float32 from :class:`~torchrl_grpo.objective.loss.GRPOLoss`), ``advantages`` per completion (or
    per token for the :data:`TOKEN_ADVANTAGE_LEVELS`), the loss ``mask``."""
    logp: Float[Tensor, "N L"]
    logp_old: Float[Tensor, "N L"]
    logp_sample: Float[Tensor, "N L"]
    advantages: Float[Tensor, " N"] | Float[Tensor, "N L"]
    mask: Bool[Tensor, "N L"]
    importance_level: str
    eps_low: float
    eps_high: float
    tau_pos: float = 1.0  # SAPO's gate temperatures, for A > 0 and A <= 0
    tau_neg: float = 1.05


def token_advantages(advantages: Float[Tensor, " N"] | Float[Tensor, "N L"]
                     ) -> Float[Tensor, "N 1"] | Float[Tensor, "N L"]:
    """Advantages per completion [N] as [N, 1] (broadcast over its tokens); per token [N, L] (``loss.advantage=gae``)
    as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def _clip_objective(ratio, adv, eps_low: float, eps_high: float):
    """``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` and where the clipped branch is taken (no gradient)."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)
    return loss, clipped_low, clipped_high


def clipped_surrogate(logp: Float[Tensor, "N L"], logp_old: Float[Tensor, "N L"],
                      advantages: Float[Tensor, " N"] | Float[Tensor, "N L"], eps_low: float, eps_high: float
                      ) -> TokenTerm:
    """Token level: per token ``-min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)`` with
    ``w_it = exp(logp_it - logp_old_it)``.

    ``advantages`` is per completion [N] (broadcast over tokens) or per token [N, L]. Returns ``(loss, ratio,
    clipped_low, clipped_high)``, all [N, L]: a token counts as clipped where the clipped branch is the one taken and
    carries no gradient (ratio below ``1-eps_low`` with ``A < 0``, above ``1+eps_high`` with ``A > 0``).
    """
    ratio = torch.exp(wide(logp) - wide(logp_old))
    adv = token_advantages(advantages).to(ratio.dtype)
    loss, clipped_low, clipped_high = _clip_objective(ratio, adv, eps_low, eps_high)
    return loss, ratio, clipped_low, clipped_high


def sequence_clipped_surrogate(logp: Float[Tensor, "N L"], logp_old: Float[Tensor, "N L"],
                               advantages: Float[Tensor, " N"], mask: Bool[Tensor, "N L"], eps_low: float,
                               eps_high: float) -> CompletionTerm:
    """Sequence level (GSPO): one length-normalised ratio per completion,

    ``s_i = exp((1/|y_i|) sum_t (logp_it - logp_old_it))``  (= ``(pi(y_i)/pi_old(y_i))^(1/|y_i|)``),
    ``loss_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``.

    The gradient flows through the mean (every token of ``y_i`` gets ``d loss_i / d s_i * s_i / |y_i|``);
    a clipped completion gets none. Returns ``(loss, ratio, clipped_low, clipped_high)``, all [N]; a
    completion without tokens has ``s_i = 1`` (and the aggregation leaves it out).
    """
    ratio = torch.exp(completion_mean(wide(logp) - wide(logp_old), mask))
    loss, clipped_low, clipped_high = _clip_objective(ratio, advantages.to(ratio.dtype), eps_low, eps_high)
    return loss, ratio, clipped_low, clipped_high


def cispo_surrogate(logp: Float[Tensor, "N L"], logp_old: Float[Tensor, "N L"],
                    advantages: Float[Tensor, " N"] | Float[Tensor, "N L"], eps_low: float, eps_high: float
                    ) -> TokenTerm:
    """CISPO (MiniMax-M1, 2506.13585): per token ``-sg(clip(w_it, 1-eps_low, 1+eps_high)) A_i logp_it``,
    ``w_it = exp(logp_it - logp_old_it)``. The importance weight is clipped and detached, so every token keeps
    its gradient ``-w_hat A_i dlogp``: none is dropped as the PPO clip drops those past the range (the rare
    "fork" tokens first). Returns ``(loss, ratio, clipped_low, clipped_high)`` [N, L]; clipped here means the
    weight was cut (below ``1-eps_low`` or above ``1+eps_high``), whatever the advantage's sign."""
    logp_wide = wide(logp)
    ratio = torch.exp(logp_wide - wide(logp_old))
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
    loss = -weight * token_advantages(advantages).to(ratio.dtype) * logp_wide
    return loss, ratio, ratio < 1.0 - eps_low, ratio > 1.0 + eps_high


def sapo_surrogate(logp: Float[Tensor, "N L"], logp_old: Float[Tensor, "N L"],
                   advantages: Float[Tensor, " N"] | Float[Tensor, "N L"], tau_pos: float, tau_neg: float,
                   eps_low: float, eps_high: float) -> TokenTerm:
    """SAPO (Gao et al., *Soft Adaptive Policy Optimization*, 2511.20347): per token
    ``-f(w_it) A_i`` with the soft gate ``f(w) = (4 / tau) sigmoid(tau (w - 1))``, ``tau = tau_pos`` if
    ``A_i > 0`` else ``tau_neg``. Its gradient is ``4 sigmoid (1 - sigmoid) w A dlogp``: exactly the
    unclipped one at ``w = 1``, fading smoothly as ``w`` leaves 1 (faster for the larger ``tau``: negative
    advantages, whose updates are the less stable) instead of falling to 0 at a clip boundary. Nothing is
    clipped: ``clipped_low/high`` mark the tokens the hard clip ``(1-eps_low, 1+eps_high)`` would have cut, to
    compare with GRPO. Returns ``(loss, ratio, clipped_low, clipped_high)`` [N, L]."""
    ratio = torch.exp(wide(logp) - wide(logp_old))
    adv = token_advantages(advantages).to(ratio.dtype)
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    return loss, ratio, (ratio < 1.0 - eps_low) & (adv < 0), (ratio > 1.0 + eps_high) & (adv > 0)


def geometric_mean_surrogate(logp: Float[Tensor, "N L"], logp_old: Float[Tensor, "N L"],
                             advantages: Float[Tensor, " N"], mask: Bool[Tensor, "N L"], eps_low: float,
                             eps_high: float) -> GeometricTerm:
    """GMPO (Zhao et al., *Geometric-Mean Policy Optimization*, 2507.20673): the geometric mean of the token
    ratios of a completion, each clipped in log space on the side its advantage's sign makes it bite,

    ``d_it = logp_it - logp_old_it``, ``m_it = sgn(A_i) min(sgn(A_i) d_it, sgn(A_i) clip(d_it, -eps_low, eps_high))``,
    ``g_i = exp((1/|y_i|) sum_t m_it)``, ``loss_i = -A_i g_i``.

    A geometric mean is less moved by one extreme token than the arithmetic one, so the range can be wider
    (the paper's ``eps = 0.4`` in log space, a ratio in ``(e^-0.4, e^0.4)``). A clipped token gives no
    gradient; the others of its completion still do. Returns ``(loss [N], ratio [N], clipped_low [N, L],
    clipped_high [N, L])``: the ratio is the unclipped geometric mean; the clip flags are per token."""
    d = torch.where(mask, wide(logp) - wide(logp_old), torch.zeros((), dtype=wide(logp).dtype, device=logp.device))
    adv = advantages.to(d.dtype)
    sign = torch.sign(adv).unsqueeze(-1)
    kept = sign * torch.minimum(sign * d, sign * d.clamp(-eps_low, eps_high))
    loss = -adv * torch.exp(completion_mean(kept, mask))
    ratio = torch.exp(completion_mean(d, mask))
    return loss, ratio, mask & (d < -eps_low) & (sign < 0), mask & (d > eps_high) & (sign > 0)


# An importance-level term returns (loss, ratio, clipped_low, clipped_high): loss and ratio either both per
# token [N, L] or both per completion [N] (a per-completion loss is spread over its tokens, its ratio
# statistics are per completion, and its aggregation must be sequence_mean: COMPLETION_LEVELS); the clip
# flags per token or per completion.

@register("importance_level", "token")
def token_ratio(s: SurrogateInputs) -> TokenTerm:
    """``l_it = -min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)``, ``w_it = exp(logp_it - logp_old_it)``
    (GRPO, DAPO, Dr.GRPO): :func:`clipped_surrogate`."""
    return clipped_surrogate(s.logp, s.logp_old, s.advantages, s.eps_low, s.eps_high)


@register("importance_level", "sequence")
def sequence_ratio(s: SurrogateInputs) -> CompletionTerm:
    """``l_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``, ``s_i = exp(mean_t(logp_it - logp_old_it))``
    (GSPO): :func:`sequence_clipped_surrogate`."""
    return sequence_clipped_surrogate(s.logp, s.logp_old, s.advantages, s.mask, s.eps_low, s.eps_high)


@register("importance_level", "cispo")
def cispo_weight(s: SurrogateInputs) -> TokenTerm:
    """``l_it = -sg(clip(w_it, 1-eps_low, 1+eps_high)) A_i logp_it`` (CISPO): :func:`cispo_surrogate`."""
    return cispo_surrogate(s.logp, s.logp_old, s.advantages, s.eps_low, s.eps_high)


@register("importance_level", "sapo")
def sapo_gate(s: SurrogateInputs) -> TokenTerm:
    """``l_it = -(4/tau) sigmoid(tau (w_it - 1)) A_i``, ``tau = tau_pos`` if ``A_i > 0`` else ``tau_neg`` (SAPO):
    :func:`sapo_surrogate`."""
    return sapo_surrogate(s.logp, s.logp_old, s.advantages, s.tau_pos, s.tau_neg, s.eps_low, s.eps_high)


@register("importance_level", "gmpo")
def geometric_mean_ratio(s: SurrogateInputs) -> GeometricTerm:
    """``l_i = -A_i exp(mean_t m_it)``, ``m_it`` the log-ratio clipped on its advantage's side in
    ``[-eps_low, eps_high]`` (GMPO): :func:`geometric_mean_surrogate`."""
    return geometric_mean_surrogate(s.logp, s.logp_old, s.advantages, s.mask, s.eps_low, s.eps_high)


# importance levels with one loss per completion, averaged per completion (aggregation sequence_mean); the
# mismatch corrections weigh them per completion too
COMPLETION_LEVELS = ("sequence", "gmpo")
# importance levels that take an advantage per token (loss.advantage=gae) as well as one per completion
TOKEN_ADVANTAGE_LEVELS = ("token", "cispo", "sapo")

IMPORTANCE_LEVELS = tuple(REGISTRIES["importance_level"])
