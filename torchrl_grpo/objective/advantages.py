"""Reward scales (``loss.reward_scale``): a group's centred rewards -> the advantages, and the group advantages
the trainer computes with the one the config names."""
from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from torchrl_grpo.objective.registry import REGISTRIES, register, term


@register("reward_scale", "group")
def group_std(grouped: Float[Tensor, "P G"], centred: Float[Tensor, "P G"], eps: float) -> Float[Tensor, "P G"]:
    """``A_i = (r_i - mean_g r) / (std_g r + eps)``, the group's unbiased std (GRPO); a group of one has std 0."""
    std = grouped.std(dim=1, keepdim=True) if grouped.shape[1] > 1 else torch.zeros_like(centred[:, :1])
    return centred / (std + eps)


@register("reward_scale", "batch")
def batch_std(grouped: Float[Tensor, "P G"], centred: Float[Tensor, "P G"], eps: float) -> Float[Tensor, "P G"]:
    """``A_i = (r_i - mean_g r) / (std_batch r + eps)``, the unbiased std of every reward of the batch."""
    std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())
    return centred / (std + eps)


@register("reward_scale", "none")
def centred_only(grouped: Float[Tensor, "P G"], centred: Float[Tensor, "P G"], eps: float) -> Float[Tensor, "P G"]:
    """``A_i = r_i - mean_g r``: no std scaling (Dr.GRPO), so no weight on nearly-always or nearly-never solved
    prompts."""
    return centred


@register("reward_scale", "rloo")
def leave_one_out(grouped: Float[Tensor, "P G"], centred: Float[Tensor, "P G"], eps: float) -> Float[Tensor, "P G"]:
    """``A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_g r)`` (RLOO, Ahmadian et al. 2024): each
    completion's baseline is the mean of the others, so its own reward does not lower its advantage; no std
    scaling. A group of one has no other completion: 0."""
    size = grouped.shape[1]
    return centred * (size / (size - 1)) if size > 1 else torch.zeros_like(centred)


@register("reward_scale", "reinforce_pp")
def batch_whitened(grouped: Float[Tensor, "P G"], centred: Float[Tensor, "P G"], eps: float
                   ) -> Float[Tensor, "P G"]:
    """``A_i = (r_i - mean_batch r) / (std_batch r + eps)`` (REINFORCE++, Hu 2025, arXiv 2501.03262): no group
    baseline, one global one, so a group whose rewards tie still learns from how it compares with the batch;
    a batch whose rewards all tie gives 0."""
    flat = grouped.reshape(-1)
    if flat.numel() < 2 or bool((flat == flat[0]).all()):
        return torch.zeros_like(grouped)
    return (grouped - flat.mean()) / (flat.std() + eps)


@register("reward_scale", "reinforce_pp_baseline")
def group_centred_batch_whitened(grouped: Float[Tensor, "P G"], centred: Float[Tensor, "P G"], eps: float
                                 ) -> Float[Tensor, "P G"]:
    """``c_i = r_i - mean_g r``, ``A_i = (c_i - mean_batch c) / (std_batch c + eps) = c_i / (std_batch c + eps)``
    (REINFORCE++-baseline, for several completions per prompt): the group's mean as the baseline, the batch's
    spread of the centred rewards as the scale (``batch`` divides by the raw rewards' spread instead)."""
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    return centred / (std + eps)


# reward scales whose baseline is not the group's: a tied group's advantage is not forced to 0
GROUP_FREE_SCALES = ("reinforce_pp",)


def group_advantages(rewards: Float[Tensor, " N"], group_size: int, scale: str = "group", eps: float = 1e-6
                     ) -> tuple[Float[Tensor, " N"], Bool[Tensor, " N"]]:
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


REWARD_SCALES = tuple(REGISTRIES["reward_scale"])
