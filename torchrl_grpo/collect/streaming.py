"""A rollout actor's groups in flight (``ray.streaming``): ``env.num_envs`` prompts, ``env.repeats`` requests each,
kept in flight on one engine (:class:`~torchrl_grpo.engines.streaming.StreamingEngine`) by a thread of the actor that
decodes all the while, the trainer's calls or not; a group is queued as soon as its last completion finishes, and a
new prompt takes its place at once. Long completions never hold short ones back, and the engine never drains
between batches or waits for the trainer to fetch. The actor's calls take the finished groups (:meth:`GroupStream.
take`, which scores them) and push weights between two decoding steps (:meth:`GroupStream.pushing`).

A group's prompt is drawn from the actor's sampler when it opens; :meth:`GroupStream.position` gives the sampler
and the prompts of the groups open or queued, so that a resumed run opens those again first: no prompt is lost or
used twice within an epoch (the trainer adds the groups it holds but has not trained on).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from torchrl_grpo.collect.collector import Group
from torchrl_grpo.config.settings import CollectSettings
from torchrl_grpo.engines.streaming import Streamed, StreamingEngine
from torchrl_grpo.episodes.play import scored_completions
from torchrl_grpo.episodes.trajectories import PromptSampler, prompt_token_ids


@dataclass
class OpenGroup:
    """A prompt (its row's index and ids) and the completions of it that finished so far."""

    index: int
    prompt: list[int]
    done: dict[int, Streamed] = field(default_factory=dict)


class GroupStream:
    """Groups of ``settings.group_size`` completions of ``task``'s prompts from ``engine`` (a
    :class:`~torchrl_grpo.engines.vllm.VLLMEngine`) at policy ``version``, ``settings.prompts_per_step`` of them in
    flight, decoded by a thread of its own once :meth:`start` ran; at most ``queued`` finished groups wait for
    :meth:`take` (decoding further would only make groups the trainer drops as stale). ``reopen``: prompts (row
    indices) to open first, a resumed run's groups that were in flight."""

    def __init__(self, task, tokenizer, engine, sampler: PromptSampler, settings: CollectSettings, version: int = 0,
                 reopen: list[int] | None = None, queued: int | None = None):
        self.task, self.tokenizer, self.sampler, self.settings = task, tokenizer, sampler, settings
        self.engine = StreamingEngine(engine, max_tokens=settings.max_tokens, temperature=settings.temperature,
                                      top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p,
                                      version=version)
        self.open: dict[int, OpenGroup] = {}
        self.finished: list[OpenGroup] = []
        self.reopen = list(reopen or ())
        self.queued = queued or 2 * settings.prompts_per_step
        self._ids = itertools.count()
        self.lock = threading.Condition()  # the engine, the groups and the counters below
        self.busy_s, self.tokens, self.since = 0.0, 0, time.perf_counter()
        self.error: BaseException | None = None
        self.stopping = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start decoding in the background (once)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._decode, name="group-stream", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join()

    def take(self, max_seconds: float) -> tuple[list[Group], dict]:
        """The oldest groups finished (waiting up to ``max_seconds`` for one), a step's at most, scored, and what the
        engine did since the last call: ``generation_time`` (seconds decoding), ``idle_time`` (the rest) and
        ``generated_tokens``. The others stay queued here, where they count against the queue's bound: the trainer
        holds no more than a step's beside it."""
        self.start()
        with self.lock:
            self.lock.wait_for(lambda: self.finished or self.error is not None, timeout=max_seconds)
            if self.error is not None:
                raise self.error
            step = self.settings.prompts_per_step
            finished, self.finished = self.finished[:step], self.finished[step:]
            now = time.perf_counter()
            metrics = {"generation_time": self.busy_s, "idle_time": max(0.0, now - self.since - self.busy_s),
                       "generated_tokens": self.tokens}
            self.busy_s, self.tokens, self.since = 0.0, 0, now
            self.lock.notify_all()  # room in the queue again
        started = time.perf_counter()
        groups = self._scored(finished)
        return groups, {**metrics, "score_time": time.perf_counter() - started}

    @contextlib.contextmanager
    def pushing(self, version: int) -> Iterator[None]:
        """Around a push: between two decoding steps, the requests in flight kept, their later tokens labelled
        ``version``."""
        with self.lock, self.engine.pushing(version):
            yield

    def score(self, token_ids: list[int]) -> list[float]:
        """The weight sync probe's log-probs, between two decoding steps (:meth:`StreamingEngine.score`)."""
        with self.lock:
            return self.engine.score(token_ids)

    def reopen_first(self, indices: list[int]) -> None:
        """Open the prompts ``indices`` (row indices) before any new one."""
        if indices:
            with self.lock:
                self.reopen[:0] = list(indices)

    def position(self) -> dict:
        """The sampler's state and the prompts of the groups open or finished and not yet taken, oldest first."""
        with self.lock:
            return {"sampler": self.sampler.state_dict(),
                    "open": [g.index for g in [*self.finished, *self.open.values()]] + self.reopen}

    def _decode(self) -> None:
        """The thread: decode a few steps at a time, the lock held only meanwhile, until :meth:`stop`."""
        try:
            while True:
                with self.lock:
                    self.lock.wait_for(lambda: self.stopping or len(self.finished) < self.queued)
                    if self.stopping:
                        return
                    started = time.perf_counter()
                    self._fill()
                    for streamed in self.engine.advance(max_steps=4):
                        key, j = streamed.key
                        group = self.open[key]
                        group.done[j] = streamed
                        self.tokens += len(streamed.token_ids)
                        if len(group.done) == self.settings.group_size:
                            self.finished.append(self.open.pop(key))
                            self.lock.notify_all()
                    self._fill()
                    self.busy_s += time.perf_counter() - started
        except BaseException as err:  # the actor's next take raises it
            with self.lock:
                self.error = err
                self.lock.notify_all()
    def _fill(self) -> None:
        while len(self.open) < self.settings.prompts_per_step:
            index = self.reopen.pop(0) if self.reopen else self.sampler.take(1)[0]
            [prompt] = prompt_token_ids(self.task, self.tokenizer, [self.task.rows[index]])
            key = next(self._ids)
            self.open[key] = OpenGroup(index, list(prompt))
            for j in range(self.settings.group_size):
                self.engine.submit((key, j), prompt)

    def _scored(self, finished: list[OpenGroup]) -> list[Group]:
        """Each finished group as the collector's :class:`~torchrl_grpo.collect.collector.Group`, its completions in
        request order, scored by the task."""
        size = self.settings.group_size
        completions = [g.done[j] for g in finished for j in range(size)]
        prompts = [g.prompt for g in finished for _ in range(size)]
        rows = [self.task.rows[g.index] for g in finished for _ in range(size)]
        played = scored_completions(self.task, prompts, rows, completions, [c.versions for c in completions])
        groups = []
        for i, g in enumerate(finished):
            mine = played[i * size:(i + 1) * size]
            groups.append(Group(self.task.rows[g.index], mine, [p.components for p in mine], g.index))
        return groups
