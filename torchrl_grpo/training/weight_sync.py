"""The trainer's weights into the engines that sample, verified and timed: one protocol, :class:`WeightSync`, whose
:meth:`~WeightSync.push` decides whether there is anything to push (the trainer updated since the last one), sends,
verifies and times it (``weight_push_time``, ``weight_check_time``; the gap is ``weight_sync_gap``), with one
implementation per destination:

- :class:`EngineSync`: an engine of this process (in place, or in its own process over a collective or the
  /dev/shm stream: the engine's transport, :mod:`torchrl_grpo.engines.transports`; data-parallel ranks feed
  either from their shards, tensor by tensor), checked here after each push.
- :class:`ActorSync`: Ray rollout actors, as numbered policy versions (their transports:
  :mod:`torchrl_grpo.collect.actor_weights`), each actor checking itself.

Both check with ``train.weight_sync_check``'s probe (:class:`~torchrl_grpo.engines.weight_check.WeightCheck`), and
send what :class:`PolicyWeights` exports of the trained policy.
"""
from __future__ import annotations

import time

import torch

from torchrl_grpo.engines.weight_check import Probe, WeightCheck, probe_log_probs
from torchrl_grpo.engines.weight_stream import StreamedWeights, wire_dtype
from torchrl_grpo.models.adapter import Adapter, adapter_config, adapter_weights
from torchrl_grpo.models.loading import merged_state_dict, merged_weights
from torchrl_grpo.parallel.ranks import DataParallel, collective, gathered
from torchrl_grpo.training.trainer import Trainer


class PolicyWeights:
    """The trained policy's weights as engines take them: whole and HF-named (LoRA merged in), the LoRA adapter, and
    the weight check's probe under the policy. Data-parallel (``parallel``), each is gathered from the shards with
    every rank taking part: its methods are :func:`~torchrl_grpo.parallel.ranks.collective`."""

    def __init__(self, policy: torch.nn.Module, parallel: DataParallel | None = None):
        self.policy, self.parallel = policy, parallel

    @collective
    def weights(self) -> dict[str, torch.Tensor] | StreamedWeights:
        """The policy's HF-named weights (LoRA merged in): what an engine loads. Data-parallel: on rank 0 each
        is gathered from the shards when the consumer reaches it (:class:`StreamedWeights`: read them once, to
        the end), while the other ranks gather them all in step and keep none (an empty dict)."""
        if self.parallel is None:
            return merged_state_dict(self.policy)
        if self.parallel.rank == 0:
            return StreamedWeights(list(merged_weights(self.policy, shapes_only=True)), merged_weights(self.policy))
        return gathered(merged_weights(self.policy), keep=False)

    @collective
    def adapter(self) -> Adapter | None:
        """The policy's LoRA adapter (``train_model.lora.sync=adapter``: what an engine loads beside its base weights),
        as CPU tensors (on a CPU, the live ones: read them before the next update). Data-parallel: gathered from the
        shards on every rank in step, kept on rank 0 (None on the others)."""
        keep = self.parallel is None or self.parallel.rank == 0
        tensors = gathered(adapter_weights(self.policy), keep=keep)
        return Adapter(adapter_config(self.policy), tensors) if keep else None

    @collective
    def probe_log_probs(self, token_ids: list[int]) -> torch.Tensor:
        """The weight sync check's probe under the policy (:func:`probe_log_probs`)."""
        return probe_log_probs(self.policy, token_ids)


def samples_with_policy(trainer: Trainer, engine) -> bool:
    """Whether ``engine`` samples with the trainer's very policy object (the transformers engine built on the
    trained model): it never needs a push, nor a check that one landed."""
    return getattr(engine, "model", None) is trainer.policy


def snapshot(export: PolicyWeights, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The trainer's weights (:meth:`PolicyWeights.weights`) as CPU tensors of their own, for engines in other processes
    (rollout actors get them while the trainer goes on); floating-point matrices in ``dtype`` (the engines') when
    given (:func:`~torchrl_grpo.engines.weight_stream.wire_dtype`): an engine casts what it loads to its dtype anyway,
    so float32 master weights sent cast to bf16 give it the same weights in half the bytes."""
    return {name: t.detach().to("cpu", wire_dtype(t, dtype), copy=True) for name, t in export.weights().items()}


class WeightSync:
    """What the loop's batch sources call: :meth:`resume` (the engines start from the base weights: give them the
    checkpoint's), :meth:`startup` (the start-up check's line), :meth:`push` (after a step) and :attr:`fault`. A
    subclass says how to send (:meth:`_send`) and what a push's check measured (:meth:`_verify`)."""

    fault: str | None = None  # why the last check found an engine without the trainer's weights (None: fine)

    def __init__(self, trainer: Trainer, check: WeightCheck | None = None):
        self.trainer, self.check = trainer, check
        self.export = PolicyWeights(trainer.policy, trainer.parallel)
        self.pushed = trainer.updates  # the trainer's update count the engines' weights are from

    @property
    def changed(self) -> bool:
        """Whether the trainer updated the weights since the engines got them: a step that took no update (every
        optimizer step without signal, or skipped) leaves nothing to push."""
        return self.trainer.updates != self.pushed

    def _due(self) -> bool:
        return self.changed

    def push(self, version: int) -> dict:
        """The trainer's weights as policy ``version``, then checked: the step's metrics ({} when nothing was due)."""
        if not self._due():
            return {}
        return self._push_checked(version)

    def _push_checked(self, version: int) -> dict:
        started = time.perf_counter()
        self._sync(version)
        return {"weight_push_time": time.perf_counter() - started, **self._verify()}

    def _sync(self, version: int) -> None:
        """Send the trainer's weights as policy ``version``; the engines then hold its current update."""
        self._send(version)
        self.pushed = self.trainer.updates

    def _send(self, version: int) -> None:
        raise NotImplementedError

    def _verify(self) -> dict:
        return {}


class EngineSync(WeightSync):
    """The trainer's weights into ``engine`` after each update (nothing to push into an engine that
    :func:`samples_with_policy`: build no ``check`` for it); with ``adapter`` (``train_model.lora.sync=adapter``)
    the LoRA adapter only."""

    def __init__(self, trainer: Trainer, engine, check: WeightCheck | None = None, adapter: bool = False):
        super().__init__(trainer, check)
        self.engine, self.adapter = engine, adapter

    def resume(self) -> None:
        self._sync(0)

    def resend(self) -> dict:
        """The trainer's current weights into a new engine (one that replaced a dead one), checked: the metrics."""
        return self._push_checked(0)

    def startup(self) -> str | None:
        """The engine as started against the trainer: the line to print (None without a check)."""
        return None if self.check is None else self.check.startup(self.engine)

    def _due(self) -> bool:
        """Also when the engine dropped its weights while it slept."""
        return self.changed or self.engine.needs_weights

    def _send(self, version: int) -> None:
        if samples_with_policy(self.trainer, self.engine):
            return
        if self.adapter:
            self.engine.push_adapter(self.export.adapter())
        else:
            self.engine.push_weights(self.export.weights())

    def _verify(self) -> dict:
        """Checked here, before the next generation."""
        if self.check is None:
            return {}
        started = time.perf_counter()
        gap = self.check.after_push(self.engine)
        return {"weight_sync_gap": gap, "weight_check_time": time.perf_counter() - started}

    @property
    def fault(self) -> str | None:
        return None if self.check is None else self.check.fault


class ActorSync(WeightSync):
    """The trainer's weights to the actors of an :class:`~torchrl_grpo.collect.rollout_actors.ActorPool`
    (:meth:`attach`), cast to their engines' ``engine_dtype`` (an engine casts what it loads anyway: half the bytes
    for bf16 engines); with ``adapter`` the LoRA adapter only. Each actor checks itself after a push (a failed check
    is a RunError there): the gaps land later (:meth:`landed`)."""

    def __init__(self, trainer: Trainer, check: WeightCheck | None = None, engine_dtype: torch.dtype | None = None,
                 adapter: bool = False):
        super().__init__(trainer, check)
        self.engine_dtype, self.adapter, self.pool = engine_dtype, adapter, None

    def attach(self, pool) -> None:
        self.pool = pool

    def resume(self) -> None:
        """The checkpoint's weights to the actors, landed before their first collect."""
        self._sync(self.pool.version)
        self.pool.settle_pushes()

    def startup(self) -> str | None:
        """Actor 0's engine as started against the trainer (after its first collect): the line to print."""
        return None if self.check is None else self.check.startup(self.pool)

    def _send(self, version: int) -> None:
        weights = self.export.adapter() if self.adapter else snapshot(self.export, self.engine_dtype)
        self.pool.push(weights, version, self._probe())

    def landed(self) -> dict:
        """The largest gap of the pushes that landed since the last call, when any did."""
        gap = self.pool.pop_weight_sync_gap()
        return {} if gap is None else {"weight_sync_gap": gap}

    def _probe(self) -> Probe | None:
        return None if self.check is None else self.check.probe()
