"""How a step's rows become micro-batches: a fixed number of rows of similar lengths (:func:`by_length`), or packed
by a token budget (``train.micro_batch_tokens``, :func:`packed_micro_batches`): the rows of an optimizer step end to
end in as few micro-batches as fit, each holding at most the budget's tokens on each data-parallel rank, with equal
token loads. :func:`rows_to_train` leaves out the rows that cannot move the weights; :func:`trim_padding` the
columns no row uses.

The update does not depend on how a step's rows are cut: each micro-batch's loss is weighted by its share of the
step's aggregation (:meth:`~torchrl_grpo.objective.loss.LossRows.weight`), so only the float rounding
of the sum changes. What packing changes is the work: no padding (the forward reads the rows packed, see
:func:`~torchrl_grpo.objective.log_probs.packed_inputs`), and micro-batches as full as the budget allows whatever
the rows' lengths, where a fixed number of rows is sized for the longest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrl_grpo.core.batch import Batch
from torchrl_grpo.core.errors import RunError
from torchrl_grpo.parallel.ranks import DataParallel


@dataclass(frozen=True)
class MicroBatching:
    """How this rank cuts a step's rows into micro-batches: ``rows`` rows of similar lengths each (``train.
    optim_batch_size``; data-parallel: this rank's share of them), or packed by ``tokens`` (``train.
    micro_batch_tokens``). Every rank gets as many micro-batches."""

    rows: int
    tokens: int | None = None
    parallel: DataParallel | None = None  # None: one process

    @property
    def fill(self) -> int:
        """What the rows trained are filled up to a multiple of (:func:`rows_to_train`): a micro-batch's rows, or
        with packing, a row per rank (each takes part in every micro-batch)."""
        if self.tokens is None:
            return self.rows
        return 1 if self.parallel is None else self.parallel.world_size

    def cut(self, rows: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows (batch indices) of each micro-batch over ``rows``."""
        parallel = self.parallel
        if self.tokens is not None:
            ranks, rank = (1, 0) if parallel is None else (parallel.world_size, parallel.rank)
            plan = packed_micro_batches(rows, attention_mask[rows].sum(-1), self.tokens, ranks)
            return [shares[rank] for shares in plan]
        order = by_length(rows, attention_mask).split(self.rows)
        return list(order) if parallel is None else [idx[parallel.share(len(idx))] for idx in order]


def packed_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, budget: int,
                         ranks: int = 1) -> list[list[torch.Tensor]]:
    """``rows`` (batch indices; ``lengths``, their token counts) as micro-batches, each a share per rank:
    ``plan[m][r]`` holds the rows rank ``r`` trains in micro-batch ``m``, at most ``budget`` tokens, shortest first.

    The fewest micro-batches the tokens need, then more only if the rows do not fit them: the longest row first,
    each into the least loaded of the micro-batches' shares (longest processing time first), so that every share,
    hence every rank in every micro-batch, carries about the same tokens. Every share holds a row (a rank's forward
    takes part in its micro-batch's collectives): an empty one takes the shortest row of a share holding several.
    Every rank computes the same plan from the same rows."""
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
    sizes = [int(n) for n in lengths]
    if order and sizes[order[0]] > budget:
        raise RunError(f"a completion of {sizes[order[0]]} tokens (prompt included) is longer than "
                       f"train.micro_batch_tokens={budget}: raise it to at least inference_model.max_model_len")
    count = max(1, -(-sum(sizes) // (budget * ranks)))
    while (shares := _longest_first(order, sizes, budget, count * ranks)) is None:
        count += 1
    _fill_empty_shares(shares, sizes)
    plan = [shares[m * ranks:(m + 1) * ranks] for m in range(count)]
    return [[rows[torch.tensor(sorted(share, key=lambda i: (sizes[i], i)), dtype=torch.long)] for share in micro]
            for micro in plan]


def _longest_first(order: list[int], sizes: list[int], budget: int, bins: int) -> list[list[int]] | None:
    """Rows (``order``: longest first) each into the least loaded of ``bins`` shares; None if one does not fit."""
    shares: list[list[int]] = [[] for _ in range(bins)]
    loads = [0] * bins
    for i in order:
        b = min(range(bins), key=loads.__getitem__)
        if loads[b] + sizes[i] > budget:
            return None
        shares[b].append(i)
        loads[b] += sizes[i]
    return shares


def _fill_empty_shares(shares: list[list[int]], sizes: list[int]) -> None:
    """Give each empty share the shortest row of the share holding the most rows."""
    for share in shares:
        if share:
            continue
        donor = max(shares, key=len)
        if len(donor) < 2:
            raise RunError(f"{sum(map(len, shares))} completions cannot give a share of every micro-batch to each "
                           "data-parallel rank: raise train.micro_batch_tokens")
        shortest = min(donor, key=sizes.__getitem__)
        donor.remove(shortest)
        share.append(shortest)


def by_length(rows: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``rows`` (indices into the batch) sorted by their token count, so that micro-batches cut from them in
    order hold sequences of similar lengths: less compute on padding, and an optimizer step over a window of
    micro-batches still sees the same rows (stable sort: ties keep their shuffled order)."""
    lengths = attention_mask[rows].sum(-1)
    return rows[torch.sort(lengths, stable=True).indices]


def rows_to_train(window: torch.Tensor, moving: torch.Tensor, micro_batch: int) -> torch.Tensor:
    """The rows of ``window`` (batch indices) that can move the weights (``moving``), filled up with others to
    whole micro-batches: the micro-batches, and each data-parallel rank's share of them, stay as full as
    without the skip, and are cut alike in one process and over ranks."""
    keep = window[moving]
    return torch.cat([keep, window[~moving][: -len(keep) % micro_batch]])


def trim_padding(batch):
    """Drop the padding columns no row of this micro-batch uses."""
    used = int(batch[Batch.ATTENTION_MASK].any(0).nonzero().max()) + 1
    return batch.apply(lambda t: t[:, :used] if t.dim() == 2 else t)
