"""Mixed precision without a second copy of the weights in the autograd graph.

Under bf16 autocast every linear layer multiplies with a bf16 cast of its float32 weight, and autograd keeps that
cast (or a transposed view of it) until the backward has used it: through a micro-batch's forward and backward the
graph holds a bf16 copy of every trained weight (0.25 GiB for SmolLM2-135M, 14 GiB for a 7B model), on top of the
activations. :func:`weights_recast_in_backward` keeps a reference to the parameter instead and casts it again
when the backward needs it: the same operation on the same, unchanged float32 values (the optimizer steps after
the backward), so the gradients are the same bit for bit, for one more cast per weight per micro-batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class _Recast(NamedTuple):
    """What the graph keeps of a saved weight cast: the parameter, the dtype, and the view of the cast saved."""
    param: torch.nn.Parameter
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def pack_saved(saved: torch.Tensor):
    """A saved tensor as the graph keeps it: a cast of a trained parameter (or a view of one) as a reference."""
    base = saved._base if saved._is_view() else saved
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return saved
    source = getattr(node.next_functions[0][0], "variable", None)  # AccumulateGrad of a leaf
    if (not isinstance(source, torch.nn.Parameter) or source.shape != base.shape or source.device != base.device
            or not (source.is_contiguous() and base.is_contiguous())):
        return saved
    return _Recast(source, base.dtype, saved.size(), saved.stride(), saved.storage_offset())


def unpack_saved(packed):
    """What the backward reads: a packed cast made again from its parameter."""
    if isinstance(packed, _Recast):
        return packed.param.detach().to(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)
    return packed


def weights_recast_in_backward():
    """Within this block, casts of trained parameters saved for the backward are re-made there, not kept."""
    return torch.autograd.graph.saved_tensors_hooks(pack_saved, unpack_saved)

