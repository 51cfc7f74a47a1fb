"""``train.sync_iter=false``: the next step's groups are generated in a background thread while this step
is scored and optimized, as in the original recipe: batch k+1 is sampled by the weights before step k's
update (staleness <= 1).

vLLM runs in this process and is used by one thread at a time: the weight push (and any evaluation) comes
after :meth:`Prefetch.finish`. Policy-dependent log-probs are computed by the trainer when the batch is
taken. A checkpoint saves :attr:`Prefetch.position`, the prompt order before the prefetched prompts: on
resume that batch is simply sampled again, with the checkpoint's weights. The in-process engine samples from
torch's global generator (swapped in around each generate): a trainer that draws from it too (LoRA dropout)
makes runs not bit-reproducible. Even without that, two runs of one seed part after a few steps on a CPU (measured
with the tiny model on 2 cores; the cause, in the two threads' concurrent numerics, is not pinned down).
"""
from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

from torchrl_grpo.collect.collector import Collector, Group
from torchrl_grpo.core.errors import RunError


class Prefetch:
    def __init__(self, collector: Collector, version: int):
        self.collector = collector
        self.version = version  # the policy version of the weights in the engine
        self.position = copy.deepcopy(collector.sampler)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-prefetch")
        self._running, self._ready, self._failed = None, None, None

    def next(self, more: bool) -> tuple[int, tuple[list[Group], dict]]:
        """This step's (policy version, groups): prefetched during the last step, or generated now (a run's
        first step); then, if ``more`` steps follow, starts generating the next step's at the engine's weights."""
        if self._failed is not None:  # the generation for this step raised while the last one trained
            raise self._failed
        ready = self._ready or (self.version, self.collector.sample_groups())
        self._ready, self.position = None, copy.deepcopy(self.collector.sampler)
        if more:
            self._running = (self.version, self._pool.submit(self.collector.sample_groups))
        return ready

    def finish(self) -> float:
        """Wait for the generation in flight (before the engine may take new weights); returns the seconds waited."""
        if self._running is None:
            return 0.0
        started = time.perf_counter()
        version, future = self._running
        self._running = None
        try:
            self._ready = (version, future.result())
        except RunError as err:  # a reward function raised: the step that is training finishes first
            self._failed = err
        return time.perf_counter() - started

    def drop_in_flight(self) -> None:
        """Forget the generation in flight and its batch (their engine died): the sampler goes back to before its
        prompts, and the next step generates its batch itself."""
        self._running = self._ready = self._failed = None
        self.collector.sampler = copy.deepcopy(self.position)

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # the engine must not be closed under a generate in flight
