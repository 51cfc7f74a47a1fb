"""The collector: prompts -> engine -> scored groups -> batch.

It is what a rollout actor runs (``grpo-async.py``) and the first half of a sync step, and it holds nothing
of the trainer: no policy, no log-probs of its own, no advantages (those may need the trainer's log-probs,
e.g. a KL penalty in the reward: :meth:`torchrl_grpo.training.trainer.Trainer.prepare` adds them in every mode).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from torchrl_grpo.config.settings import CollectSettings
from torchrl_grpo.core.batch import Batch
from torchrl_grpo.episodes.play import Played, play, turn_metrics
from torchrl_grpo.episodes.trajectories import PromptSampler, build_batch, reward_tensors
from torchrl_grpo.episodes.turn_envs import Turns
from torchrl_grpo.objective.overlong import overlong_penalty
from torchrl_grpo.tasks import Task, per_task_means


@dataclass
class Group:
    """One prompt, its G episodes (one engine turn each for single-turn tasks) and their reward components (task
    rewards, unweighted)."""

    row: dict
    episodes: list[Played]
    components: list[dict]
    index: int | None = None  # the row's index in the task (streamed groups: a resumed run opens it again)


class Collector:
    """Draws prompts from ``sampler``, plays ``group_size`` episodes of each with ``engine`` (one completion each
    unless ``turns`` give an episode several: :func:`torchrl_grpo.episodes.play.play`) and scores them with
    ``task``. The engine is any :class:`torchrl_grpo.engines.base.Engine`."""

    def __init__(self, task: Task, tokenizer, engine, sampler: PromptSampler, settings: CollectSettings,
                 turns: Turns = Turns()):
        self.task, self.tokenizer, self.engine = task, tokenizer, engine
        self.sampler, self.settings, self.turns = sampler, settings, turns
        self.envs = []  # the episodes' TorchRL environments, reused from step to step

    def sample_groups(self) -> tuple[list[Group], dict]:
        """The step's ``prompts_per_step`` groups. With dynamic sampling (DAPO), groups whose rewards all tie
        (no signal) are replaced by fresh prompts for up to ``max_resample_rounds`` more rounds; if still short,
        tied groups fill the rest so that the step keeps its size. Ties are judged on the task reward plus the
        soft overlong penalty, before any KL penalty (which would untie everything)."""
        s, task = self.settings, self.task
        kept, spare, rounds, sampled, generation_time, play_time, score_time = [], [], 0, 0, 0.0, 0.0, 0.0
        while len(kept) < s.prompts_per_step and (
                rounds == 0 or (s.dynamic_sampling and rounds <= s.max_resample_rounds)):
            rows = [task.rows[i] for i in self.sampler.take(s.prompts_per_step - len(kept))]
            started = time.perf_counter()
            played, generating = play(self.engine, self.tokenizer, task, rows, n=s.group_size,
                                      max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                      top_k=s.top_k, min_p=s.min_p, max_model_len=s.max_model_len, turns=self.turns,
                                      envs=self.envs)
            generation_time += generating
            play_time += time.perf_counter() - started
            started = time.perf_counter()
            for j, row in enumerate(rows):
                mine = played[j * s.group_size: (j + 1) * s.group_size]
                group = Group(row, mine, [p.components for p in mine])
                rewards = torch.tensor([task.total(c) for c in group.components]) + self._overlong(mine)
                (spare if s.dynamic_sampling and bool((rewards == rewards[0]).all()) else kept).append(group)
            score_time += time.perf_counter() - started
            rounds, sampled = rounds + 1, sampled + len(rows)
        dropped = len(spare)
        kept += spare[: s.prompts_per_step - len(kept)]
        # what play spent outside the engine: a single-turn episode's rewards; a multi-turn episode's environment
        # (its turns and, at the end, its rewards)
        outside_engine = play_time - generation_time
        stats = {"generation_time": generation_time, "score_time": score_time}
        if self.turns.max_turns > 1:
            stats["env_time"] = outside_engine
        else:
            stats["score_time"] += outside_engine
        if s.dynamic_sampling:
            stats.update({"dropped_group_fraction": dropped / sampled, "sampling_rounds": rounds})
        return kept, stats

    def collect(self, version: int, sampled: tuple[list[Group], dict] | None = None):
        """One step's scored batch, sampled by policy ``version``: ``(batch, metrics, samples)``, ``samples`` each
        completion's ``{"prompt", "completion"}`` text in batch order (the row's prompt; a multi-turn episode's
        completion is everything after its prompt). ``sampled``: the step's :meth:`sample_groups` already
        generated (by the sync loop's prefetch), else generated here."""
        groups, metrics = sampled or self.sample_groups()
        played = [p for group in groups for p in group.episodes]
        batch = build_batch(played, self.settings.group_size, self.tokenizer.pad_token_id, version)
        components = [c for g in groups for c in g.components]
        batch.update(reward_tensors(self.task, components))
        if self.settings.soft_overlong:
            penalty = self._overlong(played)
            batch[Batch.REWARD] = batch[Batch.REWARD] + penalty
            metrics["overlong_penalty_mean"] = penalty.mean().item()
        batch[Batch.OLD_LOG_PROBS] = batch[Batch.SAMPLE_LOG_PROBS]
        if self.task.reward_errors == "zero":
            metrics["reward_errors"] = self.task.reward_error_count  # so far in this process
        lengths = batch[Batch.COMPLETION_MASK].sum(-1).float()
        metrics.update({
            **{f"reward/{k}": v.float().nanmean().item()
               for k, v in batch[Batch.REWARDS].items()},  # over those it applies to
            "completion_length": lengths.mean().item(),
            "completion_length_max": lengths.max().item(),
            "truncated_fraction": batch[Batch.TRUNCATED].float().mean().item(),
            "generation_tokens_per_s": lengths.sum().item() / max(metrics["generation_time"], 1e-9),
            **per_task_means([g.row for g in groups for _ in g.episodes], components,
                             [self.task.total(c) for c in components]),
        })
        prompts = [self.task.prompt_text(g.row) for g in groups for _ in g.episodes]
        if self.turns.max_turns == 1:
            texts = [p.text for p in played]
        else:
            metrics.update(turn_metrics(played, self.turns.env.counters if self.turns.env else ()))
            texts = [self.tokenizer.decode(p.episode.tokens[p.prompt_length:]) for p in played]
        return batch, metrics, [{"prompt": q, "completion": t} for q, t in zip(prompts, texts)]

    def _overlong(self, played: list[Played]) -> torch.Tensor:
        """DAPO's soft overlong penalty per completion (``loss.overlong=soft``; single-turn only), else zeros."""
        lengths = torch.tensor([sum(p.episode.sampled) for p in played])
        if not self.settings.soft_overlong:
            return torch.zeros(len(played))
        return overlong_penalty(lengths, self.settings.max_tokens, self.settings.overlong_buffer)

