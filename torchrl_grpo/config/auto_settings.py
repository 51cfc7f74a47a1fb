"""The settings that trade memory for speed, chosen when set to ``auto``: the fastest combination whose memory plan
(:mod:`~torchrl_grpo.config.memory_plan`) fits every device within its budget, before anything is loaded.

Faster first, by what each is measured to buy (docs/benchmarks.md):

* ``train_model.gradient_checkpointing``: off trains 22-28% faster on an H200 and 5-10% faster on a CPU, for every
  layer's activations instead of one layer's;
* ``train.micro_batch_tokens``: on a GPU packed micro-batches of ragged rows train 1.85x faster than padded ones, and
  a larger budget takes fewer passes; on a CPU packing does not pay (measured), so the rows stay padded.

Checkpointing off comes first: a run takes it with the smallest packed budget before it takes checkpointing on with
a larger one. A GPU's budget is :data:`GPU_BUDGET` of its memory (the plan is within 10% of measured peaks, and the
run has the GPU to itself); a CPU's is ``train.auto_cpu_memory_share`` of the memory free at the start, since the
user shares it with everything else. A key set explicitly is kept. Where nothing fits, the leanest combination is
kept and the memory check refuses the run in one line, as it refuses any other.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torchrl_grpo.config.memory_plan import Device, GiB
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.config.validate import CHECKPOINTING, MICRO_BATCH_TOKENS

GPU_BUDGET = 0.9  # of a GPU's memory


@dataclass(frozen=True)
class Settings:
    """One combination auto may choose."""

    gradient_checkpointing: bool
    micro_batch_tokens: int | None  # None: padded micro-batches of train.optim_batch_size rows

    def describe(self, key: str) -> str:
        if key == CHECKPOINTING:
            return f"gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}"
        return (f"packed micro-batches of {self.micro_batch_tokens} tokens" if self.micro_batch_tokens is not None
                else "padded micro-batches")

    def value(self, key: str) -> bool | int | None:
        return self.gradient_checkpointing if key == CHECKPOINTING else self.micro_batch_tokens


@dataclass(frozen=True)
class Choice:
    """What auto chose for ``keys``, whether it fits the budgets, and why (:meth:`line`, :meth:`table`)."""

    keys: tuple[str, ...]
    settings: Settings
    fits: bool
    tightest: Device            # the device nearest its budget with the chosen settings
    budget: int | None          # that device's budget
    others: dict[str, Device]   # per key: the tightest device with that key's other choice (the rest as chosen)

    def overrides(self) -> dict[str, bool | int | None]:
        return {key: self.settings.value(key) for key in self.keys}

    @property
    def padded_on_a_cpu(self) -> bool:
        """The micro-batch left to auto on a CPU, where packing does not pay: padded, no other choice tried."""
        return MICRO_BATCH_TOKENS in self.keys and self.tightest.name == "cpu"

    def line(self) -> str:
        """What the run starts with, in one line: ``auto: gradient checkpointing off, padded micro-batches (cpu 1.2 of
        its 11.7 GiB budget; gradient checkpointing on: 0.9 GiB; packing does not pay on a CPU)``."""
        chosen = ", ".join(self.settings.describe(key) for key in self.keys)
        why = [f"{self.tightest.name} {self.tightest.total / GiB:.1f} of its {_gib(self.budget)} budget"]
        for key, other in self.others.items():
            why.append(f"{other_choice(self.settings, key).describe(key)}: {other.total / GiB:.1f} GiB")
        if self.padded_on_a_cpu:
            why.append("packing does not pay on a CPU")
        verdict = "" if self.fits else "nothing fits the budget, the leanest kept: "
        return f"auto: {verdict}{chosen} ({'; '.join(why)})"

    def table(self) -> str:
        """One line per key for ``torchrl-grpo plan``: the choice, and the other choice's peak."""
        lines = []
        for key in self.keys:
            other, alternative = self.others.get(key), ""
            if other is not None:
                alternative = f"; {other_choice(self.settings, key).describe(key)}: {other.total / GiB:.2f} GiB"
            if key == MICRO_BATCH_TOKENS and self.padded_on_a_cpu:
                alternative = " (packing does not pay on a CPU)"
            lines.append(f"  {key}={_yaml(self.settings.value(key))}  {self.settings.describe(key)}{alternative}")
        filled = f"{self.tightest.name}'s budget {_gib(self.budget)}, filled to {self.tightest.total / GiB:.2f} GiB"
        head = (f"settings left to auto ({filled}):" if self.fits else
                f"settings left to auto: nothing fits the budget ({filled}), the leanest kept:")
        return "\n".join([head, *lines])


def other_choice(settings: Settings, key: str) -> Settings:
    """``settings`` with ``key``'s other value: checkpointing the other way, padded micro-batches for packed ones
    (for padded ones that is no other choice, and :func:`choose` leaves it out)."""
    if key == CHECKPOINTING:
        return dataclasses.replace(settings, gradient_checkpointing=not settings.gradient_checkpointing)
    return dataclasses.replace(settings, micro_batch_tokens=None)


def candidates(spec: RunSpec) -> list[Settings]:
    """What auto may choose for ``spec``'s keys left to it (:attr:`RunSpec.auto`), fastest first; a key set
    explicitly keeps its value."""
    checkpointing = [False, True] if CHECKPOINTING in spec.auto else [spec.model.gradient_checkpointing]
    if MICRO_BATCH_TOKENS not in spec.auto:
        budgets = [spec.plan.micro_batch_tokens]
    elif spec.placement.train[0] == "cpu":
        budgets = [None]
    else:
        budgets = packed_budgets(spec)
    return [Settings(c, b) for c in checkpointing for b in budgets]


def packed_budgets(spec: RunSpec) -> list[int]:
    """``train.micro_batch_tokens`` values, largest first: from a rank's share of a whole optimizer step (every
    completion at ``inference_model.max_model_len``) down to the least the key admits (the longest row, twice with
    data-parallel ranks), halving."""
    ranks, row = spec.placement.ranks, spec.collect.max_model_len
    least = row * (2 if ranks > 1 else 1)
    rows = -(-spec.plan.micro_batch * spec.plan.accumulation // ranks)
    budget, budgets = max(least, rows * row), []
    while budget > least:
        budgets.append(budget)
        budget //= 2
    return [*budgets, least]


def planned_with(spec: RunSpec, settings: Settings) -> RunSpec:
    """``spec`` as the memory plan reads it with ``settings``."""
    model = dataclasses.replace(spec.model, gradient_checkpointing=settings.gradient_checkpointing)
    plan = dataclasses.replace(spec.plan, micro_batch_tokens=settings.micro_batch_tokens)
    return dataclasses.replace(spec, model=model, plan=plan)


def choose(spec: RunSpec, plan_of: Callable[[RunSpec], list[Device]], budget_of: Callable[[Device], int | None]
           ) -> Choice:
    """The first of :func:`candidates` whose plan (``plan_of``) keeps every device within ``budget_of`` it (None:
    unbounded), else the last (the leanest)."""
    options = candidates(spec)
    plans = {}
    for settings in options:
        plans[settings] = plan_of(planned_with(spec, settings))
        if all(_within(d, budget_of(d)) for d in plans[settings]):
            chosen, fits = settings, True
            break
    else:
        chosen, fits = options[-1], False
    tightest = max(plans[chosen], key=lambda d: _load(d, budget_of(d)))
    others = {}
    for key in spec.auto:
        other = other_choice(chosen, key)
        if other != chosen:
            devices = plans.get(other) or plan_of(planned_with(spec, other))
            others[key] = max(devices, key=lambda d: _load(d, budget_of(d)))
    return Choice(spec.auto, chosen, fits, tightest, budget_of(tightest), others)


def budgets(share_of_free_cpu: float, free_cpu: int) -> Callable[[Device], int | None]:
    """Each device's budget: a GPU's :data:`GPU_BUDGET` of its memory, the CPU's ``share_of_free_cpu`` of
    ``free_cpu`` bytes (the memory free at the start), an unknown GPU none."""
    def budget_of(device: Device) -> int | None:
        if device.name == "cpu":
            return int(share_of_free_cpu * free_cpu)
        return None if device.capacity is None else int(GPU_BUDGET * device.capacity)
    return budget_of


def _within(device: Device, budget: int | None) -> bool:
    return budget is None or device.total <= budget


def _load(device: Device, budget: int | None) -> float:
    return device.total / budget if budget else 0.0


def _gib(budget: int | None) -> str:
    return "unbounded" if budget is None else f"{budget / GiB:.1f} GiB"


def _yaml(value: bool | int | None) -> str:
    return "null" if value is None else str(value).lower()
