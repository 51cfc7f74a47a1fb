"""Which GPUs a child process sees: ``CUDA_VISIBLE_DEVICES`` set while it starts (vLLM's engine process, a local Ray's
raylet and so its actors), in this process's numbering, then given back."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence


def physical_ids(logical: Sequence[int], environ=os.environ) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``logical`` (this process's GPU numbers): the ids this process's own
    ``CUDA_VISIBLE_DEVICES`` maps them to, if it has one; "" for none."""
    mine = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in mine.split(",")] if mine else None
    return ",".join(ids[d] if ids is not None and d < len(ids) else str(d) for d in logical)


@contextlib.contextmanager
def children_see(logical: Sequence[int]) -> Iterator[None]:
    """Processes started meanwhile see only the GPUs ``logical`` (none for an empty list). This process keeps what it
    saw where its CUDA already started; a CUDA that starts meanwhile would read it too."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = physical_ids(logical)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
