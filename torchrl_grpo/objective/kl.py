"""KL estimators (``loss.kl_estimator``): Schulman's k1, k2, k3 of KL(pi_theta || pi_other) per token, on
``d = logp - logp_other``, for the KL to the reference and to the sampling policy."""
from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from torchrl_grpo.objective.aggregation import wide
from torchrl_grpo.objective.registry import REGISTRIES, register, term


@register("kl_estimator", "k1")
def kl_k1(d: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``k1 = d``: unbiased, but negative on some samples."""
    return d


@register("kl_estimator", "k2")
def kl_k2(d: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``k2 = d^2 / 2``: never negative, biased, low variance."""
    return 0.5 * d.pow(2)


@register("kl_estimator", "k3")
def kl_k3(d: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``k3 = exp(-d) + d - 1``: unbiased and never negative (computed as ``expm1(-d) + d``)."""
    return torch.expm1(-d) + d


def kl_estimate(logp: Float[Tensor, "*shape"], logp_other: Float[Tensor, "*shape"], estimator: str = "k3"
                ) -> Float[Tensor, "*shape"]:
    """Per-token estimate of KL(pi_theta || pi_other) from samples of pi_theta (Schulman's k1/k2/k3) on
    ``d = logp - logp_other``, elementwise (the loss's are [N, L])."""
    d = wide(logp) - wide(logp_other)
    return term("kl_estimator", estimator)(d)


KL_ESTIMATORS = tuple(REGISTRIES["kl_estimator"])
