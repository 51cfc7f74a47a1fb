"""The one GRPO loop, for ``grpo.py`` (sync, and ``train.sync_iter=false``) and ``grpo-async.py``: take a batch
from a source, prepare and optimize it, let the source sync the new weights, log, checkpoint when due.

What differs between the modes is the :class:`BatchSource` (:mod:`torchrl_grpo.run.sources`): the collector in
this process, that collector generating the next batch while this one trains, or Ray rollout actors. Everything
else is written once here: resume, telemetry, stop requests, evaluation, checkpoints, faults.

Faults: a source names the errors after which the run cannot go on but its last finished step can be kept
(:attr:`BatchSource.faults`: a reward function that raised in this process; a Ray actor that died or hung).
Such an error stops the run with one line after a checkpoint of the last step whose update the trainer holds.
After a stop request (SIGINT, SIGTERM) any error of the source is taken as the signal having reached its
processes too (a scheduler's preemption signals every process of the job): the run stops as asked, keeping the
last step the trainer holds.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.core.files import NotWritten
from torchrl_grpo.run.evaluation import Evaluator
from torchrl_grpo.run.state import RunState
from torchrl_grpo.run.stop_request import StopRequest
from torchrl_grpo.telemetry.hardware import MemoryProbe, cuda_devices
from torchrl_grpo.telemetry.recorder import Telemetry
from torchrl_grpo.training.trainer import Trainer


def scored_samples(delivery: Delivery) -> list[dict]:
    """Each completion of the step for the samples file: its prompt and completion texts, total reward, advantage
    and each reward component (NaN where it did not apply)."""
    batch = delivery.batch
    columns = {"reward": batch["reward"].tolist(), "advantage": batch["advantage"].tolist(),
               **{f"reward/{name}": values.tolist() for name, values in batch["rewards"].items()}}
    return [{**sample, **{key: values[i] for key, values in columns.items()}}
            for i, sample in enumerate(delivery.samples)]


@dataclass
class Delivery:
    """A batch from a source: the scored batch, its collection metrics, each completion's prompt and completion
    texts, the policy version that sampled it, when the step's clock started, and what the source keeps for
    :meth:`finish`."""

    batch: object
    metrics: dict
    samples: list[dict]
    version: int
    started: float
    extra: dict = field(default_factory=dict)


class BatchSource(Protocol):
    """What the loop takes batches from and hands new weights to (:mod:`torchrl_grpo.run.sources`)."""

    faults: tuple[type[BaseException], ...]  # errors that stop the run keeping the last finished step
    reward_names: list[str]
    tokenizer: object
    exact_engine: object  # an engine whose sampling state a checkpoint keeps (None: nothing samples exactly)
    engine_devices: Sequence  # the devices of the engine this process drives, whose memory is logged (empty: none)
    engine_held: Mapping  # device -> bytes that engine holds through this process's allocator (in-process on GPUs)

    @property
    def position(self):
        """The data position a checkpoint keeps (``state_dict``/``load_state_dict``)."""

    def saved_position(self):
        """The data position to checkpoint if the next :meth:`take` fails."""

    def running(self, state: RunState, trainer: Trainer, total_steps: int) -> contextlib.AbstractContextManager:
        """Start (after the resume) and stop the source's machinery, for a run of ``total_steps``."""

    def eval_engine(self, trainer: Trainer):
        """The engine evaluations sample with."""

    def ready(self) -> None:
        """After the evaluation before the first step: the source's own start-up checks."""

    def take(self, step: int) -> Delivery:
        """The batch of ``step``."""

    def finish(self, step: int, delivery: Delivery, stopping: bool) -> dict:
        """After the update of ``step``: sync the weights (``stopping``: a stop was asked for, the run ends after
        this step); the step's remaining metrics."""

    @property
    def fault(self) -> str | None:
        """Why the last weight check found an engine without the trainer's weights (None: fine)."""


@dataclass
class Run:
    source: BatchSource
    trainer: Trainer
    state: RunState
    spec: RunSpec
    evaluator: Evaluator | None = None  # logging.eval_frequency > 0

    @property
    def total_steps(self) -> int:
        return self.spec.plan.total_steps


def run_loop(run: Run) -> dict:
    """Train until ``total_steps``; returns the end-of-run summary (first vs last steps)."""
    source, trainer, state, evaluator = run.source, run.trainer, run.state, run.evaluator
    state.restore(trainer, source.position, source.exact_engine)
    start = state.step

    def stopped_by(cause, last_step: int, position):
        return state.stopped_by(cause, last_step, start, trainer, source.tokenizer, position)

    def after_error(cause: Exception, last_step: int, position, keep=lambda: None) -> str:
        """Called while handling an error of the source, the trainer holding ``last_step``'s update: after a stop
        request, ``keep()`` then the stop's checkpoint and line (the signal ended the engine's or actors' processes
        too); otherwise a fault stops the run with a checkpoint, and any other error goes on up."""
        if not stop.requested:
            if isinstance(cause, source.faults):
                raise stopped_by(cause, last_step, position) from None
            raise
        keep()
        return state.stopped_early(last_step, start, trainer, source.tokenizer, position)

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(source.running(state, trainer, run.total_steps))
        except source.faults as cause:  # the source could not start
            raise stopped_by(cause, start, source.position) from None
        telemetry = stack.enter_context(Telemetry(run.spec.logging, run.spec.config, state.run_dir,
                                                  run.total_steps, start, resumed=start > 0))
        stop = stack.enter_context(StopRequest())
        memory = MemoryProbe(cuda_devices(trainer.policy, trainer.critic and trainer.critic.model),
                             cuda_devices(trainer.ref_policy), source.engine_devices, source.engine_held)
        eval_engine = source.eval_engine(trainer) if evaluator is not None else None
        if start == 0 and evaluator is not None and evaluator.due(0):
            telemetry.record(0, evaluator(eval_engine))
        try:
            source.ready()
        except source.faults as cause:
            raise stopped_by(cause, start, source.position) from None
        try:
            for step in range(start + 1, run.total_steps + 1):
                position = source.saved_position()
                try:
                    delivery = source.take(step)
                except Exception as cause:  # the trainer holds the update of the step before
                    telemetry.print(after_error(cause, step - 1, position))
                    break
                metrics = delivery.metrics
                metrics.update(trainer.prepare(delivery.batch))
                metrics.update(trainer.optimize(delivery.batch))
                try:
                    metrics.update(source.finish(step, delivery, stop.requested))
                    if evaluator is not None and evaluator.due(step):
                        metrics.update(evaluator(eval_engine))
                except Exception as cause:  # the trainer holds this step's update
                    telemetry.print(after_error(cause, step, source.position,
                                                keep=lambda: telemetry.log(step, metrics, scored_samples(delivery))))
                    break
                metrics.update(memory.read())
                telemetry.log(step, metrics, scored_samples(delivery))
                warning = trainer.no_signal.observe(metrics)
                if warning and not trainer.no_signal.stop:
                    print(f"warning: {warning}", file=sys.stderr, flush=True)
                stopped = state.after_step(step, run.total_steps, trainer, source.tokenizer, source.position,
                                           lambda: stop.requested, source.exact_engine,
                                           source.fault or trainer.no_signal.stop_reason(metrics))
                if stopped:
                    telemetry.print(stopped)
                    break
        except NotWritten as err:  # a full disk: every checkpoint before this one is whole
            raise NotWritten(f"{err}; stopped: free some space, then {state.continue_hint()}") from None
    return telemetry.summary(source.reward_names, run.total_steps)
