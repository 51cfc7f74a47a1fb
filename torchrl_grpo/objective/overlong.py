"""Overlong handling (``loss.overlong``): which completion tokens enter the loss, and DAPO's soft penalty on a
completion's reward for its length."""
from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Real, Shaped
from torch import Tensor

from torchrl_grpo.objective.registry import REGISTRIES, register, term


@register("overlong", "none")
def all_completion_tokens(completion_mask: Bool[Tensor, "N L"], truncated: Shaped[Tensor, " N"] | None
                          ) -> Bool[Tensor, "N L"]:
    """``M_it = c_it``: every completion token. Also ``soft``, whose penalty acts on the reward
    (:func:`overlong_penalty`, added by the loop before the advantages), not on the mask."""
    return completion_mask


@register("overlong", "mask")
def drop_truncated(completion_mask: Bool[Tensor, "N L"], truncated: Shaped[Tensor, " N"] | None
                   ) -> Bool[Tensor, "N L"]:
    """``M_it = c_it (1 - trunc_i)``, DAPO's overlong filtering: a cut-off answer (``finish_reason == length``)
    is neither rewarded nor punished; its row then counts as an empty completion everywhere, accumulation
    weights included."""
    if truncated is None:
        raise KeyError("overlong='mask' needs the batch's 'truncated' [N] (finish_reason == length)")
    return completion_mask & ~truncated.to(completion_mask.device).bool().unsqueeze(-1)


register("overlong", "soft")(all_completion_tokens)


def loss_token_mask(completion_mask: Bool[Tensor, "N L"], truncated: Shaped[Tensor, " N"] | None,
                    overlong: str = "none") -> Bool[Tensor, "N L"]:
    """The tokens that enter the loss [N, L]: the ``overlong`` term applied to the completion mask."""
    return term("overlong", overlong)(completion_mask, truncated)


def overlong_buffer_tokens(buffer: int | None, max_tokens: int) -> int:
    """The soft-overlong buffer in tokens: ``buffer`` when given, else ``max(1, max_tokens // 5)`` (DAPO's
    proportion: a 4096-token buffer for a 20480-token budget)."""
    return int(buffer) if buffer is not None else max(1, int(max_tokens) // 5)


def overlong_penalty(lengths: Real[Tensor, " N"], max_tokens: int, buffer: int | None = None) -> Float[Tensor, " N"]:
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


OVERLONG = tuple(REGISTRIES["overlong"])
