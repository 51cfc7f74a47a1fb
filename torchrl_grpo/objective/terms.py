"""The terms of the GRPO objective family, one registered function per variant.

A variant is a function registered with ``@register(family, name)``; its name is the value of the config
key ``loss.<family>`` (``loss.aggregation=token_mean``). A surrogate modifier is named by its own key
instead (``loss.tis_cap``) and is on when that key is not null. :class:`torchrl_grpo.objective.loss.GRPOLoss`
reads the config section through these registries and assembles the terms; ``docs/objective.md`` has one
row per registered term (equation, key, presets, paper).

Notation (completion ``i`` of a group of ``G``, token ``t`` of its completion, ``|y_i|`` its number of
completion tokens; every log-prob is of the sampled token given its prefix):

* ``logp`` the trained policy's (differentiable), ``logp_old`` the ratio's denominator (``old_log_probs``:
  the engine's sampling log-probs, or the trainer's own recomputed before the update), ``logp_sample``
  the engine's sampling log-probs (``sample_log_probs``), ``logp_ref`` the reference policy's.
* every mean is over the loss mask only (completion tokens), never prompt or padding.

The plain functions under the terms (:func:`clipped_surrogate`, :func:`tis_weights`, ...) are what
``tests/objective/`` checks against independent float64 computations.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# family -> what its error messages call it; a family's registry is filled by @register below
FAMILIES = {
    "reward_scale": "reward scale",
    "overlong": "overlong",
    "aggregation": "aggregation",
    "kl_estimator": "KL estimator",
    "importance_level": "importance level",
    "surrogate_modifier": "surrogate modifier",
}
REGISTRIES: dict[str, dict[str, Callable]] = {family: {} for family in FAMILIES}
ACCUMULATION_WEIGHTS: dict[str, Callable[[torch.Tensor], float]] = {}
MODIFIER_HINTS: dict[str, str] = {}  # surrogate modifier key -> the fix its config error suggests
MODIFIER_FLOORS: dict[str, float] = {}  # surrogate modifier key -> its parameter must be above this
# the surrogate modifiers that weigh by exp(logp_old - logp_sample), the engine/trainer mismatch: at most one
# of them at a time, and only with the trainer's old log-probs (with the engine's the weight is 1)
MISMATCH_CORRECTIONS: list[str] = []


def register(family: str, name: str, *, weight: Callable[[torch.Tensor], float] | None = None,
             hint: str | None = None, above: float = 0.0, mismatch: bool = False):
    """Decorator: the function becomes choice ``name`` of ``family``. An aggregation also gives its
    accumulation weight, ``weight(loss_mask) -> float``: how much one micro-batch counts in an optimizer step
    so that the weighted micro-batch losses equal the loss of the whole step. A surrogate modifier may give
    the ``hint`` its config key's error suggests, the bound its parameter must be ``above`` (``loss.<name>``
    is a number > ``above``, or null), and whether it is a ``mismatch`` correction
    (:data:`MISMATCH_CORRECTIONS`)."""
    if (family == "aggregation") != (weight is not None):
        raise TypeError(f"{family} {name!r}: an aggregation, and only an aggregation, registers a weight")
    if (hint is not None or above or mismatch) and family != "surrogate_modifier":
        raise TypeError(f"{family} {name!r}: only a surrogate modifier registers a hint, a floor or a mismatch flag")

    def add(fn: Callable) -> Callable:
        if name in REGISTRIES[family]:
            raise ValueError(f"{FAMILIES[family]} {name!r} is registered twice")
        REGISTRIES[family][name] = fn
        if weight is not None:
            ACCUMULATION_WEIGHTS[name] = weight
        if family == "surrogate_modifier":
            MODIFIER_HINTS[name] = hint or f"must be a number > {above:g}, or null to turn it off"
            MODIFIER_FLOORS[name] = above
            if mismatch:
                MISMATCH_CORRECTIONS.append(name)
        return fn

    return add


def term(family: str, name: str) -> Callable:
    """The registered function ``name`` of ``family``; a ValueError listing the choices otherwise."""
    registry = REGISTRIES[family]
    if name not in registry:
        raise ValueError(f"{FAMILIES[family]} {name!r} not in {tuple(registry)}")
    return registry[name]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Half-precision floats (bf16, fp16) as float32: their exps, sums and token counts lose too much.
    float32 and float64 are kept as they are."""
    return x.float() if x.is_floating_point() and x.element_size() < 4 else x


def per_token(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A value per completion [N] repeated over its tokens [N, L]; per-token values [N, L] as they are."""
    return values.unsqueeze(-1).expand_as(mask) if values.dim() == 1 else values


def completion_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean_t values_it`` over each completion's tokens [N]; 0 for a completion without tokens. Values
    outside ``mask`` are never read (not even multiplied by zero: an inf there cannot turn into NaN)."""
    values = _wide(values)
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(-1)
    return total / mask.sum(-1).clamp(min=1).to(values.dtype)


# --- reward scale (loss.reward_scale): centred group rewards -> advantages --------------------------------

@register("reward_scale", "group")
def group_std(grouped: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    """``A_i = (r_i - mean_g r) / (std_g r + eps)``, the group's unbiased std (GRPO); a group of one has std 0."""
    std = grouped.std(dim=1, keepdim=True) if grouped.shape[1] > 1 else torch.zeros_like(centred[:, :1])
    return centred / (std + eps)


@register("reward_scale", "batch")
def batch_std(grouped: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    """``A_i = (r_i - mean_g r) / (std_batch r + eps)``, the unbiased std of every reward of the batch."""
    std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())
    return centred / (std + eps)


@register("reward_scale", "none")
def centred_only(grouped: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    """``A_i = r_i - mean_g r``: no std scaling (Dr.GRPO), so no weight on nearly-always or nearly-never solved
    prompts."""
    return centred


@register("reward_scale", "rloo")
def leave_one_out(grouped: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    """``A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_g r)`` (RLOO, Ahmadian et al. 2024): each
    completion's baseline is the mean of the others, so its own reward does not lower its advantage; no std
    scaling. A group of one has no other completion: 0."""
    size = grouped.shape[1]
    return centred * (size / (size - 1)) if size > 1 else torch.zeros_like(centred)


@register("reward_scale", "reinforce_pp")
def batch_whitened(grouped: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    """``A_i = (r_i - mean_batch r) / (std_batch r + eps)`` (REINFORCE++, Hu 2025, arXiv 2501.03262): no group
    baseline, one global one, so a group whose rewards tie still learns from how it compares with the batch;
    a batch whose rewards all tie gives 0."""
    flat = grouped.reshape(-1)
    if flat.numel() < 2 or bool((flat == flat[0]).all()):
        return torch.zeros_like(grouped)
    return (grouped - flat.mean()) / (flat.std() + eps)


@register("reward_scale", "reinforce_pp_baseline")
def group_centred_batch_whitened(grouped: torch.Tensor, centred: torch.Tensor, eps: float) -> torch.Tensor:
    """``c_i = r_i - mean_g r``, ``A_i = (c_i - mean_batch c) / (std_batch c + eps) = c_i / (std_batch c + eps)``
    (REINFORCE++-baseline, for several completions per prompt): the group's mean as the baseline, the batch's
    spread of the centred rewards as the scale (``batch`` divides by the raw rewards' spread instead)."""
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    return centred / (std + eps)


# reward scales whose baseline is not the group's: a tied group's advantage is not forced to 0
GROUP_FREE_SCALES = ("reinforce_pp",)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6):
    """Advantages of ``rewards`` laid out group-major (``G`` consecutive completions share a prompt), scaled
    by the ``reward_scale`` term ``scale``.

    Returns ``(advantages, tied)``: ``tied`` marks the completions of groups whose rewards are all equal,
    which carry no learning signal against a group baseline (their advantage is then exactly zero; not with
    the :data:`GROUP_FREE_SCALES`). The std is the unbiased one (as in TRL); a group of one has zero
    advantage, never NaN.
    """
    rescale = term("reward_scale", scale)
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    tied = (grouped == grouped[:, :1]).all(dim=1, keepdim=True).expand_as(grouped)
    advantages = rescale(grouped, centred, eps)
    if scale not in GROUP_FREE_SCALES:
        advantages = torch.where(tied, torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1).to(rewards.dtype), tied.reshape(-1)


# --- overlong (loss.overlong): which completion tokens enter the loss --------------------------------------

@register("overlong", "none")
def all_completion_tokens(completion_mask: torch.Tensor, truncated: torch.Tensor | None) -> torch.Tensor:
    """``M_it = c_it``: every completion token. Also ``soft``, whose penalty acts on the reward
    (:func:`overlong_penalty`, added by the loop before the advantages), not on the mask."""
    return completion_mask


@register("overlong", "mask")
def drop_truncated(completion_mask: torch.Tensor, truncated: torch.Tensor | None) -> torch.Tensor:
    """``M_it = c_it (1 - trunc_i)``, DAPO's overlong filtering: a cut-off answer (``finish_reason == length``)
    is neither rewarded nor punished; its row then counts as an empty completion everywhere, accumulation
    weights included."""
    if truncated is None:
        raise KeyError("overlong='mask' needs the batch's 'truncated' [N] (finish_reason == length)")
    return completion_mask & ~truncated.to(completion_mask.device).bool().unsqueeze(-1)


register("overlong", "soft")(all_completion_tokens)


def loss_token_mask(completion_mask: torch.Tensor, truncated: torch.Tensor | None, overlong: str = "none"):
    """The tokens that enter the loss [N, L]: the ``overlong`` term applied to the completion mask."""
    return term("overlong", overlong)(completion_mask, truncated)


def overlong_buffer_tokens(buffer: int | None, max_tokens: int) -> int:
    """The soft-overlong buffer in tokens: ``buffer`` when given, else ``max(1, max_tokens // 5)`` (DAPO's
    proportion: a 4096-token buffer for a 20480-token budget)."""
    return int(buffer) if buffer is not None else max(1, int(max_tokens) // 5)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int | None = None) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward term per completion [N]:

    ``0`` if ``len <= L_max - L_buf``; ``((L_max - L_buf) - len) / L_buf`` in between (linear down to
    ``-1`` at ``len = L_max``); ``-1`` beyond ``L_max``. ``L_max = max_tokens``, ``L_buf = buffer`` (see
    :func:`overlong_buffer_tokens` for ``None``). Added to the reward before the advantages.
    """
    buf = overlong_buffer_tokens(buffer, max_tokens)
    if buf < 1:
        raise ValueError(f"overlong buffer {buf} must be >= 1 token")
    lengths = lengths if lengths.is_floating_point() else lengths.to(torch.get_default_dtype())
    return ((max_tokens - buf - lengths) / buf).clamp(min=-1.0, max=0.0)


# --- aggregation (loss.aggregation): per-token values -> one scalar ---------------------------------------
# Each gets the values with zeros outside the loss mask, the mask as 0/1 in the values' dtype, and the
# constant (inference_model.max_tokens).

@register("aggregation", "token_mean", weight=lambda mask: float(mask.sum()))
def token_mean(masked: torch.Tensor, count: torch.Tensor, constant: float) -> torch.Tensor:
    """``sum_{i,t} v_it / sum_i |y_i|``, one mean over every token of the batch (DAPO). Weight: tokens."""
    return masked.sum() / count.sum().clamp(min=1)


@register("aggregation", "sequence_mean", weight=lambda mask: float((mask.sum(-1) > 0).sum()))
def sequence_mean(masked: torch.Tensor, count: torch.Tensor, constant: float) -> torch.Tensor:
    """``(1/N') sum_i (1/|y_i|) sum_t v_it`` over the ``N'`` non-empty completions (GRPO paper); a completion
    without tokens is left out. Weight: non-empty completions."""
    counts = count.sum(-1)
    present = counts > 0
    per_seq = masked.sum(-1)[present] / counts[present]
    return per_seq.sum() / present.sum().clamp(min=1)


@register("aggregation", "constant_sum", weight=lambda mask: float(mask.shape[0]))
def constant_sum(masked: torch.Tensor, count: torch.Tensor, constant: float) -> torch.Tensor:
    """``sum_{i,t} v_it / (N * constant)`` (Dr.GRPO, constant = max tokens): no length bias. Weight: completions."""
    return masked.sum() / (masked.shape[0] * constant)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, constant: float = 1.0) -> torch.Tensor:
    """Reduce per-token ``values`` [N, L] over the tokens where ``mask`` is set with the aggregation ``mode``.
    Computed in at least float32 (a bf16 token count is inexact beyond 256)."""
    reduce = term("aggregation", mode)
    values = _wide(values)
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return reduce(masked, mask.to(values.dtype), constant)


def accumulation_weight(mode: str, mask: torch.Tensor) -> float:
    """The accumulation weight of aggregation ``mode`` on a micro-batch's loss mask (:func:`loss_token_mask`);
    the loop divides by the sum over the step's micro-batches."""
    term("aggregation", mode)  # an unknown mode: the ValueError that lists the choices
    return ACCUMULATION_WEIGHTS[mode](mask)


# --- KL estimators (loss.kl_estimator), on d = logp - logp_other -------------------------------------------

@register("kl_estimator", "k1")
def kl_k1(d: torch.Tensor) -> torch.Tensor:
    """``k1 = d``: unbiased, but negative on some samples."""
    return d


@register("kl_estimator", "k2")
def kl_k2(d: torch.Tensor) -> torch.Tensor:
    """``k2 = d^2 / 2``: never negative, biased, low variance."""
    return 0.5 * d.pow(2)


@register("kl_estimator", "k3")
def kl_k3(d: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(-d) + d - 1``: unbiased and never negative (computed as ``expm1(-d) + d``)."""
    return torch.expm1(-d) + d


def kl_estimate(logp: torch.Tensor, logp_other: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_other) from samples of pi_theta (Schulman's k1/k2/k3) on
    ``d = logp - logp_other``."""
    d = _wide(logp) - _wide(logp_other)
    return term("kl_estimator", estimator)(d)


# --- importance level (loss.importance_level): the clipped surrogate ----------------------------------------

@dataclass(frozen=True)
class SurrogateInputs:
    """What the importance-level terms and the surrogate modifiers read: [N, L] float32 log-probs with zeros
    outside the completions, ``advantages`` [N] (or [N, L] for the :data:`TOKEN_ADVANTAGE_LEVELS`), the loss
    ``mask`` [N, L]."""
    logp: torch.Tensor
    logp_old: torch.Tensor
    logp_sample: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    importance_level: str
    eps_low: float
    eps_high: float
    tau_pos: float = 1.0  # SAPO's gate temperatures, for A > 0 and A <= 0
    tau_neg: float = 1.05


def token_advantages(advantages: torch.Tensor) -> torch.Tensor:
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


def clipped_surrogate(logp, logp_old, advantages, eps_low: float, eps_high: float):
    """Token level: per token ``-min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)`` with
    ``w_it = exp(logp_it - logp_old_it)``.

    ``advantages`` is per completion [N] (broadcast over tokens) or per token [N, L]. Returns ``(loss, ratio,
    clipped_low, clipped_high)``, all [N, L]: a token counts as clipped where the clipped branch is the one taken and
    carries no gradient (ratio below ``1-eps_low`` with ``A < 0``, above ``1+eps_high`` with ``A > 0``).
    """
    ratio = torch.exp(_wide(logp) - _wide(logp_old))
    adv = token_advantages(advantages).to(ratio.dtype)
    loss, clipped_low, clipped_high = _clip_objective(ratio, adv, eps_low, eps_high)
    return loss, ratio, clipped_low, clipped_high


def sequence_clipped_surrogate(logp, logp_old, advantages, mask, eps_low: float, eps_high: float):
    """Sequence level (GSPO): one length-normalised ratio per completion,

    ``s_i = exp((1/|y_i|) sum_t (logp_it - logp_old_it))``  (= ``(pi(y_i)/pi_old(y_i))^(1/|y_i|)``),
    ``loss_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``.

    The gradient flows through the mean (every token of ``y_i`` gets ``d loss_i / d s_i * s_i / |y_i|``);
    a clipped completion gets none. Returns ``(loss, ratio, clipped_low, clipped_high)``, all [N]; a
    completion without tokens has ``s_i = 1`` (and the aggregation leaves it out).
    """
    ratio = torch.exp(completion_mean(_wide(logp) - _wide(logp_old), mask))
    loss, clipped_low, clipped_high = _clip_objective(ratio, advantages.to(ratio.dtype), eps_low, eps_high)
    return loss, ratio, clipped_low, clipped_high


def cispo_surrogate(logp, logp_old, advantages, eps_low: float, eps_high: float):
    """CISPO (MiniMax-M1, 2506.13585): per token ``-sg(clip(w_it, 1-eps_low, 1+eps_high)) A_i logp_it``,
    ``w_it = exp(logp_it - logp_old_it)``. The importance weight is clipped and detached, so every token keeps
    its gradient ``-w_hat A_i dlogp``: none is dropped as the PPO clip drops those past the range (the rare
    "fork" tokens first). Returns ``(loss, ratio, clipped_low, clipped_high)`` [N, L]; clipped here means the
    weight was cut (below ``1-eps_low`` or above ``1+eps_high``), whatever the advantage's sign."""
    logp_wide = _wide(logp)
    ratio = torch.exp(logp_wide - _wide(logp_old))
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
    loss = -weight * token_advantages(advantages).to(ratio.dtype) * logp_wide
    return loss, ratio, ratio < 1.0 - eps_low, ratio > 1.0 + eps_high


def sapo_surrogate(logp, logp_old, advantages, tau_pos: float, tau_neg: float, eps_low: float, eps_high: float):
    """SAPO (Gao et al., *Soft Adaptive Policy Optimization*, 2511.20347): per token
    ``-f(w_it) A_i`` with the soft gate ``f(w) = (4 / tau) sigmoid(tau (w - 1))``, ``tau = tau_pos`` if
    ``A_i > 0`` else ``tau_neg``. Its gradient is ``4 sigmoid (1 - sigmoid) w A dlogp``: exactly the
    unclipped one at ``w = 1``, fading smoothly as ``w`` leaves 1 (faster for the larger ``tau``: negative
    advantages, whose updates are the less stable) instead of falling to 0 at a clip boundary. Nothing is
    clipped: ``clipped_low/high`` mark the tokens the hard clip ``(1-eps_low, 1+eps_high)`` would have cut, to
    compare with GRPO. Returns ``(loss, ratio, clipped_low, clipped_high)`` [N, L]."""
    ratio = torch.exp(_wide(logp) - _wide(logp_old))
    adv = token_advantages(advantages).to(ratio.dtype)
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    return loss, ratio, (ratio < 1.0 - eps_low) & (adv < 0), (ratio > 1.0 + eps_high) & (adv > 0)


def geometric_mean_surrogate(logp, logp_old, advantages, mask, eps_low: float, eps_high: float):
    """GMPO (Zhao et al., *Geometric-Mean Policy Optimization*, 2507.20673): the geometric mean of the token
    ratios of a completion, each clipped in log space on the side its advantage's sign makes it bite,

    ``d_it = logp_it - logp_old_it``, ``m_it = sgn(A_i) min(sgn(A_i) d_it, sgn(A_i) clip(d_it, -eps_low, eps_high))``,
    ``g_i = exp((1/|y_i|) sum_t m_it)``, ``loss_i = -A_i g_i``.

    A geometric mean is less moved by one extreme token than the arithmetic one, so the range can be wider
    (the paper's ``eps = 0.4`` in log space, a ratio in ``(e^-0.4, e^0.4)``). A clipped token gives no
    gradient; the others of its completion still do. Returns ``(loss [N], ratio [N], clipped_low [N, L],
    clipped_high [N, L])``: the ratio is the unclipped geometric mean; the clip flags are per token."""
    d = torch.where(mask, _wide(logp) - _wide(logp_old), torch.zeros((), dtype=_wide(logp).dtype, device=logp.device))
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
def token_ratio(s: SurrogateInputs):
    """``l_it = -min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)``, ``w_it = exp(logp_it - logp_old_it)``
    (GRPO, DAPO, Dr.GRPO): :func:`clipped_surrogate`."""
    return clipped_surrogate(s.logp, s.logp_old, s.advantages, s.eps_low, s.eps_high)


@register("importance_level", "sequence")
def sequence_ratio(s: SurrogateInputs):
    """``l_i = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``, ``s_i = exp(mean_t(logp_it - logp_old_it))``
    (GSPO): :func:`sequence_clipped_surrogate`."""
    return sequence_clipped_surrogate(s.logp, s.logp_old, s.advantages, s.mask, s.eps_low, s.eps_high)


@register("importance_level", "cispo")
def cispo_weight(s: SurrogateInputs):
    """``l_it = -sg(clip(w_it, 1-eps_low, 1+eps_high)) A_i logp_it`` (CISPO): :func:`cispo_surrogate`."""
    return cispo_surrogate(s.logp, s.logp_old, s.advantages, s.eps_low, s.eps_high)


@register("importance_level", "sapo")
def sapo_gate(s: SurrogateInputs):
    """``l_it = -(4/tau) sigmoid(tau (w_it - 1)) A_i``, ``tau = tau_pos`` if ``A_i > 0`` else ``tau_neg`` (SAPO):
    :func:`sapo_surrogate`."""
    return sapo_surrogate(s.logp, s.logp_old, s.advantages, s.tau_pos, s.tau_neg, s.eps_low, s.eps_high)


@register("importance_level", "gmpo")
def geometric_mean_ratio(s: SurrogateInputs):
    """``l_i = -A_i exp(mean_t m_it)``, ``m_it`` the log-ratio clipped on its advantage's side in
    ``[-eps_low, eps_high]`` (GMPO): :func:`geometric_mean_surrogate`."""
    return geometric_mean_surrogate(s.logp, s.logp_old, s.advantages, s.mask, s.eps_low, s.eps_high)


# importance levels with one loss per completion, averaged per completion (aggregation sequence_mean); the
# mismatch corrections weigh them per completion too
COMPLETION_LEVELS = ("sequence", "gmpo")
# importance levels that take an advantage per token (loss.advantage=gae) as well as one per completion
TOKEN_ADVANTAGE_LEVELS = ("token", "cispo", "sapo")


# --- surrogate modifiers (loss.<name>, on when not null), applied in this order ----------------------------
# Each takes the per-token surrogate [N, L], its parameter and the SurrogateInputs, and returns the
# modified surrogate and its diagnostics.

@torch.no_grad()
def tis_weights(old_log_probs, sample_log_probs, cap: float, mask, level: str = "token"):
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
def mis_weights(old_log_probs, sample_log_probs, cap: float, mask, level: str = "token"):
    """Masked importance sampling (MIS; IcePop's band): the same ratio ``rho`` as :func:`tis_weights`, kept
    where ``1/C <= rho <= C`` and 0 outside: a token (or at the sequence level a completion) on which engine
    and trainer disagree that much leaves the loss instead of being capped. Returns ``(weight, masked)``;
    outside ``mask`` the weight is 1."""
    raw = mismatch_ratio(old_log_probs, sample_log_probs, mask, level)
    masked = (raw < 1.0 / cap) | (raw > cap)
    return torch.where(masked, torch.zeros_like(raw), raw), masked


def mismatch_ratio(old_log_probs, sample_log_probs, mask, level: str) -> torch.Tensor:
    """``exp(logp_old_it - logp_sample_it)`` [N, L] (1 outside ``mask``), or at the sequence level
    ``exp((1/|y_i|) sum_t (logp_old_it - logp_sample_it))`` [N]."""
    diff = _wide(old_log_probs) - _wide(sample_log_probs)
    if level == "sequence":
        return torch.exp(completion_mean(diff, mask))
    if level == "token":
        return torch.exp(torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device)))
    raise ValueError(f"mismatch correction level {level!r} not in ('token', 'sequence')")


def correction_level(importance_level: str) -> str:
    """The level of the mismatch corrections: per completion with the :data:`COMPLETION_LEVELS`, else per token."""
    return "sequence" if importance_level in COMPLETION_LEVELS else "token"


@torch.no_grad()
def off_policy_keep(logp, sample_log_probs, advantages, mask, threshold: float):
    """Off-policy sequence masking (DeepSeek-V3.2; TRL's ``off_policy_mask_threshold``).

    ``D_i = (1/|y_i|) sum_t (logp_sample_it - logp_it)`` (detached): a single-sample estimate of
    KL(pi_sample || pi_theta) along the sampled completion, ``logp_sample`` being the policy that generated
    it (the engine; TRL's ``sampling_per_token_logps``). A completion is dropped (``M_i = 0`` on all its
    tokens) iff ``A_i < 0`` and ``D_i > delta``: a bad answer the current policy already moved away from.
    The mask multiplies the surrogate only; the aggregation's denominators are unchanged.
    Returns ``(keep [N] bool, D [N])``; an empty completion has ``D = 0`` and is kept.
    """
    divergence = completion_mean(_wide(sample_log_probs) - _wide(logp), mask)
    keep = (advantages.to(divergence.device) >= 0) | (divergence <= threshold)
    return keep, divergence


def _token_share(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The share of the loss tokens where ``flags`` is set."""
    return (flags & mask).sum() / mask.sum().clamp(min=1)


@register("surrogate_modifier", "tis_cap", hint="must be a number > 0 (e.g. 2), or null to turn TIS off",
          mismatch=True)
def truncated_importance_sampling(surrogate: torch.Tensor, cap: float, s: SurrogateInputs):
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
def masked_importance_sampling(surrogate: torch.Tensor, cap: float, s: SurrogateInputs):
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
def off_policy_mask(surrogate: torch.Tensor, threshold: float, s: SurrogateInputs):
    """``l_it <- M_i l_it``, ``M_i = 0`` iff ``A_i < 0`` and ``mean_t(logp_sample_it - logp_it) > delta``
    (:func:`off_policy_keep`). Diagnostic: ``off_policy_masked_fraction`` (tokens dropped)."""
    keep, _ = off_policy_keep(s.logp, s.logp_sample, s.advantages, s.mask, threshold)
    return surrogate * keep.unsqueeze(-1).to(surrogate.dtype), {
        "off_policy_masked_fraction": _token_share(~keep.unsqueeze(-1), s.mask),
    }


REWARD_SCALES = tuple(REGISTRIES["reward_scale"])
OVERLONG = tuple(REGISTRIES["overlong"])
AGGREGATIONS = tuple(REGISTRIES["aggregation"])
KL_ESTIMATORS = tuple(REGISTRIES["kl_estimator"])
IMPORTANCE_LEVELS = tuple(REGISTRIES["importance_level"])
SURROGATE_MODIFIERS = tuple(REGISTRIES["surrogate_modifier"])
