"""The Task abstraction the trainer uses: prompts (a ``datasets.Dataset``) plus pluggable reward functions.

A task is a dataset of rows (each with at least ``question`` and ``answer``), an optional system prompt and
a list of :class:`Reward` s. Each reward is a named ``fn(completion, row) -> float`` with a weight; the
trainer logs every component apart and optimises ``total = sum(weight * component)``. New rewards or new
tasks (IFEval, reasoning-gym, ...) plug in by building a ``Task`` with other rewards; the trainer only calls
:meth:`Task.messages`, :meth:`Task.score` and :meth:`Task.total`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import datasets

from torchrl_grpo.core.errors import ConfigError, RunError, one_line

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Mapping[str, Any]], float]


@dataclass(frozen=True)
class Reward:
    """One reward component: ``fn(completion, row) -> float`` (unweighted) and its weight in the total."""

    name: str
    fn: RewardFn
    weight: float = 1.0


@dataclass
class Task:
    name: str
    rows: datasets.Dataset
    system_prompt: str | None
    rewards: list[Reward] = field(default_factory=list)
    success: str | None = None  # the component that says "solved" (value >= 1) for pass@k; None: the first
    reward_errors: str = "raise"  # env.reward_errors: a reward function that raises stops the run, or scores 0
    reward_error_count: int = 0  # completions scored 0 because a reward function raised (reward_errors=zero)
    # components that are the share of a row's checks passed (IFEval: its instructions): name -> the row's
    # number of checks; evaluation also counts them pooled over all checks (IFEval's instruction-level accuracy)
    pooled: dict[str, Callable[[Mapping[str, Any]], int]] = field(default_factory=dict)

    def __post_init__(self):
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"task {self.name!r}: duplicate reward names {names}")

    @property
    def reward_weights(self) -> dict[str, float]:
        """Component name -> weight; total reward = sum(weight * component)."""
        return {r.name: float(r.weight) for r in self.rewards}

    @property
    def success_reward(self) -> str:
        """The reward component whose value >= 1 counts a completion as solved (evaluation, pass@k)."""
        return self.success or self.rewards[0].name

    @property
    def reward_names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def add_reward(self, name: str, fn: RewardFn, weight: float = 1.0) -> Task:
        """Append a reward component (e.g. a custom one); returns self."""
        if name in self.reward_names:
            raise ValueError(f"task {self.name!r} already has a reward named {name!r}")
        self.rewards.append(Reward(name, fn, float(weight)))
        return self

    def set_weights(self, overrides: Mapping[str, Any] | None, key: str = "env.reward_weights") -> Task:
        """Override weights by component name; unknown names or non-numbers raise ConfigError naming ``key``."""
        if not overrides:
            return self
        known = self.reward_names
        new = dict(self.reward_weights)
        for name, weight in overrides.items():
            if name not in known:
                raise ConfigError(
                    f"{key}.{name}: unknown reward component for task {self.name!r}; "
                    f"choices: {', '.join(known)}"
                )
            try:
                new[name] = float(weight)
            except (TypeError, ValueError):
                raise ConfigError(f"{key}.{name}={weight!r}: the weight must be a number") from None
        self.rewards = [Reward(r.name, r.fn, new[r.name]) for r in self.rewards]
        return self

    def messages(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """Chat messages for one row: the optional system prompt, then the question as the user turn."""
        msgs = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": row["question"]})
        return msgs

    def score(self, completion: str, row: Mapping[str, Any]) -> dict[str, float]:
        """Every reward component of ``completion`` for ``row``, unweighted, in reward order. A reward function
        that raises is a :class:`RunError` naming it and the row, or (``reward_errors="zero"``) scores 0,
        counted in ``reward_error_count``, the first traceback logged once."""
        return {r.name: self._call(r, completion, row) for r in self.rewards}

    def _call(self, reward: Reward, completion: str, row: Mapping[str, Any]) -> float:
        try:
            return float(reward.fn(completion, row))
        except ConfigError:  # the reward's own one-line verdict on the input (e.g. a row it cannot score)
            raise
        except Exception as err:
            where = (f"reward {reward.name!r} ({getattr(reward.fn, '__module__', '?')}."
                     f"{getattr(reward.fn, '__qualname__', reward.fn)}) raised {one_line(err)} on the row whose "
                     f"question starts {str(row.get('question', ''))[:60]!r}")
            if self.reward_errors != "zero":
                raise RunError(f"{where}; fix the function, or set env.reward_errors=zero to score such "
                               "completions 0 (counted in reward_errors)") from None
            if self.reward_error_count == 0:
                log.warning("%s; scored 0 (env.reward_errors=zero), further errors only counted", where, exc_info=True)
            self.reward_error_count += 1
            return 0.0

    def total(self, components: Mapping[str, float]) -> float:
        """``sum(weight * component)`` over this task's rewards (components not in the task are ignored)."""
        return float(sum(r.weight * float(components[r.name]) for r in self.rewards))

    def __len__(self) -> int:
        return len(self.rows)


def per_task_means(rows: list[Mapping[str, Any]], components: list[Mapping[str, float]], totals: list[float],
                   prefix: str = "task/") -> dict[str, float]:
    """``{prefix}<task>/<component>`` and ``{prefix}<task>/reward`` means over the completions of each task,
    for batches that mix tasks (rows with a ``task`` field, e.g. reasoning-gym); {} for single-task rows."""
    names = [row.get("task") for row in rows]
    if not names or any(not isinstance(n, str) for n in names):
        return {}
    out = {}
    for name in dict.fromkeys(names):
        mine = [i for i, n in enumerate(names) if n == name]
        for key in components[0]:
            out[f"{prefix}{name}/{key}"] = sum(float(components[i][key]) for i in mine) / len(mine)
        out[f"{prefix}{name}/reward"] = sum(totals[i] for i in mine) / len(mine)
    return out
