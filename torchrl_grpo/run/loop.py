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

from tensordict import TensorDict

from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.core.batch import Batch
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
    columns = {"reward": batch[Batch.REWARD].tolist(), "advantage": batch[Batch.ADVANTAGE].tolist(),
               **{f"reward/{name}": values.tolist() for name, values in batch[Batch.REWARDS].items()}}
    return [{**sample, **{key: values[i] for key, values in columns.items()}}
            for i, sample in enumerate(delivery.samples)]


@dataclass
class Delivery:
    """A batch from a source: the scored batch, its collection metrics, each completion's prompt and completion
    texts, the policy version that sampled it, when the step's clock started, and what the source keeps for
    :meth:`finish`."""

    batch: TensorDict  # keys: torchrl_grpo.core.batch.Batch
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
    run.state.restore(run.trainer, run.source.position, run.source.exact_engine)
    with contextlib.ExitStack() as stack:
        loop = Loop.started(run, stack)
        try:
            for step in range(loop.start + 1, run.total_steps + 1):
                if not loop.step(step):
                    break
        except NotWritten as err:  # a full disk: every checkpoint before this one is whole
            raise NotWritten(f"{err}; stopped: free some space, then {run.state.continue_hint()}") from None
    return loop.telemetry.summary(run.source.reward_names, run.total_steps)


@dataclass
class Loop:
    """What the loop holds while it trains: the run, the step it resumed after, its telemetry, the stop request,
    the memory probe and the engine evaluations sample with."""

    run: Run
    start: int
    telemetry: Telemetry
    stop: StopRequest
    memory: MemoryProbe
    eval_engine: object

    @classmethod
    def started(cls, run: Run, stack: contextlib.ExitStack) -> Loop:
        """The source started (and stopped by ``stack``), telemetry and the stop request entered, the evaluation
        before the first step done when due, then the source's own start-up checks; a source that cannot start
        stops the run with one line."""
        source, trainer, state, evaluator = run.source, run.trainer, run.state, run.evaluator
        start = state.step
        try:
            stack.enter_context(source.running(state, trainer, run.total_steps))
        except source.faults as cause:  # the source could not start
            raise state.stopped_by(cause, start, start, trainer, source.tokenizer, source.position) from None
        telemetry = stack.enter_context(Telemetry(run.spec.logging, run.spec.config, state.run_dir,
                                                  run.total_steps, start, resumed=start > 0))
        stop = stack.enter_context(StopRequest())
        memory = MemoryProbe(cuda_devices(trainer.policy, trainer.critic and trainer.critic.model),
                             cuda_devices(trainer.ref_policy), source.engine_devices, source.engine_held)
        loop = cls(run, start, telemetry, stop, memory, source.eval_engine(trainer) if evaluator is not None else None)
        if start == 0 and evaluator is not None and evaluator.due(0):
            telemetry.record(0, evaluator(loop.eval_engine))
        try:
            source.ready()
        except source.faults as cause:
            raise loop.stopped_by(cause, start, source.position) from None
        return loop

    def step(self, step: int) -> bool:
        """Take the batch, prepare and optimize it, let the source finish the step (its push) and evaluate when
        due, log it, checkpoint when due; False once the run stops."""
        source, trainer, evaluator = self.run.source, self.run.trainer, self.run.evaluator
        position = source.saved_position()
        try:
            delivery = source.take(step)
        except Exception as cause:  # the trainer holds the update of the step before
            self.telemetry.print(self.after_error(cause, step - 1, position))
            return False
        metrics = delivery.metrics
        metrics.update(trainer.prepare(delivery.batch))
        metrics.update(trainer.optimize(delivery.batch))
        try:
            metrics.update(source.finish(step, delivery, self.stop.requested))
            if evaluator is not None and evaluator.due(step):
                metrics.update(evaluator(self.eval_engine))
        except Exception as cause:  # the trainer holds this step's update
            self.telemetry.print(self.after_error(
                cause, step, source.position, keep=lambda: self.telemetry.log(step, metrics, scored_samples(delivery))))
            return False
        metrics.update(self.memory.read())
        self.telemetry.log(step, metrics, scored_samples(delivery))
        return self.goes_on(step, metrics)

    def goes_on(self, step: int, metrics: dict) -> bool:
        """After a logged step: the no-signal watch's warning, then the checkpoint when due; False (its line
        printed) when the run stops here: done, asked to, a weight sync fault or no signal for too long."""
        source, trainer, state = self.run.source, self.run.trainer, self.run.state
        warning = trainer.no_signal.observe(metrics)
        if warning and not trainer.no_signal.stop:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        stopped = state.after_step(step, self.run.total_steps, trainer, source.tokenizer, source.position,
                                   lambda: self.stop.requested, source.exact_engine,
                                   source.fault or trainer.no_signal.stop_reason(metrics))
        if stopped:
            self.telemetry.print(stopped)
        return not stopped

    def stopped_by(self, cause, last_step: int, position):
        return self.run.state.stopped_by(cause, last_step, self.start, self.run.trainer, self.run.source.tokenizer,
                                         position)

    def after_error(self, cause: Exception, last_step: int, position, keep=lambda: None) -> str:
        """Called while handling an error of the source, the trainer holding ``last_step``'s update: after a stop
        request, ``keep()`` then the stop's checkpoint and line (the signal ended the engine's or actors' processes
        too); otherwise a fault stops the run with a checkpoint, and any other error goes on up."""
        if not self.stop.requested:
            if isinstance(cause, self.run.source.faults):
                raise self.stopped_by(cause, last_step, position) from None
            raise
        keep()
        return self.run.state.stopped_early(last_step, self.start, self.run.trainer, self.run.source.tokenizer,
                                            position)
