"""The actor-critic's terms (``loss=ppo``, ``loss.advantage=gae``): per-token rewards, TorchRL's generalized advantage
estimate over the completion tokens, the clipped value loss and the critic's explained variance.

The time axis is a completion's own tokens (``completion_mask``): prompt and padding positions are no steps, and in a
multi-turn episode the tokens the environment wrote between turns are skipped, so the last token of one turn is
followed by the first of the next. A state is the text before a token; its value is read where the policy reads
that token's log-prob (:func:`token_values`).
"""
from __future__ import annotations

import torch
from torchrl.objectives.value.functional import generalized_advantage_estimate

from torchrl_grpo.objective.log_probs import packed_inputs


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """[N, L] bool: each row's last token where ``mask`` is set (none in a row without one)."""
    position = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, position, torch.full_like(position, -1)).max(-1, keepdim=True).values
    return mask & (position == last)


def token_rewards(reward: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coeff: float = 0.0) -> torch.Tensor:
    """``r_t = R [t = T] - beta kl_t`` over the completion tokens [N, L]: the episode's reward ``R`` [N] at its last
    token, and with ``kl`` [N, L] (``logp_sample - logp_ref``) a KL penalty on every token (0 elsewhere)."""
    rewards = torch.where(last_token(mask), reward.to(torch.float64).unsqueeze(-1), 0.0)
    if kl is not None and kl_coeff > 0:
        rewards = rewards - kl_coeff * torch.where(mask, kl.to(torch.float64), 0.0)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lmbda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's ``mask`` tokens, in float64:

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` after the last token is 0: the episode ends),
    ``A_t = sum_k (gamma lmbda)^k delta_{t+k}``, the return ``R_t = A_t + V_t``.

    TorchRL's ``generalized_advantage_estimate`` runs on the tokens packed to the left of each row (the steps of a
    row are then contiguous, ended by ``done`` at the last one), and the results go back to their positions; 0
    outside ``mask``. Returns ``(advantages, returns)`` [N, L]."""
    n, width = mask.shape
    steps = int(mask.sum(-1).max()) if n else 0
    # each row's mask positions first, in order (a stable sort of ~mask), then the rest
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[:, :steps]
    valid = mask.gather(1, order)
    packed_values = torch.where(valid, values.to(torch.float64).gather(1, order), 0.0)
    packed_rewards = torch.where(valid, rewards.to(torch.float64).gather(1, order), 0.0)
    next_values = torch.cat([packed_values[:, 1:], packed_values.new_zeros(n, 1)], 1)
    done = last_token(valid) | ~valid  # a padding step ends too: nothing flows back from it
    advantage, _ = generalized_advantage_estimate(
        gamma, lmbda, packed_values.unsqueeze(-1), next_values.unsqueeze(-1),
        packed_rewards.unsqueeze(-1), done.unsqueeze(-1), done.unsqueeze(-1))
    advantage = torch.where(valid, advantage.squeeze(-1), 0.0)
    advantages = torch.zeros(n, width, dtype=torch.float64, device=mask.device).scatter(1, order, advantage)
    returns = torch.where(mask, advantages + values.to(torch.float64), 0.0)
    return advantages, returns


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the ``mask`` tokens of the whole batch (the unbiased std), 0 elsewhere: PPO's
    advantage normalisation. Fewer than two tokens: centred only."""
    picked = values[mask]
    if picked.numel() < 2:
        return torch.where(mask, values - (picked.mean() if picked.numel() else 0.0), 0.0)
    return torch.where(mask, (values - picked.mean()) / (picked.std() + eps), 0.0)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token [N, L]: ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, or
    ``0.5 (V - R)^2`` with ``clip`` None. Returns ``(loss, clipped)``: ``clipped`` marks where the clipped branch
    is the larger one (its gradient is then 0)."""
    values = values.float()
    old_values, returns = old_values.to(values.dtype), returns.to(values.dtype)
    unclipped = (values - returns).pow(2)
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    moved = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (moved - returns).pow(2)
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the ``mask`` tokens: 1 when the critic predicts every return, 0 when it does
    no better than their mean, negative when worse. NaN when the returns do not vary."""
    r, v = returns[mask].double(), values[mask].double()
    if r.numel() < 2:
        return float("nan")
    var = r.var()
    return float("nan") if var == 0 else float(1.0 - (r - v).var() / var)


def token_values(critic: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor,
                 wanted: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """The critic's value of the state before each ``wanted`` token [N, L] (0 elsewhere): the value head of
    ``critic`` (a transformers ``...ForTokenClassification`` with one label) at position ``t - 1``, where the policy
    reads the log-prob of token ``t``. ``packed``: the rows read end to end without their padding
    (:func:`~torchrl_grpo.objective.log_probs.packed_inputs`), the same values."""
    wanted = torch.cat([torch.zeros_like(wanted[:, :1]), wanted[:, 1:]], 1).to(tokens.device, torch.bool)
    if packed:
        inputs, before = packed_inputs(tokens, attention_mask.bool(), wanted)
        scores = critic(**inputs).logits[0, :, 0].float()
        picked = scores[before.to(scores.device)].to(tokens.device)
        return torch.zeros(tokens.shape, dtype=picked.dtype, device=tokens.device).masked_scatter(wanted, picked)
    scores = critic(input_ids=tokens, attention_mask=attention_mask.long()).logits[..., 0].float()
    shifted = torch.cat([scores.new_zeros(scores.shape[0], 1), scores[:, :-1]], 1)
    return torch.where(wanted.to(shifted.device), shifted, 0.0).to(tokens.device)
