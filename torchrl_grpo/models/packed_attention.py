"""Attention for rows packed end to end (``train.micro_batch_tokens``), one row at a time.

transformers keeps packed rows apart with a block mask over the whole packed sequence: with ``sdpa`` that attends over
its full square (1,024 squared for a 1,024-token micro-batch) where padded rows take each row's own square, and the
masked path is slower than the causal kernel. :func:`sdpa_by_row` runs the causal kernel on each row's own queries,
keys and values instead (the rows are where the position ids start again): the same values, each row's own cost.
Any other call (padded rows, generation with a KV cache) is plain ``sdpa``.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_by_row"


def sdpa_by_row(module, query, key, value, attention_mask, **kwargs):
    """``sdpa`` per packed row: a batch of one sequence whose ``position_ids`` start again at 0 at each row."""
    positions = kwargs.get("position_ids")
    if positions is None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    if len(starts) < 2 or starts[0] != 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = [*starts, query.shape[2]]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    # split, not a slice per row: a slice's backward writes a zero tensor the size of the whole micro-batch for each
    # row (rows x tokens of memory traffic, which made packed steps 3x slower than padded ones on a GPU)
    rows = [sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]
            for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))]
    return torch.cat(rows, dim=1), None


AttentionInterface.register(NAME, sdpa_by_row)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks of sdpa, for every call that is not packed rows


def attend_by_row(model: torch.nn.Module) -> None:
    """``model`` (PEFT-wrapped or not) takes :func:`sdpa_by_row` where it takes ``sdpa``; flash-attention reads the
    rows from the position ids itself (varlen) and is left as it is, so is eager attention (its block mask)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) == "sdpa":
        base.set_attn_implementation(NAME)
