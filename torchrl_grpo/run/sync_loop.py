"""The sync GRPO loop (``grpo.py``): collect, prepare and optimize, push the weights to the engine, log;
checkpoint when due. The pieces arrive built (``torchrl_grpo.run.build.build_sync``): a :class:`Collector`, a
:class:`Trainer`, a :class:`RunState`."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.collect.prefetch import Prefetch
from torchrl_grpo.core.errors import RunError
from torchrl_grpo.engines.weight_check import WeightCheck
from torchrl_grpo.run.evaluation import Evaluator
from torchrl_grpo.run.state import RunState
from torchrl_grpo.run.stop_request import StopRequest
from torchrl_grpo.telemetry.recorder import Telemetry
from torchrl_grpo.training.trainer import Trainer


@dataclass
class SyncRun:
    collector: Collector
    trainer: Trainer
    state: RunState
    total_steps: int
    evaluator: Evaluator | None = None  # logging.eval_frequency > 0
    overlap: bool = False  # train.sync_iter=false: generate the next batch while this one trains
    weight_check: WeightCheck | None = None  # train.weight_sync_check, unless the engine samples from the policy


def run_sync(run: SyncRun) -> dict:
    """Train until ``total_steps``; returns the end-of-run summary (first vs last steps)."""
    collector, trainer, state, evaluator = run.collector, run.trainer, run.state, run.evaluator
    exact_engine = None if run.overlap else collector.engine  # a prefetching engine samples while we save
    state.restore(trainer, collector.sampler, exact_engine)
    start = state.step
    prefetch = Prefetch(collector, version=state.step) if run.overlap else None
    try:
        with Telemetry(state.config, state.run_dir, run.total_steps, state.step, resumed=state.step > 0) as telemetry:
            if state.step == 0 and evaluator is not None and evaluator.due(0):
                telemetry.record(0, evaluator(collector.engine))
            with StopRequest() as stop:
                for step in range(state.step + 1, run.total_steps + 1):
                    position = copy.deepcopy(prefetch.position if prefetch else collector.sampler)
                    try:
                        metrics, samples = sync_step(run, step, prefetch)
                    except RunError as cause:  # a reward function raised: the last finished step is kept
                        raise state.stopped_by(cause, step - 1, start, trainer, collector.tokenizer, position) from None
                    telemetry.log(step, metrics, samples)
                    fault = run.weight_check.fault if run.weight_check else None
                    stopped = state.after_step(step, run.total_steps, trainer, collector.tokenizer,
                                               prefetch.position if prefetch else collector.sampler, stop.requested,
                                               exact_engine, fault)
                    if stopped:
                        telemetry.print(stopped)
                        break
    finally:
        if prefetch is not None:
            prefetch.close()
    return telemetry.summary(collector.task.reward_names, run.total_steps)


def sync_step(run: SyncRun, step: int, prefetch: Prefetch | None) -> tuple[dict, list[tuple[str, float]]]:
    """Collect, prepare, optimize, push; returns the step's metrics and (completion, reward) samples. With
    ``prefetch`` the next step's generation overlaps this step's scoring and optimizer; the push waits for it."""
    started = time.perf_counter()
    version, sampled = prefetch.next(more=step < run.total_steps) if prefetch else (step - 1, None)
    batch, metrics, texts = run.collector.collect(version, sampled)
    metrics.update(run.trainer.prepare(batch))
    metrics.update(run.trainer.optimize(batch))
    if prefetch:
        metrics["batch_wait_time"] = prefetch.finish()
    push_started = time.perf_counter()
    run.trainer.push_weights(run.collector.engine)
    metrics["weight_push_time"] = time.perf_counter() - push_started
    if run.weight_check is not None:  # before the next generation (a prefetch starts it in the next step)
        check_started = time.perf_counter()
        metrics["weight_sync_gap"] = run.weight_check.after_push(run.collector.engine)
        metrics["weight_check_time"] = time.perf_counter() - check_started
    if prefetch:
        prefetch.version = step
    metrics.update({"policy_version": version, "staleness": step - 1 - version,
                    "step_time": time.perf_counter() - started})
    if run.evaluator is not None and run.evaluator.due(step):
        metrics.update(run.evaluator(run.collector.engine))
    return metrics, list(zip(texts, batch["reward"].tolist()))
