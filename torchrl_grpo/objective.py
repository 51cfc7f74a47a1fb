"""The GRPO objective: group-relative advantages and a clipped-surrogate TorchRL ``LossModule``.

Notation (one completion ``i`` of a group of ``G``, token ``t`` of its completion):

* advantage ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` (``reward_scale=group``); ``batch`` uses
  the std of the whole batch, ``none`` only centres (Dr.GRPO).
* ratio ``w_it = exp(logp_theta - logp_old)`` with ``logp_old`` the log-probs of the policy that sampled
  the data (the engine's sampling log-probs), clipped surrogate
  ``-min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)``.
* KL estimators on ``d = logp_theta - logp_other``: k1 ``d``, k2 ``d^2 / 2``, k3 ``exp(-d) + d - 1``.
* every mean is over completion tokens only (``completion_mask``), never prompt or padding.

The per-token pieces are plain functions so that tests can check each against an independent
computation; :class:`GRPOLoss` only runs the policy forward and assembles them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torchrl.objectives import LossModule

AGGREGATIONS = ("token_mean", "sequence_mean", "constant_sum")
REWARD_SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")


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


def kl_estimate(logp: torch.Tensor, logp_other: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_other) from samples of pi_theta (Schulman's k1/k2/k3)."""
    d = logp - logp_other
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"KL estimator {estimator!r} not in {KL_ESTIMATORS}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, constant: float = 1.0) -> torch.Tensor:
    """Reduce per-token ``values`` [N, L] over the tokens where ``mask`` is set.

    * ``token_mean``: one mean over every completion token of the batch (DAPO).
    * ``sequence_mean``: mean over each completion's tokens, then over completions (GRPO paper); a
      completion without tokens is left out.
    * ``constant_sum``: sum over tokens divided by ``N * constant`` (Dr.GRPO, constant = max tokens).
    """
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1)
    if mode == "sequence_mean":
        counts = mask.sum(-1)
        present = counts > 0
        per_seq = masked.sum(-1)[present] / counts[present]
        return per_seq.sum() / present.sum().clamp(min=1)
    if mode == "constant_sum":
        return masked.sum() / (values.shape[0] * constant)
    raise ValueError(f"aggregation {mode!r} not in {AGGREGATIONS}")


def accumulation_weight(mode: str, mask: torch.Tensor) -> float:
    """How much one micro-batch counts in an optimizer step, so accumulated micro-batch losses equal the
    loss of the whole step: tokens for ``token_mean``, non-empty completions for ``sequence_mean``,
    completions for ``constant_sum``. The loop divides by the sum over the step's micro-batches."""
    if mode == "token_mean":
        return float(mask.sum())
    if mode == "sequence_mean":
        return float((mask.sum(-1) > 0).sum())
    return float(mask.shape[0])


def clipped_surrogate(logp, logp_old, advantages, eps_low: float, eps_high: float):
    """Per-token ``-min(w A, clip(w, 1-eps_low, 1+eps_high) A)`` and the masks of clipped tokens.

    ``advantages`` is per completion [N] (broadcast over tokens). Returns ``(loss, ratio, clipped_low,
    clipped_high)``: a token counts as clipped where the clipped branch is the one taken and carries no
    gradient (ratio below ``1-eps_low`` with ``A < 0``, above ``1+eps_high`` with ``A > 0``).
    """
    ratio = torch.exp(logp - logp_old)
    adv = advantages.unsqueeze(-1).to(ratio.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)
    return loss, ratio, clipped_low, clipped_high


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


class GRPOLoss(LossModule):
    """Clipped-surrogate GRPO loss with KL to the reference and to the sampling policy, and an entropy bonus.

    Reads from the batch: ``tokens``, ``attention_mask``, ``completion_mask`` [N, L], ``advantage`` [N],
    ``old_log_probs`` [N, L] (the ratio's denominator: the engine's sampling log-probs, or the policy's
    own recomputed before the update), ``sample_log_probs`` [N, L] (the engine's, for the KL to the
    sampling policy), and ``ref_log_probs`` [N, L] when ``kl_to_ref_coeff > 0``.
    Returns ``loss_objective``, ``loss_kl_to_ref``, ``loss_kl_to_inference``, ``loss_entropy`` (their sum
    is what to minimise) and detached diagnostics.
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
    ):
        super().__init__()
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {aggregation!r} not in {AGGREGATIONS}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {kl_estimator!r} not in {KL_ESTIMATORS}")
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

    def _mean(self, values, mask):
        return aggregate(values, mask, self.aggregation, self.aggregation_constant)

    def forward(self, batch: TensorDictBase) -> TensorDict:
        mask = batch["completion_mask"]
        logp, entropy = token_log_probs(
            self.policy, batch["tokens"], batch["attention_mask"], self.temperature, with_entropy=True,
            start=first_completion_column(mask), entropy_grad=self.entropy_coeff > 0,
        )
        surrogate, ratio, clipped_low, clipped_high = clipped_surrogate(
            logp, batch["old_log_probs"].float(), batch["advantage"].float(), self.clip_epsilon_low,
            self.clip_epsilon_high,
        )
        kl_inference = kl_estimate(logp, batch["sample_log_probs"].float(), self.kl_estimator)
        out = {
            "loss_objective": self._mean(surrogate, mask),
            "loss_kl_to_inference": self.kl_to_inference_coeff * self._mean(kl_inference, mask),
            "loss_entropy": -self.entropy_coeff * self._mean(entropy, mask),
        }
        if self.kl_to_ref_coeff > 0:
            kl_ref = kl_estimate(logp, batch["ref_log_probs"].float(), self.kl_estimator)
            out["loss_kl_to_ref"] = self.kl_to_ref_coeff * self._mean(kl_ref, mask)
            out["kl_to_ref"] = self._mean(kl_ref, mask).detach()
        else:
            out["loss_kl_to_ref"] = torch.zeros((), device=logp.device)
        out.update(self._diagnostics(mask, ratio.detach(), clipped_low, clipped_high, entropy, kl_inference))
        return TensorDict(out, batch_size=[])

    def _diagnostics(self, mask, ratio, clipped_low, clipped_high, entropy, kl_inference):
        """Token-mean statistics (over completion tokens) that tell whether the update is healthy."""
        tokens = mask.sum().clamp(min=1)
        w = ratio[mask]
        ess = w.sum().pow(2) / (w.numel() * w.pow(2).sum()).clamp(min=1e-12) if w.numel() else ratio.new_ones(())
        return {
            "clip_fraction_low": (clipped_low & mask).sum() / tokens,
            "clip_fraction_high": (clipped_high & mask).sum() / tokens,
            "ratio_mean": w.mean() if w.numel() else ratio.new_ones(()),
            "ratio_max": w.max() if w.numel() else ratio.new_ones(()),
            "ess": ess,
            "entropy": aggregate(entropy.detach(), mask, "token_mean"),
            "kl_to_inference": aggregate(kl_inference.detach(), mask, "token_mean"),
        }


def total_loss(losses: TensorDictBase) -> torch.Tensor:
    """Sum of the ``loss_*`` entries only (TensorDict's own mean/sum would mix in the diagnostics)."""
    return sum(value for key, value in losses.items() if key.startswith("loss_"))
