"""The trainer's weights into the engines that sample, verified and timed: the one place a push happens.

:class:`EngineSync`: an engine in this process (it takes the tensors) or in its own process (over a collective,
:mod:`torchrl_grpo.engines.weight_transfer`, or the /dev/shm stream of :mod:`torchrl_grpo.engines.weight_stream`;
data-parallel ranks feed either from their shards, tensor by tensor),
checked here after each push. :class:`ActorSync`: Ray rollout actors, through the object store as numbered
policy versions, each actor checking itself. Both check with ``train.weight_sync_check``'s probe
(:class:`~torchrl_grpo.engines.weight_check.WeightCheck`), and time what they do (``weight_push_time``,
``weight_check_time``; the gap is ``weight_sync_gap``).
"""
from __future__ import annotations

import time

import torch

from torchrl_grpo.engines.weight_check import Probe, WeightCheck
from torchrl_grpo.training.trainer import Trainer


class _Pushes:
    """The trainer's update count that the engines' weights are from (``pushed``): a step that took no update
    (every optimizer step without signal, or skipped) leaves nothing to push."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.pushed = trainer, trainer.updates

    @property
    def changed(self) -> bool:
        """Whether the trainer updated the weights since the engines got them."""
        return self.trainer.updates != self.pushed

    def _sent(self) -> None:
        self.pushed = self.trainer.updates


class EngineSync(_Pushes):
    """The trainer's weights into ``engine`` after each update (nothing to push into an engine that samples
    with the policy itself: build no ``check`` for it)."""

    def __init__(self, trainer: Trainer, engine, check: WeightCheck | None = None):
        super().__init__(trainer)
        self.engine, self.check = engine, check

    def resume(self) -> None:
        """The engine started from the base weights: give it the checkpoint's."""
        self.trainer.push_weights(self.engine)
        self._sent()

    def startup(self) -> str | None:
        """The engine as started against the trainer: the line to print (None without a check)."""
        return None if self.check is None else self.check.startup(self.engine)

    def push(self) -> dict:
        """Push, then check (before the next generation); the step's metrics. A step that took no update (every
        optimizer step without signal, or skipped) left the weights as the engine has them: nothing to push, unless
        the engine dropped them while it slept."""
        if not self.changed and not self.engine.needs_weights:
            return {}
        started = time.perf_counter()
        self.trainer.push_weights(self.engine)
        self._sent()
        metrics = {"weight_push_time": time.perf_counter() - started}
        if self.check is not None:
            started = time.perf_counter()
            metrics["weight_sync_gap"] = self.check.after_push(self.engine)
            metrics["weight_check_time"] = time.perf_counter() - started
        return metrics

    @property
    def fault(self) -> str | None:
        """Why the last check found the engine without the trainer's weights (None: fine)."""
        return None if self.check is None else self.check.fault


class ActorSync(_Pushes):
    """The trainer's weights to the actors of an :class:`~torchrl_grpo.collect.rollout_actors.ActorPool`, cast to
    their engines' ``engine_dtype`` (an engine casts what it loads anyway: half the bytes for bf16 engines)."""

    fault = None  # each actor checks itself after a push: a failed check is a RunError there

    def __init__(self, trainer: Trainer, check: WeightCheck | None = None, engine_dtype: torch.dtype | None = None):
        super().__init__(trainer)
        self.check, self.engine_dtype = check, engine_dtype

    def resume(self) -> tuple[dict, Probe | None]:
        """The checkpoint's weights (and their probe) for actors that start from the base weights."""
        self._sent()
        return self.trainer.cpu_weights(self.engine_dtype), self._probe()

    def startup(self, pool) -> str | None:
        """Actor 0's engine as started against the trainer (after its first collect): the line to print."""
        return None if self.check is None else self.check.startup(pool)

    def push(self, pool, version: int) -> dict:
        """The weights to every actor as policy ``version``; the seconds it took to send them."""
        started = time.perf_counter()
        pool.push(self.trainer.cpu_weights(self.engine_dtype), version, self._probe())
        self._sent()
        return {"weight_push_time": time.perf_counter() - started}

    def landed(self, pool) -> dict:
        """The largest gap of the pushes that landed since the last call, when any did."""
        gap = pool.pop_weight_sync_gap()
        return {} if gap is None else {"weight_sync_gap": gap}

    def _probe(self) -> Probe | None:
        return None if self.check is None else self.check.probe()
