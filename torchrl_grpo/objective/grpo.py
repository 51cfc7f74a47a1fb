"""The default objective, GRPO's, in one function that reads top to bottom: what :class:`GRPOLoss` computes with
the ``grpo`` preset. GRPOLoss assembles the same terms from the registries, where every variant of
``docs/objective.md`` is one choice; ``tests/objective/test_grpo_objective.py`` holds the two equal bit for bit."""
from __future__ import annotations

import torch


def grpo_objective(log_probs: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None,
                   advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2,
                   kl_coef: float = 0.0) -> torch.Tensor:
    """GRPO's loss to minimise (Shao et al., *DeepSeekMath*, arXiv 2402.03300), for ``N`` completions of ``L``
    tokens:

    ``loss = mean_i mean_t -min(w_it A_i, clip(w_it, 1 - eps, 1 + eps) A_i) + beta mean_i mean_t k3_it``

    ``w_it = exp(logp_it - logp_old_it)`` the token's ratio, ``k3_it = exp(-d_it) + d_it - 1`` with
    ``d_it = logp_it - logp_ref_it`` (the KL to the reference, unbiased and never negative); ``mean_t`` over a
    completion's tokens in ``mask``, then ``mean_i`` over the completions that have any.

    * ``log_probs`` [N, L]: the trained policy's log-prob of each token (differentiable), ``old_log_probs`` [N, L]
      the ratio's denominator, ``ref_log_probs`` [N, L] the reference's (read only when ``kl_coef > 0``): float32
      with zeros outside ``mask``, as GRPOLoss's forward makes them (an inf there would turn the gradient to NaN);
    * ``advantages`` [N]: one per completion (float32); ``mask`` [N, L] bool: the completion tokens of the loss;
    * ``clip_eps``: the clip range, ``kl_coef``: beta (``train.kl_to_ref_coeff``). Returns a scalar.
    """

    def mean_per_completion_then_batch(values: torch.Tensor) -> torch.Tensor:  # [N, L] -> []
        tokens = mask.sum(-1)                                                       # |y_i|  [N]
        present = tokens > 0                                                        # completions with tokens
        per_completion = torch.where(mask, values, 0.0).sum(-1)[present] / tokens[present]
        return per_completion.sum() / present.sum().clamp(min=1)

    ratio = torch.exp(log_probs - old_log_probs)                                    # w_it  [N, L]
    adv = advantages.unsqueeze(-1)                                                  # A_i   [N, 1]
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    loss = mean_per_completion_then_batch(surrogate)
    if kl_coef > 0:
        d = log_probs - ref_log_probs
        k3 = torch.expm1(-d) + d                                                    # exp(-d) + d - 1, exact near 0
        loss = loss + kl_coef * mean_per_completion_then_batch(k3)
    return loss
