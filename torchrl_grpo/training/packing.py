"""Micro-batches by a token budget (``train.micro_batch_tokens``): the rows of an optimizer step packed end to end
into as few micro-batches as fit, each holding at most the budget's tokens on each data-parallel rank.

The update does not depend on how a step's rows are cut: each micro-batch's loss is weighted by its share of the
step's aggregation (:meth:`~torchrl_grpo.objective.loss.GRPOLoss.accumulation_weight`), so only the float rounding
of the sum changes. What changes is the work: no padding (the forward reads the rows packed, see
:func:`~torchrl_grpo.objective.log_probs.packed_inputs`), and micro-batches as full as the budget allows whatever
the rows' lengths, where a fixed number of rows is sized for the longest.
"""
from __future__ import annotations

import torch

from torchrl_grpo.core.errors import RunError


def packed_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, budget: int, ranks: int = 1) -> list[list[torch.Tensor]]:
    """``rows`` (batch indices; ``lengths``, their token counts) as micro-batches, each a share per rank:
    ``plan[m][r]`` holds the rows rank ``r`` trains in micro-batch ``m``, at most ``budget`` tokens, shortest first.

    First fit decreasing: the longest row first, each into the least loaded share of the first micro-batch with
    room, so that ranks carry equal token loads. Every share holds a row (a rank's forward takes part in its
    micro-batch's collectives): an empty one takes the shortest row of a share holding several, which a budget of
    at least twice the longest row always finds (``config/validate.py`` asks that much of data-parallel runs).
    Every rank computes the same plan from the same rows."""
    order = torch.sort(lengths, descending=True, stable=True).indices
    if len(order) and int(lengths[order[0]]) > budget:
        raise RunError(f"a completion of {int(lengths[order[0]])} tokens (prompt included) is longer than "
                       f"train.micro_batch_tokens={budget}: raise it to at least inference_model.max_model_len")
    shares: list[list[list[int]]] = []  # micro-batch -> rank -> positions in rows
    loads: list[list[int]] = []
    for i in order.tolist():
        size = int(lengths[i])
        for m, load in enumerate(loads):
            r = min(range(ranks), key=load.__getitem__)
            if load[r] + size <= budget:
                break
        else:
            shares.append([[] for _ in range(ranks)])
            loads.append([0] * ranks)
            m, r = len(loads) - 1, 0
        shares[m][r].append(i)
        loads[m][r] += size
    _fill_empty_shares(shares, lengths)
    return [[rows[torch.tensor(sorted(share, key=lambda i: (int(lengths[i]), i)), dtype=torch.long)]
             for share in micro] for micro in shares]


def _fill_empty_shares(shares: list[list[list[int]]], lengths: torch.Tensor) -> None:
    """Give each empty share the shortest row of a share holding several (its own micro-batch's first)."""
    for micro in shares:
        for share in micro:
            if share:
                continue
            donors = [s for s in micro if len(s) > 1] or [s for m in shares for s in m if len(s) > 1]
            if not donors:
                raise RunError(f"{sum(len(s) for m in shares for s in m)} completions cannot give each of "
                               f"{len(micro)} data-parallel ranks a share of every micro-batch: raise "
                               "train.micro_batch_tokens")
            donor = max(donors, key=len)
            shortest = min(donor, key=lambda i: int(lengths[i]))
            donor.remove(shortest)
            share.append(shortest)
