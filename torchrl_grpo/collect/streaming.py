"""A rollout actor's groups in flight (``ray.streaming``): ``env.num_envs`` prompts, ``env.repeats`` requests each,
kept in flight on one engine (:class:`~torchrl_grpo.engines.streaming.StreamingEngine`); a group is scored and
handed over as soon as its last completion finishes, and a new prompt takes its place at once. Long completions
never hold short ones back, and the engine never drains between batches.

A group's prompt is drawn from the actor's sampler when it opens; :meth:`GroupStream.position` gives the sampler
and the prompts of the groups still open, so that a resumed run opens those again first: no prompt is lost or
used twice within an epoch (the trainer adds the groups it holds but has not trained on).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from torchrl_grpo.collect.collector import Group
from torchrl_grpo.config.settings import CollectSettings
from torchrl_grpo.engines.streaming import Streamed, StreamingEngine
from torchrl_grpo.episodes.episode import Episode
from torchrl_grpo.episodes.play import Played
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
    flight; ``reopen``: prompts (row indices) to open first, a resumed run's groups that were in flight."""

    def __init__(self, task, tokenizer, engine, sampler: PromptSampler, settings: CollectSettings, version: int = 0,
                 reopen: list[int] | None = None):
        self.task, self.tokenizer, self.sampler, self.settings = task, tokenizer, sampler, settings
        self.engine = StreamingEngine(engine, max_tokens=settings.max_tokens, temperature=settings.temperature,
                                      top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p,
                                      version=version)
        self.open: dict[int, OpenGroup] = {}
        self.reopen = list(reopen or ())
        self._ids = itertools.count()

    def poll(self, max_seconds: float) -> tuple[list[Group], dict]:
        """Decode until a group finishes or ``max_seconds`` pass (every group in flight all the while: each one
        that finishes is replaced at once); the finished groups, scored, and what it took (``generation_time``,
        ``score_time``, ``generated_tokens``)."""
        started = time.perf_counter()
        finished: list[OpenGroup] = []
        self._fill()
        while not finished and time.perf_counter() - started < max_seconds:
            for streamed in self.engine.advance(max_steps=8):
                key, j = streamed.key
                group = self.open[key]
                group.done[j] = streamed
                if len(group.done) == self.settings.group_size:
                    finished.append(self.open.pop(key))
            self._fill()
        generating = time.perf_counter() - started
        groups = self._scored(finished)
        tokens = sum(len(s.token_ids) for g in finished for s in g.done.values())
        return groups, {"generation_time": generating, "score_time": time.perf_counter() - started - generating,
                        "generated_tokens": tokens}

    def position(self) -> dict:
        """The sampler's state and the prompts of the groups in flight (and not yet reopened), oldest first."""
        return {"sampler": self.sampler.state_dict(), "open": [g.index for g in self.open.values()] + self.reopen}

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
        samples = [(g, g.done[j]) for g in finished for j in range(self.settings.group_size)]
        rows = [self.task.rows[g.index] for g, _ in samples]
        scores = self.task.score_batch([s.text for _, s in samples], rows, [s.token_ids for _, s in samples])
        groups = []
        for i, g in enumerate(finished):
            played = []
            for (_, s), row, components in list(zip(samples, rows, scores))[i * self.settings.group_size:
                                                                            (i + 1) * self.settings.group_size]:
                episode = Episode.start(g.prompt)
                episode.add_sampled(s.token_ids, s.log_probs)
                ended = "max_steps" if s.finish_reason == "stop" else "length"
                played.append(Played(episode, len(g.prompt),
                                     [*self.task.messages(row), {"role": "assistant", "content": s.text}],
                                     s.finish_reason, ended, {}, components, versions=s.versions))
            groups.append(Group(rows[i * self.settings.group_size], played, [p.components for p in played], g.index))
        return groups
