"""The settings that trade memory for speed, chosen when set to ``auto``: the fastest combination whose memory plan
(:mod:`~torchrl_grpo.config.memory_plan`) fits every device within its budget, before anything is loaded.

Faster first, by what each is measured to buy (docs/benchmarks.md):

* ``train_model.gradient_checkpointing``: off trains 22-28% faster on an H200 and 5-10% faster on a CPU, for every
  layer's activations instead of one layer's;
* ``train.micro_batch_tokens``: on a GPU packed micro-batches of ragged rows train 1.85x faster than padded ones, and
  a larger budget takes fewer passes; on a CPU packing does not pay (measured), so the rows stay padded;
* ``train.log_prob_chunk_mib``: on a GPU the whole micro-batch's logits at once train 3.7% faster than chunks of
  1/128 of its memory, for up to four times the logits' memory; on a CPU chunks cost nothing (measured): the default;
* ``inference_model.gpu_memory_utilization``: the engine takes what the budget leaves beside the others (more KV
  cache: more sequences at once), at least its weights, a step's sequences and its working memory; with
  ``inference_model.sleep=auto`` it stays awake while the trainer trains where that fits (no sleep and wake a step),
  else sleeps and gives its memory to the trainer meanwhile.

Checkpointing off comes first: a run takes it with the smallest packed budget before it takes checkpointing on with
a larger one; the chunk counts least and the engine's sleep after it. A GPU's budget is :data:`GPU_BUDGET` of its
memory (the plan is within 10% of measured peaks, and the run has the GPU to itself); a CPU's is
``train.auto_cpu_memory_share`` of the memory free at the start, since the user shares it with everything else. A key
set explicitly is kept. Where nothing fits, the leanest combination is kept and the memory check refuses the run in
one line, as it refuses any other.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torchrl_grpo.config.memory_plan import FLOAT32, Device, GiB
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.config.validate import (
    CHECKPOINTING,
    ENGINE_SHARE,
    LOG_PROB_CHUNK,
    MICRO_BATCH_TOKENS,
    SLEEP,
    UNSETTLED_ENGINE_SHARE,
)

GPU_BUDGET = 0.9  # of a GPU's memory
SHARE_STEP = 100  # the engine's share is chosen in hundredths of its GPU


@dataclass(frozen=True)
class Settings:
    """One combination auto may choose; ``sleep`` and ``gpu_memory_utilization`` None: the spec's own."""

    gradient_checkpointing: bool
    micro_batch_tokens: int | None  # None: padded micro-batches of train.optim_batch_size rows
    log_prob_chunk_mib: int | None = None  # None: the device's default chunk
    sleep: int | None = None
    gpu_memory_utilization: float | None = None

    def describe(self, key: str) -> str:
        if key == CHECKPOINTING:
            return f"gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}"
        if key == MICRO_BATCH_TOKENS:
            return (f"packed micro-batches of {self.micro_batch_tokens} tokens" if self.micro_batch_tokens is not None
                    else "padded micro-batches")
        if key == LOG_PROB_CHUNK:
            return ("the device's log-prob chunk" if self.log_prob_chunk_mib is None else
                    f"log-prob chunks of {self.log_prob_chunk_mib} MiB (a micro-batch's logits at once)")
        if key == SLEEP:
            return f"the engine asleep while training (level {self.sleep})" if self.sleep else \
                "the engine awake while training"
        if self.gpu_memory_utilization is None:
            return "no vLLM engine on a GPU to share"
        return f"the engine's share {self.gpu_memory_utilization:.2f} of its GPU"

    def value(self, key: str) -> bool | int | float | None:
        share = UNSETTLED_ENGINE_SHARE if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        return {CHECKPOINTING: self.gradient_checkpointing, MICRO_BATCH_TOKENS: self.micro_batch_tokens,
                LOG_PROB_CHUNK: self.log_prob_chunk_mib, SLEEP: self.sleep, ENGINE_SHARE: share}[key]


@dataclass(frozen=True)
class Choice:
    """What auto chose for ``keys``, whether it fits the budgets, and why (:meth:`line`, :meth:`table`)."""

    keys: tuple[str, ...]
    settings: Settings
    fits: bool
    tightest: Device            # the device nearest its budget with the chosen settings
    budget: int | None          # that device's budget
    others: dict[str, tuple[Settings, Device]]  # per key: its other choice and the tightest device with it

    def overrides(self) -> dict[str, bool | int | float | None]:
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
        for key, (other, device) in self.others.items():
            why.append(f"{other.describe(key)}: {device.total / GiB:.1f} GiB")
        if self.padded_on_a_cpu:
            why.append("packing does not pay on a CPU")
        verdict = "" if self.fits else "nothing fits the budget, the leanest kept: "
        return f"auto: {verdict}{chosen} ({'; '.join(why)})"

    def table(self) -> str:
        """One line per key for ``torchrl-grpo plan``: the choice, and the other choice's peak."""
        lines = []
        for key in self.keys:
            alternative = ""
            if key in self.others:
                other, device = self.others[key]
                alternative = f"; {other.describe(key)}: {device.total / GiB:.2f} GiB"
            if key == MICRO_BATCH_TOKENS and self.padded_on_a_cpu:
                alternative = " (packing does not pay on a CPU)"
            lines.append(f"  {key}={_yaml(self.settings.value(key))}  {self.settings.describe(key)}{alternative}")
        filled = f"{self.tightest.name}'s budget {_gib(self.budget)}, filled to {self.tightest.total / GiB:.2f} GiB"
        head = (f"settings left to auto ({filled}):" if self.fits else
                f"settings left to auto: nothing fits the budget ({filled}), the leanest kept:")
        return "\n".join([head, *lines])


def other_choice(spec: RunSpec, settings: Settings, key: str, vocab: int) -> Settings | None:
    """``settings`` with ``key``'s other value, None where there is none to compare: checkpointing the other way,
    padded micro-batches for packed ones, the device's chunk for a micro-batch's whole and back, the other sleep
    (the engine's share has no single other value)."""
    if key == CHECKPOINTING:
        other = dataclasses.replace(settings, gradient_checkpointing=not settings.gradient_checkpointing)
    elif key == MICRO_BATCH_TOKENS:
        other = dataclasses.replace(settings, micro_batch_tokens=None)
    elif key == LOG_PROB_CHUNK:
        whole = whole_chunk_mib(spec, settings.micro_batch_tokens, vocab)
        other = dataclasses.replace(settings, log_prob_chunk_mib=None if settings.log_prob_chunk_mib else whole)
    elif key == SLEEP:
        other = dataclasses.replace(settings, sleep=spec.engine.sleep if not settings.sleep else 0)
    else:
        return None
    return None if other == settings else other


def candidates(spec: RunSpec, vocab: int) -> list[Settings]:
    """What auto may choose for ``spec``'s keys left to it (:attr:`RunSpec.auto`), fastest first, the engine's share
    still open; a key set explicitly keeps its value. ``vocab``: the model's, which sizes a micro-batch's logits."""
    auto, on_gpu = spec.auto, spec.placement.train[0].startswith("cuda")
    checkpointing = [False, True] if CHECKPOINTING in auto else [spec.model.gradient_checkpointing]
    if MICRO_BATCH_TOKENS not in auto:
        budgets = [spec.plan.micro_batch_tokens]
    else:
        budgets = packed_budgets(spec) if on_gpu else [None]
    # the rule's level (config/vllm_releases.py choose_sleep) where the engine could sleep, awake first
    sleeps = ([0, spec.engine.sleep] if spec.engine.sleep else [0]) if SLEEP in auto else [None]
    options = []
    for c in checkpointing:
        for b in budgets:
            if LOG_PROB_CHUNK not in auto:
                chunks = [spec.plan.log_prob_chunk_mib]
            else:
                chunks = [whole_chunk_mib(spec, b, vocab), None] if on_gpu else [None]
            options += [Settings(c, b, chunk, sleep) for chunk in chunks for sleep in sleeps]
    return options


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


def whole_chunk_mib(spec: RunSpec, micro_batch_tokens: int | None, vocab: int) -> int:
    """MiB of float32 logits that hold a rank's whole micro-batch in one chunk: its completion tokens at most, each
    completion ``inference_model.max_tokens`` long (a packed one holds at most a rank's share of an optimizer step's
    completions, and no more tokens than its budget)."""
    plan = spec.plan
    rows = plan.micro_batch if micro_batch_tokens is None else plan.micro_batch * plan.accumulation
    tokens = -(-rows // spec.placement.ranks) * plan.max_tokens
    if micro_batch_tokens is not None:
        tokens = min(micro_batch_tokens, tokens)
    return -(-tokens * vocab * FLOAT32 // (1 << 20))


def planned_with(spec: RunSpec, settings: Settings) -> RunSpec:
    """``spec`` as the memory plan reads it with ``settings`` (a rollout actor's engine takes its share of the
    engine's share of its GPU)."""
    model = dataclasses.replace(spec.model, gradient_checkpointing=settings.gradient_checkpointing)
    plan = dataclasses.replace(spec.plan, micro_batch_tokens=settings.micro_batch_tokens,
                               log_prob_chunk_mib=settings.log_prob_chunk_mib)
    engine = spec.engine
    if settings.sleep is not None:
        engine = dataclasses.replace(engine, sleep=settings.sleep)
    if settings.gpu_memory_utilization is not None:
        actors = spec.placement.actors
        engine = dataclasses.replace(engine, gpu_memory_utilization=settings.gpu_memory_utilization * (
            1.0 if actors is None else actors.memory_share))
    return dataclasses.replace(spec, model=model, plan=plan, engine=engine)


def with_engine_share(spec: RunSpec, settings: Settings, plan_of: Callable[[RunSpec], list[Device]],
                      budget_of: Callable[[Device], int | None]) -> tuple[Settings, list[Device], bool]:
    """``settings`` with the engine's share left to auto: the largest (in hundredths, at most :data:`GPU_BUDGET`)
    whose plan fits every device within its budget, where every engine then holds what it wants (its weights, a
    step's sequences at once and its working memory); where none does, the least that holds it (the plan then says
    by how much it is over). With the share fixed, that plan. Returns the settings, their plan and whether it fits."""
    def fits(devices: list[Device]) -> bool:
        return all(_within(d, budget_of(d)) for d in devices)

    if ENGINE_SHARE not in spec.auto or not engine_on_gpu(spec):
        devices = plan_of(planned_with(spec, settings))
        return settings, devices, fits(devices)

    def at(hundredths: int) -> tuple[Settings, list[Device]]:
        chosen = dataclasses.replace(settings, gpu_memory_utilization=hundredths / SHARE_STEP)
        return chosen, plan_of(planned_with(spec, chosen))

    def wanted(devices: list[Device]) -> bool:
        return all(r.bytes >= r.wants for d in devices for r in d.roles)

    top = int(GPU_BUDGET * SHARE_STEP)
    # both grow with the share: the least share an engine wants, the largest that fits, each found by halves
    need = _first(1, top, lambda h: wanted(at(h)[1]))
    most = _first(1, top, lambda h: not fits(at(h + 1)[1])) if fits(at(1)[1]) else 0
    if most and most >= need:
        return *at(most), True
    return *at(need), False


def _first(low: int, high: int, holds: Callable[[int], bool]) -> int:
    """The least of ``low..high`` where ``holds`` (false below it, true from it on), else ``high``."""
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    return low


def engine_on_gpu(spec: RunSpec) -> bool:
    """Whether the run's vLLM engines (the rollout actors' in async mode) take a share of a GPU."""
    if spec.engine.backend != "vllm":
        return False
    actors = spec.placement.actors
    return any(d.startswith("cuda") for d in (spec.placement.inference if actors is None else actors.devices))


def choose(spec: RunSpec, plan_of: Callable[[RunSpec], list[Device]], budget_of: Callable[[Device], int | None],
           vocab: int) -> Choice:
    """The first of :func:`candidates` whose plan (``plan_of``) keeps every device within ``budget_of`` it (None:
    unbounded), with the engine's share :func:`with_engine_share` gives it, else the last (the leanest)."""
    plans = {}
    for chosen in candidates(spec, vocab):  # the loop's last: the first that fits, else the leanest
        settings, plans[chosen], fits = with_engine_share(spec, chosen, plan_of, budget_of)
        if fits:
            break
    tightest = max(plans[chosen], key=lambda d: _load(d, budget_of(d)))
    others = {}
    for key in spec.auto:
        other = other_choice(spec, chosen, key, vocab)
        if other is not None:  # beside the engine's share as chosen
            devices = plan_of(planned_with(spec, dataclasses.replace(
                other, gpu_memory_utilization=settings.gpu_memory_utilization)))
            others[key] = (other, max(devices, key=lambda d: _load(d, budget_of(d))))
    return Choice(spec.auto, settings, fits, tightest, budget_of(tightest), others)


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
