"""The GRPO objective family: group-relative advantages and a clipped-surrogate TorchRL ``LossModule``.

Notation (completion ``i`` of a group of ``G``, token ``t`` of its completion, ``|y_i|`` its number of
completion tokens; every log-prob is of the sampled token given its prefix):

* ``logp`` the trained policy's (differentiable), ``logp_old`` the ratio's denominator (``old_log_probs``:
  the engine's sampling log-probs, or the trainer's own recomputed before the update), ``logp_sample``
  the engine's sampling log-probs (``sample_log_probs``), ``logp_ref`` the reference policy's.
* advantage ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` (``reward_scale=group``); ``batch``
  uses the std of the whole batch, ``none`` only centres (Dr.GRPO). One advantage per completion.
* token ratio ``w_it = exp(logp_it - logp_old_it)``; sequence ratio (GSPO)
  ``s_i = exp(mean_t(logp_it - logp_old_it))``; clipped surrogate ``-min(r A, clip(r, 1 - eps_low,
  1 + eps_high) A)`` on either.
* KL estimators on ``d = logp - logp_other``: k1 ``d``, k2 ``d^2 / 2``, k3 ``exp(-d) + d - 1``.
* every mean is over completion tokens only (``completion_mask``), never prompt or padding.

Each variant is a plain function with its equation in the docstring, so that tests can check each
against an independent computation; :class:`GRPOLoss` only runs the policy forward and assembles them.
``docs/objective.md`` maps the variants to their papers, config keys and presets.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torchrl.objectives import LossModule

AGGREGATIONS = ("token_mean", "sequence_mean", "constant_sum")
REWARD_SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_LEVELS = ("token", "sequence")
OVERLONG = ("none", "mask", "soft")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Half-precision floats (bf16, fp16) as float32: their exps, sums and token counts lose too much.
    float32 and float64 are kept as they are."""
    return x.float() if x.is_floating_point() and x.element_size() < 4 else x


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6):
    """Advantages of ``rewards`` laid out group-major (``G`` consecutive completions share a prompt).

    Returns ``(advantages, tied)``: ``tied`` marks the completions of groups whose rewards are all equal,
    which carry no learning signal (their advantage is exactly zero). The std is the unbiased one (as in
    TRL); a group of one has zero advantage, never NaN.
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"reward scale {scale!r} not in {REWARD_SCALES}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    tied = (grouped == grouped[:, :1]).all(dim=1, keepdim=True).expand_as(grouped)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        centred = centred / (std + eps)
    elif scale == "batch":
        std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())
        centred = centred / (std + eps)
    centred = torch.where(tied, torch.zeros_like(centred), centred)
    return centred.reshape(-1).to(rewards.dtype), tied.reshape(-1)


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


def loss_token_mask(completion_mask: torch.Tensor, truncated: torch.Tensor | None, overlong: str = "none"):
    """The tokens that enter the loss [N, L]: the completion tokens, less every token of the truncated
    completions when ``overlong="mask"`` (DAPO's overlong filtering: a cut-off answer is neither rewarded
    nor punished; its row then counts as an empty completion everywhere, accumulation weights included).
    ``soft`` acts on the reward (:func:`overlong_penalty`), so here it is the same as ``none``."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong {overlong!r} not in {OVERLONG}")
    if overlong != "mask":
        return completion_mask
    if truncated is None:
        raise KeyError("overlong='mask' needs the batch's 'truncated' [N] (finish_reason == length)")
    return completion_mask & ~truncated.to(completion_mask.device).bool().unsqueeze(-1)


def kl_estimate(logp: torch.Tensor, logp_other: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_other) from samples of pi_theta (Schulman's k1/k2/k3):
    on ``d = logp - logp_other``, k1 ``d``, k2 ``d^2 / 2``, k3 ``exp(-d) + d - 1``."""
    d = _wide(logp) - _wide(logp_other)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"KL estimator {estimator!r} not in {KL_ESTIMATORS}")


def completion_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean_t values_it`` over each completion's tokens [N]; 0 for a completion without tokens. Values
    outside ``mask`` are never read (not even multiplied by zero: an inf there cannot turn into NaN)."""
    values = _wide(values)
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(-1)
    return total / mask.sum(-1).clamp(min=1).to(values.dtype)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, constant: float = 1.0) -> torch.Tensor:
    """Reduce per-token ``values`` [N, L] over the tokens where ``mask`` is set.

    * ``token_mean``: ``sum_{i,t} v_it / sum_i |y_i|``, one mean over every completion token (DAPO).
    * ``sequence_mean``: ``(1/N') sum_i (1/|y_i|) sum_t v_it`` over the ``N'`` non-empty completions
      (GRPO paper); a completion without tokens is left out.
    * ``constant_sum``: ``sum_{i,t} v_it / (N * constant)`` (Dr.GRPO, constant = max tokens).

    Computed in at least float32 (a bf16 token count is inexact beyond 256).
    """
    values = _wide(values)
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    count = mask.to(values.dtype)
    if mode == "token_mean":
        return masked.sum() / count.sum().clamp(min=1)
    if mode == "sequence_mean":
        counts = count.sum(-1)
        present = counts > 0
        per_seq = masked.sum(-1)[present] / counts[present]
        return per_seq.sum() / present.sum().clamp(min=1)
    if mode == "constant_sum":
        return masked.sum() / (values.shape[0] * constant)
    raise ValueError(f"aggregation {mode!r} not in {AGGREGATIONS}")


def accumulation_weight(mode: str, mask: torch.Tensor) -> float:
    """How much one micro-batch counts in an optimizer step, so accumulated micro-batch losses equal the
    loss of the whole step: tokens for ``token_mean``, non-empty completions for ``sequence_mean``,
    completions for ``constant_sum``. The loop divides by the sum over the step's micro-batches.
    ``mask`` is the loss mask (:func:`loss_token_mask`), see :meth:`GRPOLoss.accumulation_weight`."""
    if mode == "token_mean":
        return float(mask.sum())
    if mode == "sequence_mean":
        return float((mask.sum(-1) > 0).sum())
    return float(mask.shape[0])


def _clip_objective(ratio, adv, eps_low: float, eps_high: float):
    """``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` and where the clipped branch is taken (no gradient)."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)
    return loss, clipped_low, clipped_high


def clipped_surrogate(logp, logp_old, advantages, eps_low: float, eps_high: float):
    """Token level (GRPO, DAPO, Dr.GRPO): per token ``-min(w_it A_i, clip(w_it, 1-eps_low, 1+eps_high) A_i)``
    with ``w_it = exp(logp_it - logp_old_it)``.

    ``advantages`` is per completion [N] (broadcast over tokens). Returns ``(loss, ratio, clipped_low,
    clipped_high)``, all [N, L]: a token counts as clipped where the clipped branch is the one taken and
    carries no gradient (ratio below ``1-eps_low`` with ``A < 0``, above ``1+eps_high`` with ``A > 0``).
    """
    ratio = torch.exp(_wide(logp) - _wide(logp_old))
    adv = advantages.unsqueeze(-1).to(ratio.dtype)
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


@torch.no_grad()
def tis_weights(old_log_probs, sample_log_probs, cap: float, mask, level: str = "token"):
    """Truncated importance sampling (TIS) for the engine/trainer mismatch, a detached weight on the surrogate.

    * token level: ``rho_it = min(exp(logp_old_it - logp_sample_it), C)`` [N, L];
    * sequence level (with GSPO): ``rho_i = min(exp((1/|y_i|) sum_t (logp_old_it - logp_sample_it)), C)``
      [N], the same length normalisation as the GSPO ratio.

    ``logp_old`` must be the trainer's recomputed log-probs (``loss.old_log_probs=trainer``): with the
    engine's the weight is 1. Returns ``(weight, capped)``; ``capped`` marks where the cap bit. Outside
    ``mask`` the weight is 1 and nothing is capped (unless ``C < 1``).
    """
    diff = _wide(old_log_probs) - _wide(sample_log_probs)
    if level == "sequence":
        raw = torch.exp(completion_mean(diff, mask))
    elif level == "token":
        raw = torch.exp(torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device)))
    else:
        raise ValueError(f"importance level {level!r} not in {IMPORTANCE_LEVELS}")
    return raw.clamp(max=cap), raw > cap


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


def first_completion_column(completion_mask: torch.Tensor) -> int:
    """The first position where any row has a completion token (at least 1: position 0 has no prefix)."""
    columns = completion_mask.any(0).nonzero()
    return max(1, int(columns.min())) if len(columns) else completion_mask.shape[1]


def token_log_probs(model, tokens, attention_mask, temperature: float = 1.0, with_entropy: bool = False,
                    start: int = 1, entropy_grad: bool = False):
    """Log-prob of each token given its prefix, under ``softmax(logits / temperature)``, as [N, L].

    Only positions ``>= start`` are computed (the rest, prompt positions, are 0): the vocabulary
    projection and log-softmax over prompt tokens would dominate the cost of short completions. The
    temperature is the sampling one, so that these log-probs and the engine's describe the same
    distribution. The per-position entropy of that distribution too if asked, differentiable only if
    ``entropy_grad`` (otherwise it is a diagnostic and must not cost a backward pass).
    """
    length = tokens.shape[1]
    start = min(max(1, start), length)
    logits = model(input_ids=tokens, attention_mask=attention_mask.long(),
                   logits_to_keep=length - start + 1).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    # with the layers split over several GPUs the logits live on the last one: come back to the inputs'
    taken = log_probs.gather(-1, tokens[:, start:].unsqueeze(-1).to(log_probs.device)).squeeze(-1)
    taken = F.pad(taken, (start, 0)).to(tokens.device)
    if not with_entropy:
        return taken, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return taken, F.pad(entropy, (start, 0)).to(tokens.device)


def _inside(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` as float32 with 0 outside ``mask``: whatever a batch holds in prompt or padding positions
    can then never reach an exp (an inf there would make a NaN even multiplied by zero)."""
    return torch.where(mask, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))


class GRPOLoss(LossModule):
    """The GRPO objective family as one TorchRL loss: clipped surrogate (token or sequence level), optional
    truncated importance sampling and off-policy masking, KL to the reference and to the sampling policy,
    and an entropy bonus.

    Reads from the batch: ``tokens``, ``attention_mask``, ``completion_mask`` [N, L], ``advantage`` [N],
    ``old_log_probs`` [N, L] (the ratio's denominator: the engine's sampling log-probs, or the policy's
    own recomputed before the update), ``sample_log_probs`` [N, L] (the engine's: KL to the sampling
    policy, TIS, off-policy mask), ``ref_log_probs`` [N, L] when ``kl_to_ref_coeff > 0`` (and for the
    ``kl_k*`` diagnostics whenever present), ``truncated`` [N] when ``overlong="mask"``.

    Returns ``loss_objective``, ``loss_kl_to_ref``, ``loss_kl_to_inference``, ``loss_entropy`` (their sum
    is what to minimise) and detached diagnostics: ``clip_fraction_low/high``, ``ratio_mean/max``, ``ess``
    (over completion tokens; over completions at the sequence level), ``entropy``, ``kl_to_inference``,
    ``kl_inference_k1/k2/k3`` and, with reference log-probs, ``kl_k1/k2/k3`` (token means), ``kl_to_ref``
    (aggregated like the loss, when in the loss); ``tis_truncated_fraction`` and ``tis_weight_mean`` with
    ``tis_cap``; ``off_policy_masked_fraction`` with ``off_policy_mask_threshold`` (shares of completion
    tokens).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        clip_epsilon_low: float = 0.2,
        clip_epsilon_high: float = 0.2,
        aggregation: str = "sequence_mean",
        aggregation_constant: float = 1.0,
        kl_to_ref_coeff: float = 0.0,
        kl_to_inference_coeff: float = 0.0,
        kl_estimator: str = "k3",
        entropy_coeff: float = 0.0,
        temperature: float = 1.0,
        importance_level: str = "token",
        tis_cap: float | None = None,
        overlong: str = "none",
        off_policy_mask_threshold: float | None = None,
    ):
        super().__init__()
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {aggregation!r} not in {AGGREGATIONS}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {kl_estimator!r} not in {KL_ESTIMATORS}")
        if importance_level not in IMPORTANCE_LEVELS:
            raise ValueError(f"importance level {importance_level!r} not in {IMPORTANCE_LEVELS}")
        if importance_level == "sequence" and aggregation != "sequence_mean":
            raise ValueError("importance_level='sequence' (GSPO) averages one loss per completion: "
                             f"aggregation must be 'sequence_mean', not {aggregation!r}")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong {overlong!r} not in {OVERLONG}")
        if tis_cap is not None and not tis_cap > 0:
            raise ValueError(f"tis_cap={tis_cap!r} must be > 0 (or None)")
        if off_policy_mask_threshold is not None and not off_policy_mask_threshold > 0:
            raise ValueError(f"off_policy_mask_threshold={off_policy_mask_threshold!r} must be > 0 (or None)")
        self.policy = policy
        self.clip_epsilon_low = clip_epsilon_low
        self.clip_epsilon_high = clip_epsilon_high
        self.aggregation = aggregation
        self.aggregation_constant = aggregation_constant
        self.kl_to_ref_coeff = kl_to_ref_coeff
        self.kl_to_inference_coeff = kl_to_inference_coeff
        self.kl_estimator = kl_estimator
        self.entropy_coeff = entropy_coeff
        self.temperature = temperature
        self.importance_level = importance_level
        self.tis_cap = tis_cap
        self.overlong = overlong
        self.off_policy_mask_threshold = off_policy_mask_threshold

    def _mean(self, values, mask):
        return aggregate(values, mask, self.aggregation, self.aggregation_constant)

    def token_mask(self, batch: TensorDictBase) -> torch.Tensor:
        """The tokens that enter the loss: see :func:`loss_token_mask`."""
        truncated = batch["truncated"] if "truncated" in batch.keys() else None
        return loss_token_mask(batch["completion_mask"], truncated, self.overlong)

    def accumulation_weight(self, batch: TensorDictBase) -> float:
        """:func:`accumulation_weight` of this loss's aggregation on the micro-batch's loss mask (so that
        completions dropped by ``overlong="mask"`` do not count)."""
        return accumulation_weight(self.aggregation, self.token_mask(batch))

    def forward(self, batch: TensorDictBase) -> TensorDict:
        completion = batch["completion_mask"]
        mask = self.token_mask(batch)
        logp, entropy = token_log_probs(
            self.policy, batch["tokens"], batch["attention_mask"], self.temperature, with_entropy=True,
            start=first_completion_column(completion), entropy_grad=self.entropy_coeff > 0,
        )
        logp = _inside(logp, completion)
        old = _inside(batch["old_log_probs"], completion)
        sample = _inside(batch["sample_log_probs"], completion)
        adv = batch["advantage"].to(logp.dtype)
        sequence_level = self.importance_level == "sequence"

        if sequence_level:
            loss_i, ratio, clipped_low, clipped_high = sequence_clipped_surrogate(
                logp, old, adv, mask, self.clip_epsilon_low, self.clip_epsilon_high)
            surrogate = loss_i.unsqueeze(-1).expand_as(logp)
            unit = mask.any(-1)  # statistics per completion
        else:
            surrogate, ratio, clipped_low, clipped_high = clipped_surrogate(
                logp, old, adv, self.clip_epsilon_low, self.clip_epsilon_high)
            unit = mask  # statistics per completion token

        extra = {}
        tokens = mask.sum().clamp(min=1)
        if self.tis_cap is not None:
            weight, capped = tis_weights(old, sample, self.tis_cap, mask, self.importance_level)
            if sequence_level:
                weight, capped = weight.unsqueeze(-1).expand_as(mask), capped.unsqueeze(-1).expand_as(mask)
            surrogate = surrogate * weight
            extra["tis_truncated_fraction"] = (capped & mask).sum() / tokens
            extra["tis_weight_mean"] = aggregate(weight, mask, "token_mean")
        if self.off_policy_mask_threshold is not None:
            keep, _ = off_policy_keep(logp, sample, adv, mask, self.off_policy_mask_threshold)
            surrogate = surrogate * keep.unsqueeze(-1).to(surrogate.dtype)
            extra["off_policy_masked_fraction"] = (mask & ~keep.unsqueeze(-1)).sum() / tokens

        kl_inference = kl_estimate(logp, sample, self.kl_estimator)
        out = {
            "loss_objective": self._mean(surrogate, mask),
            "loss_kl_to_inference": self.kl_to_inference_coeff * self._mean(kl_inference, mask),
            "loss_entropy": -self.entropy_coeff * self._mean(entropy, mask),
        }
        ref = _inside(batch["ref_log_probs"], completion) if "ref_log_probs" in batch.keys() else None
        if self.kl_to_ref_coeff > 0:
            kl_ref = kl_estimate(logp, ref, self.kl_estimator)
            out["loss_kl_to_ref"] = self.kl_to_ref_coeff * self._mean(kl_ref, mask)
            out["kl_to_ref"] = self._mean(kl_ref, mask).detach()
        else:
            out["loss_kl_to_ref"] = torch.zeros((), device=logp.device)
        out.update(self._diagnostics(mask, unit, ratio.detach(), clipped_low, clipped_high, entropy,
                                     kl_inference, logp.detach(), sample, ref))
        out.update(extra)
        return TensorDict(out, batch_size=[])

    def _diagnostics(self, mask, unit, ratio, clipped_low, clipped_high, entropy, kl_inference, logp, sample, ref):
        """Statistics that tell whether the update is healthy: token means over completion tokens, except
        the ratio statistics, over ``unit`` (tokens, or completions at the sequence level)."""
        units = unit.sum().clamp(min=1)
        w = ratio[unit]
        ess = w.sum().pow(2) / (w.numel() * w.pow(2).sum()).clamp(min=1e-12) if w.numel() else ratio.new_ones(())
        out = {
            "clip_fraction_low": (clipped_low & unit).sum() / units,
            "clip_fraction_high": (clipped_high & unit).sum() / units,
            "ratio_mean": w.mean() if w.numel() else ratio.new_ones(()),
            "ratio_max": w.max() if w.numel() else ratio.new_ones(()),
            "ess": ess,
            "entropy": aggregate(entropy.detach(), mask, "token_mean"),
            "kl_to_inference": aggregate(kl_inference.detach(), mask, "token_mean"),
        }
        for estimator in KL_ESTIMATORS:
            out[f"kl_inference_{estimator}"] = aggregate(kl_estimate(logp, sample, estimator), mask, "token_mean")
            if ref is not None:
                out[f"kl_{estimator}"] = aggregate(kl_estimate(logp, ref, estimator), mask, "token_mean")
        return out


def total_loss(losses: TensorDictBase) -> torch.Tensor:
    """Sum of the ``loss_*`` entries only (TensorDict's own mean/sum would mix in the diagnostics)."""
    return sum(value for key, value in losses.items() if key.startswith("loss_"))
