"""Aggregations (``loss.aggregation``): per-token values [N, L] -> one scalar over the loss mask, and the
weight of a micro-batch's loss in an optimizer step; with the masked per-completion mean and the widening of
half precision that every term's sums share."""
from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from torchrl_grpo.objective.registry import ACCUMULATION_WEIGHTS, REGISTRIES, register, term


def wide(x: Shaped[Tensor, "*shape"]) -> Shaped[Tensor, "*shape"]:
    """Half-precision floats (bf16, fp16) as float32: their exps, sums and token counts lose too much.
    float32 and float64 are kept as they are."""
    return x.float() if x.is_floating_point() and x.element_size() < 4 else x


def per_token(values: Shaped[Tensor, " N"] | Shaped[Tensor, "N L"], mask: Bool[Tensor, "N L"]) -> Shaped[Tensor, "N L"]:
    """A value per completion [N] repeated over its tokens [N, L]; per-token values [N, L] as they are."""
    return values.unsqueeze(-1).expand_as(mask) if values.dim() == 1 else values


def completion_mean(values: Float[Tensor, "N L"], mask: Bool[Tensor, "N L"]) -> Float[Tensor, " N"]:
    """``mean_t values_it`` over each completion's tokens [N]; 0 for a completion without tokens. Values
    outside ``mask`` are never read (not even multiplied by zero: an inf there cannot turn into NaN)."""
    values = wide(values)
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(-1)
    return total / mask.sum(-1).clamp(min=1).to(values.dtype)


# Each registered aggregation gets the values with zeros outside the loss mask, the mask as 0/1 in the values'
# dtype, and the constant (inference_model.max_tokens).

@register("aggregation", "token_mean", weight=lambda mask: float(mask.sum()))
def token_mean(masked: Float[Tensor, "N L"], count: Float[Tensor, "N L"], constant: float) -> Float[Tensor, ""]:
    """``sum_{i,t} v_it / sum_i |y_i|``, one mean over every token of the batch (DAPO). Weight: tokens."""
    return masked.sum() / count.sum().clamp(min=1)


@register("aggregation", "sequence_mean", weight=lambda mask: float((mask.sum(-1) > 0).sum()))
def sequence_mean(masked: Float[Tensor, "N L"], count: Float[Tensor, "N L"], constant: float) -> Float[Tensor, ""]:
    """``(1/N') sum_i (1/|y_i|) sum_t v_it`` over the ``N'`` non-empty completions (GRPO paper); a completion
    without tokens is left out. Weight: non-empty completions."""
    counts = count.sum(-1)
    present = counts > 0
    per_seq = masked.sum(-1)[present] / counts[present]
    return per_seq.sum() / present.sum().clamp(min=1)


@register("aggregation", "constant_sum", weight=lambda mask: float(mask.shape[0]))
def constant_sum(masked: Float[Tensor, "N L"], count: Float[Tensor, "N L"], constant: float) -> Float[Tensor, ""]:
    """``sum_{i,t} v_it / (N * constant)`` (Dr.GRPO, constant = max tokens): no length bias. Weight: completions."""
    return masked.sum() / (masked.shape[0] * constant)


def aggregate(values: Float[Tensor, "N L"], mask: Bool[Tensor, "N L"], mode: str, constant: float = 1.0
              ) -> Float[Tensor, ""]:
    """Reduce per-token ``values`` [N, L] over the tokens where ``mask`` is set with the aggregation ``mode``.
    Computed in at least float32 (a bf16 token count is inexact beyond 256)."""
    reduce = term("aggregation", mode)
    values = wide(values)
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return reduce(masked, mask.to(values.dtype), constant)


def accumulation_weight(mode: str, mask: Bool[Tensor, "N L"]) -> float:
    """The accumulation weight of aggregation ``mode`` on a micro-batch's loss mask
    (:func:`~torchrl_grpo.objective.overlong.loss_token_mask`); the loop divides by the sum over the step's
    micro-batches."""
    term("aggregation", mode)  # an unknown mode: the ValueError that lists the choices
    return ACCUMULATION_WEIGHTS[mode](mask)


AGGREGATIONS = tuple(REGISTRIES["aggregation"])
