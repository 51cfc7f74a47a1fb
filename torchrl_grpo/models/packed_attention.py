"""Attention for rows packed end to end (``train.micro_batch_tokens``), each row attending over its own keys only.

transformers keeps packed rows apart with a block mask over the whole packed sequence: with ``sdpa`` that attends over
its full square (1,024 squared for a 1,024-token micro-batch) where padded rows take each row's own square, and the
masked path is slower than the causal kernel. :func:`packed_rows` runs each row's own causal attention instead (the
rows are where the position ids start again): on a GPU in half precision one flash-attention varlen call over all the
rows (:func:`varlen_rows`, torch's ``varlen_attn``); elsewhere the causal ``sdpa`` kernel once per row
(:func:`sdpa_by_row`). The same values as the block mask, each row's own cost. Any other call (padded rows,
generation with a KV cache, a sliding window) is plain ``sdpa`` with transformers' mask.
"""
from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

try:
    from torch.nn.attention.varlen import varlen_attn as VARLEN
except ImportError:  # torch before 2.10
    VARLEN = None
# its releases differ: 2.10 takes is_causal, later ones window_size and scale, and enable_gqa from after 2.11
VARLEN_PARAMS = inspect.signature(VARLEN).parameters if VARLEN is not None else {}

NAME = "packed_rows"
# the last position ids seen and their rows' bounds, one tuple swapped whole (a generating thread may call too): every
# layer of a forward reads the same position ids
_last_bounds: tuple = (None, None)


def row_bounds(positions: torch.Tensor) -> list[int] | None:
    """Where each packed row starts, and the total length, from ``positions`` ([1, T], restarting at 0 at each row);
    None unless they describe two or more rows. One host sync per forward: the layers share the tensor."""
    global _last_bounds
    seen, bounds = _last_bounds
    if seen is positions:
        return bounds
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    bounds = [*starts, positions.shape[1]] if len(starts) >= 2 and starts[0] == 0 else None
    _last_bounds = (positions, bounds)
    return bounds


def packed_rows(module, query, key, value, attention_mask, **kwargs):
    """The attention interface of packed rows: :func:`varlen_rows` or :func:`sdpa_by_row`, plain ``sdpa`` for
    anything that is not one sequence of packed rows."""
    positions = kwargs.get("position_ids")
    bounds = None
    if (positions is not None and query.shape[0] == 1 and key.shape[2] == query.shape[2]
            and not kwargs.get("sliding_window") and not kwargs.get("dropout")):
        bounds = row_bounds(positions)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if varlen_fits(query, kwargs.get("scaling")):
        return varlen_rows(query, key, value, bounds, kwargs.get("scaling")), None
    return sdpa_by_row(module, query, key, value, bounds, **kwargs), None


def sdpa_by_row(module, query, key, value, bounds: list[int], **kwargs) -> torch.Tensor:
    """The causal ``sdpa`` kernel on each row's own queries, keys and values ([1, heads, T, dim]; rows between
    ``bounds``), as [1, T, heads, dim]."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    # split, not a slice per row: a slice's backward writes a zero tensor the size of the whole micro-batch for each
    # row (rows x tokens of memory traffic, which made packed steps 3x slower than padded ones on a GPU)
    rows = [sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]
            for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))]
    return torch.cat(rows, dim=1)


def varlen_fits(query: torch.Tensor, scaling: float | None) -> bool:
    """Whether torch's flash-attention varlen kernel takes this call: a CUDA tensor in half precision, a head size
    it has kernels for, and a scale it can be given (the releases without a ``scale`` argument use 1/sqrt(dim))."""
    if VARLEN is None or not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    dim = query.shape[-1]
    default_scale = scaling is None or abs(scaling - dim ** -0.5) < 1e-6 * dim ** -0.5
    return dim <= 256 and dim % 8 == 0 and ("scale" in VARLEN_PARAMS or default_scale)


def varlen_rows(query, key, value, bounds: list[int], scaling: float | None) -> torch.Tensor:
    """One varlen flash-attention call over all packed rows ([1, heads, T, dim] each; rows between ``bounds``),
    causal within each row, as [1, T, heads, dim]. Key/value heads shared by several query heads (GQA) are handed
    over as they are where the release takes ``enable_gqa``, repeated otherwise."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, dim]
    options = {}
    if "window_size" in VARLEN_PARAMS:  # newer releases: (-1, 0) is causal
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if scaling is not None and "scale" in VARLEN_PARAMS:
        options["scale"] = scaling
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in VARLEN_PARAMS:
            options["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cumulative = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return VARLEN(q, k, v, cumulative, cumulative, longest, longest, **options).unsqueeze(0)


AttentionInterface.register(NAME, packed_rows)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks of sdpa, for every call that is not packed rows


def attend_by_row(model: torch.nn.Module) -> None:
    """``model`` (PEFT-wrapped or not) takes :func:`packed_rows` where it takes ``sdpa``; flash-attention reads the
    rows from the position ids itself (varlen) and is left as it is, so is eager attention (its block mask)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) == "sdpa":
        base.set_attn_implementation(NAME)
