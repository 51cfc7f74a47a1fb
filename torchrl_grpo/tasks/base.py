"""The Task abstraction the trainer uses: prompts (a ``datasets.Dataset``) plus pluggable reward functions.

A task is a dataset of rows (each with at least ``question`` and ``answer``), an optional system prompt and
a list of :class:`Reward` s. Each reward is a named function with a weight, ``fn(completion, row) -> float`` or
TRL's batched signature (:mod:`torchrl_grpo.tasks.scoring`); the trainer logs every component apart and
optimises ``total = sum(weight * component)`` over the components that apply (a reward may say ``None``). New
rewards or new tasks (IFEval, reasoning-gym, ...) plug in by building a ``Task`` with other rewards; the trainer
only calls :meth:`Task.messages`, :meth:`Task.score_batch` (or :meth:`Task.score`) and :meth:`Task.total`.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets

from torchrl_grpo.core.errors import ConfigError, RunError, one_line
from torchrl_grpo.tasks.scoring import as_component, call_rewards, nan_mean

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]  # fn(completion, row) -> float | None, or TRL's fn(completions, **kw) -> list


@dataclass(frozen=True)
class Reward:
    """One reward component: its function (unweighted values; either signature) and its weight in the total."""

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
    conversational: bool = False  # TRL-style rewards get prompts and completions as chat messages
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # env.chat_template_kwargs
    examples: list[dict[str, str]] = field(default_factory=list)  # env.examples: worked examples before the question

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
        """Chat messages for one row: its prompt's (:meth:`prompt_messages`) with the worked examples
        (``env.examples``) inserted after its leading system messages, as earlier turns of the conversation."""
        msgs = self.prompt_messages(row)
        lead = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
        return msgs[:lead] + [dict(m) for m in self.examples] + msgs[lead:]

    def prompt_messages(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """The row's own prompt: the optional system prompt, then the question as the user turn."""
        msgs = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": row["question"]})
        return msgs

    def prompt_text(self, row: Mapping[str, Any]) -> str:
        """The row's prompt as one string (evaluation finds rows by it; errors quote it)."""
        return str(row.get("question", ""))

    def reward_prompt(self, row: Mapping[str, Any]) -> Any:
        """The row's prompt as TRL-style rewards get it: its text, or its messages for a conversational task."""
        return self.messages(row) if self.conversational else self.prompt_text(row)

    def score(self, completion: str, row: Mapping[str, Any]) -> dict[str, float]:
        """Every reward component of one completion (:meth:`score_batch` of one)."""
        return self.score_batch([completion], [row])[0]

    def score_batch(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]],
                    completion_ids: Sequence[Sequence[int]] | None = None) -> list[dict[str, float]]:
        """Every reward component of each completion (``rows[i]`` is the row ``completions[i]`` answers),
        unweighted, in reward order; NaN where a reward said ``None`` (not applicable). A reward function that
        raises is a :class:`RunError` naming it and the row, or (``reward_errors="zero"``) scores 0, counted in
        ``reward_error_count``, the first error logged once."""
        raw = call_rewards(self.rewards, completions, rows, [self.reward_prompt(r) for r in rows], completion_ids,
                           self.conversational)
        return [{r.name: self._component(r, raw[r.name][i], rows[i]) for r in self.rewards}
                for i in range(len(completions))]

    def _component(self, reward: Reward, value: Any, row: Mapping[str, Any]) -> float:
        if isinstance(value, ConfigError):  # the reward's own one-line verdict on the input (a row it cannot score)
            raise value
        if not isinstance(value, Exception):
            try:
                return as_component(value)
            except (TypeError, ValueError) as err:
                value = TypeError(f"returned {value!r}, not a number ({one_line(err)})")
        fn = reward.fn if hasattr(reward.fn, "__qualname__") else type(reward.fn)  # a function, or a scorer object
        where = (f"reward {reward.name!r} ({getattr(fn, '__module__', '?')}.{fn.__qualname__}) raised "
                 f"{one_line(value)} on the row whose "
                 f"prompt starts {self.prompt_text(row)[:60]!r}")
        if self.reward_errors != "zero":
            raise RunError(f"{where}; fix the function, or set env.reward_errors=zero to score such "
                           "completions 0 (counted in reward_errors)") from None
        if self.reward_error_count == 0:
            log.warning("%s; scored 0 (env.reward_errors=zero), further errors only counted", where,
                        exc_info=(type(value), value, value.__traceback__))
        self.reward_error_count += 1
        return 0.0

    def total(self, components: Mapping[str, float]) -> float:
        """``sum(weight * component)`` over this task's rewards that apply (NaN components are left out, as
        TRL's ``nansum``; components not in the task are ignored)."""
        return float(sum(r.weight * float(components[r.name]) for r in self.rewards
                         if not math.isnan(float(components[r.name]))))

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
            out[f"{prefix}{name}/{key}"] = nan_mean(components[i][key] for i in mine)
        out[f"{prefix}{name}/reward"] = sum(totals[i] for i in mine) / len(mine)
    return out
