"""The GRPO objective as one TorchRL ``LossModule``: the policy forward pass, and the registered terms of
each family's module (:mod:`torchrl_grpo.objective.registry`) put together as the ``loss:`` config section selects them.

:class:`GRPOLoss` knows no variant by name: it looks up ``loss.aggregation``, ``loss.kl_estimator``,
``loss.importance_level`` and ``loss.overlong`` in their registries and applies every surrogate modifier
whose key is set, so a new variant is a registered function, a preset line and a row of
``docs/objective.md``. :meth:`GRPOLoss.forward` is the loss that runs: read it top to bottom for the default
(the ``grpo`` preset), each step's term named where it is looked up.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Float32
from tensordict import TensorDict, TensorDictBase
from torch import Tensor
from torchrl.objectives import LossModule

from torchrl_grpo.core.batch import Batch
from torchrl_grpo.objective.aggregation import accumulation_weight, aggregate, per_token
from torchrl_grpo.objective.kl import KL_ESTIMATORS, kl_estimate
from torchrl_grpo.objective.log_probs import token_log_probs
from torchrl_grpo.objective.modifiers import SURROGATE_MODIFIERS
from torchrl_grpo.objective.overlong import loss_token_mask
from torchrl_grpo.objective.registry import MODIFIER_FLOORS, term
from torchrl_grpo.objective.rules import combination_problem
from torchrl_grpo.objective.surrogates import SurrogateInputs, token_advantages

# the registered families that GRPOLoss takes by the name of their config key (loss.<family>)
LOSS_CHOICES = ("aggregation", "kl_estimator", "importance_level", "overlong")


# the loss's diagnostics that are a maximum over the step's micro-batches (the others are means)
MAX_METRICS = ("ratio_max", "engine_trainer_logp_gap_max")


def _inside(values: Float[Tensor, "N L"], mask: Bool[Tensor, "N L"]) -> Float32[Tensor, "N L"]:
    """``values`` as float32 with 0 outside ``mask``: whatever a batch holds in prompt or padding positions
    can then never reach an exp (an inf there would make a NaN even multiplied by zero)."""
    return torch.where(mask, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))


@dataclass(frozen=True)
class LossRows:
    """What the loss says of a step's rows (:meth:`GRPOLoss.rows`), so that the trainer plans its micro-batches and
    weighs them from one answer."""

    mask: Bool[Tensor, "N L"]  # the tokens that enter the loss (:func:`loss_token_mask`)
    signal: Bool[Tensor, " N"]  # the rows the reward teaches from, a nonzero advantage on one of their loss tokens
    # the rows whose loss can move the weights: ``signal``, or with a regulariser (KL, entropy) acting on every loss
    # token every row with one; every other row's loss is exactly 0 whatever the weights, and its gradient
    moving: Bool[Tensor, " N"]
    aggregation: str  # loss.aggregation, which says how much a set of rows counts in an optimizer step

    def weight(self, rows: torch.Tensor | None = None) -> float:
        """The accumulation weight of ``rows`` (batch indices; None: all) under the loss's aggregation
        (:func:`accumulation_weight`, on their loss mask: completions dropped by ``overlong="mask"`` do not count)."""
        return accumulation_weight(self.aggregation, self.mask if rows is None else self.mask[rows])


class GRPOLoss(LossModule):
    """The GRPO objective family as one TorchRL loss: the importance-level term (token or sequence clip, CISPO,
    SAPO's gate, GMPO's geometric mean), the surrogate modifiers (truncated or masked importance sampling,
    off-policy masking), KL to the reference and to the
    sampling policy, and an entropy bonus.

    Reads from the batch: ``tokens``, ``attention_mask``, ``completion_mask`` [N, L], ``advantage`` [N] (or [N, L]
    from a critic: ``loss.advantage=gae``),
    ``old_log_probs`` [N, L] (the ratio's denominator: the engine's sampling log-probs, or the policy's
    own recomputed before the update), ``sample_log_probs`` [N, L] (the engine's: KL to the sampling
    policy, TIS, MIS, off-policy mask), ``ref_log_probs`` [N, L] when ``kl_to_ref_coeff > 0`` (and for the
    ``kl_k*`` diagnostics whenever present), ``truncated`` [N] when ``overlong="mask"``.

    Returns ``loss_objective``, ``loss_kl_to_inference``, ``loss_entropy``, ``loss_kl_to_ref`` (their sum
    is what to minimise) and detached diagnostics: ``clip_fraction_low/high``, ``ratio_mean/max``, ``ess``
    (over completion tokens; over completions at the sequence level), ``entropy``, ``kl_to_inference``,
    ``kl_inference_k1/k2/k3`` and, with reference log-probs, ``kl_k1/k2/k3`` (token means), ``kl_to_ref``
    (aggregated like the loss, when in the loss), and each surrogate modifier's own
    (``tis_truncated_fraction``, ``mis_masked_fraction``, ``off_policy_masked_fraction``, ...).

    ``modifiers`` are the surrogate modifiers by key (``tis_cap=2``): each is on with a parameter above its
    floor (:data:`MODIFIER_FLOORS`), off with ``None``; ``tau_pos`` / ``tau_neg`` are SAPO's gate temperatures.
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
        overlong: str = "none",
        tau_pos: float = 1.0,
        tau_neg: float = 1.05,
        packed: bool = False,
        chunk_bytes: int | None = None,
        **modifiers: float | None,
    ):
        super().__init__()
        unknown = sorted(set(modifiers) - set(SURROGATE_MODIFIERS))
        if unknown:
            raise TypeError(f"GRPOLoss got unknown options {unknown}; surrogate modifiers: {SURROGATE_MODIFIERS}")
        for family, name in zip(LOSS_CHOICES, (aggregation, kl_estimator, importance_level, overlong)):
            term(family, name)
        for key in SURROGATE_MODIFIERS:
            value = modifiers.get(key)
            if value is not None and not value > MODIFIER_FLOORS[key]:
                raise ValueError(f"{key}={value!r} must be > {MODIFIER_FLOORS[key]:g} (or None)")
        problem = combination_problem({"aggregation": aggregation, "importance_level": importance_level, **modifiers})
        if problem:
            raise ValueError(problem)
        if not (tau_pos > 0 and tau_neg > 0):
            raise ValueError(f"tau_pos={tau_pos!r} and tau_neg={tau_neg!r} must be > 0")
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
        self.overlong = overlong
        self.tau_pos, self.tau_neg = tau_pos, tau_neg
        self.packed = packed  # the policy reads each micro-batch's rows packed end to end (train.micro_batch_tokens)
        self.chunk_bytes = chunk_bytes  # the log-probs' chunk (train.log_prob_chunk_mib; None: the device's default)
        # in registry order, which fixes the order of their float operations
        self.modifiers = {key: modifiers[key] for key in SURROGATE_MODIFIERS if modifiers.get(key) is not None}

    @classmethod
    def from_config(cls, policy: torch.nn.Module, loss_cfg: Mapping, *, max_tokens: int, temperature: float,
                    kl_to_ref_coeff: float, kl_to_inference_coeff: float, entropy_coeff: float,
                    packed: bool = False, chunk_bytes: int | None = None) -> "GRPOLoss":
        """The loss a ``loss:`` config section describes: the clip range, each family of
        :data:`LOSS_CHOICES` and each surrogate modifier by its key, which every preset sets. The section's
        other keys (``reward_scale``, ``old_log_probs``, ``overlong_buffer``, dynamic sampling) are the loop's.
        ``max_tokens`` is the ``constant_sum`` constant; the rest are the ``train.*`` / sampling values."""
        modifiers = {key: None if loss_cfg[key] is None else float(loss_cfg[key]) for key in SURROGATE_MODIFIERS}
        return cls(
            policy,
            clip_epsilon_low=float(loss_cfg["clip_epsilon_low"]),
            clip_epsilon_high=float(loss_cfg["clip_epsilon_high"]),
            aggregation_constant=float(max_tokens),
            kl_to_ref_coeff=float(kl_to_ref_coeff),
            kl_to_inference_coeff=float(kl_to_inference_coeff),
            entropy_coeff=float(entropy_coeff),
            temperature=float(temperature),
            tau_pos=float(loss_cfg["tau_pos"]),
            tau_neg=float(loss_cfg["tau_neg"]),
            packed=packed,
            chunk_bytes=chunk_bytes,
            **{family: loss_cfg[family] for family in LOSS_CHOICES},
            **modifiers,
        )

    def _mean(self, values, mask):
        return aggregate(values, mask, self.aggregation, self.aggregation_constant)

    def token_mask(self, batch: TensorDictBase) -> Bool[Tensor, "N L"]:
        """The tokens that enter the loss: see :func:`loss_token_mask`."""
        truncated = batch[Batch.TRUNCATED] if Batch.TRUNCATED in batch.keys() else None
        return loss_token_mask(batch[Batch.COMPLETION_MASK], truncated, self.overlong)

    def rows(self, batch: TensorDictBase) -> "LossRows":
        """What this loss says of a prepared batch's rows (:class:`LossRows`), asked once per step."""
        mask = self.token_mask(batch)
        signal = (mask & (token_advantages(batch[Batch.ADVANTAGE]) != 0)).any(-1)
        regularised = self.kl_to_ref_coeff > 0 or self.kl_to_inference_coeff > 0 or self.entropy_coeff > 0
        return LossRows(mask, signal, mask.any(-1) if regularised else signal, self.aggregation)

    def forward(self, batch: TensorDictBase) -> TensorDict:
        """The loss of a micro-batch of ``N`` rows of ``L`` tokens. With the ``grpo`` preset (Shao et al.,
        *DeepSeekMath*, arXiv 2402.03300) it is

        ``loss = mean_i mean_t -min(w_it A_i, clip(w_it, 1 - eps, 1 + eps) A_i) + beta mean_i mean_t k3_it``

        ``w_it = exp(logp_it - logp_old_it)`` the token's ratio, ``k3_it = exp(-d_it) + d_it - 1`` with
        ``d_it = logp_it - logp_ref_it`` (the KL to the reference, unbiased and never negative), ``beta`` the
        ``kl_to_ref_coeff``; ``mean_t`` over a completion's loss tokens, then ``mean_i`` over the completions that
        have any (``sequence_mean``). Each other preset swaps one of the terms looked up below."""
        completion = batch[Batch.COMPLETION_MASK]  # [N, L] bool: the sampled tokens
        mask = self.token_mask(batch)  # [N, L] bool: those of the loss (all of them unless loss.overlong=mask)
        # logp_it [N, L], differentiable, and the entropy of each position; computed at the completion tokens only
        logp, entropy = token_log_probs(
            self.policy, batch[Batch.TOKENS], batch[Batch.ATTENTION_MASK], self.temperature, with_entropy=True,
            wanted=completion, entropy_grad=self.entropy_coeff > 0, packed=self.packed,
            chunk_bytes=self.chunk_bytes,
        )
        logp = _inside(logp, completion)  # float32, 0 outside the completions
        sample = _inside(batch[Batch.SAMPLE_LOG_PROBS], completion)  # logp_sample_it [N, L]: the engine's
        # logp_old_it [N, L], the ratio's denominator; no old log-probs in the batch: this forward's own are the
        # policy's before its update (Trainer.prepare)
        own_old = Batch.OLD_LOG_PROBS not in batch.keys()
        inputs = SurrogateInputs(
            logp=logp, logp_old=logp.detach() if own_old else _inside(batch[Batch.OLD_LOG_PROBS], completion),
            logp_sample=sample,
            advantages=batch[Batch.ADVANTAGE].to(logp.dtype), mask=mask, importance_level=self.importance_level,
            eps_low=self.clip_epsilon_low, eps_high=self.clip_epsilon_high, tau_pos=self.tau_pos, tau_neg=self.tau_neg,
        )
        # the importance-level term; GRPO's ("token"): surrogates.token_ratio -> clipped_surrogate, per token
        # l_it = -min(w_it A_i, clip(w_it, 1 - eps_low, 1 + eps_high) A_i), and the ratio w_it, all [N, L]
        loss, ratio, clipped_low, clipped_high = term("importance_level", self.importance_level)(inputs)
        surrogate = per_token(loss, mask)  # [N, L]: a per-completion loss [N] (GSPO, GMPO) over its tokens
        # the surrogate modifiers that are on (none in grpo), in registry order: detached weights or masks on l_it
        extra = {}
        for key, parameter in self.modifiers.items():
            surrogate, diagnostics = term("surrogate_modifier", key)(surrogate, parameter, inputs)
            extra.update(diagnostics)

        kl_inference = kl_estimate(logp, sample, self.kl_estimator)  # [N, L]: KL to the sampling policy
        out = {
            # the aggregation (grpo: sequence_mean, mean_i mean_t) of each per-token term, to a scalar
            "loss_objective": self._mean(surrogate, mask),
            "loss_kl_to_inference": self.kl_to_inference_coeff * self._mean(kl_inference, mask),
            "loss_entropy": -self.entropy_coeff * self._mean(entropy, mask),
        }
        ref = _inside(batch[Batch.REF_LOG_PROBS], completion) if Batch.REF_LOG_PROBS in batch.keys() else None
        if self.kl_to_ref_coeff > 0:  # beta mean_i mean_t k_it, k the kl_estimator (grpo: k3) on logp - logp_ref
            kl_ref = kl_estimate(logp, ref, self.kl_estimator)
            out["loss_kl_to_ref"] = self.kl_to_ref_coeff * self._mean(kl_ref, mask)
            out["kl_to_ref"] = self._mean(kl_ref, mask).detach()
        else:
            out["loss_kl_to_ref"] = torch.zeros((), device=logp.device)
        # detached diagnostics: the ratio and clip statistics, entropy, the KL estimates, each modifier's own
        out.update(self._diagnostics(mask, ratio.detach(), clipped_low, clipped_high, entropy, kl_inference,
                                     logp.detach(), sample, ref))
        out.update(extra)
        if own_old:  # the trainer's log-probs against the engine's, as Trainer.prepare reports them otherwise
            out["engine_trainer_logp_gap_max"] = (logp.detach() - sample).abs().max()
        return TensorDict(out, batch_size=[])

    def _diagnostics(self, mask, ratio, clipped_low, clipped_high, entropy, kl_inference, logp, sample, ref):
        """Statistics that tell whether the update is healthy: token means over completion tokens, except
        the ratio and clip statistics, each over its own unit (tokens, or completions when per completion)."""
        unit = mask.any(-1) if ratio.dim() == 1 else mask
        clip_unit = mask.any(-1) if clipped_low.dim() == 1 else mask
        w = ratio[unit]
        ess = w.sum().pow(2) / (w.numel() * w.pow(2).sum()).clamp(min=1e-12) if w.numel() else ratio.new_ones(())
        out = {
            "clip_fraction_low": (clipped_low & clip_unit).sum() / clip_unit.sum().clamp(min=1),
            "clip_fraction_high": (clipped_high & clip_unit).sum() / clip_unit.sum().clamp(min=1),
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
