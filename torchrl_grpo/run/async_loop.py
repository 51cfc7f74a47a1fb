"""The async GRPO loop (``grpo-async.py``): Ray rollout actors collect while the trainer optimizes.

The trainer takes batches as the actors finish them (:class:`ActorPool`), drops batches more than
``train.max_staleness`` versions old (``stale_dropped``), prepares and optimizes them with the same
:class:`Trainer` as the sync loop, and every ``train.weight_update_frequency`` steps pushes its weights to
every actor. With one actor and the defaults (frequency 1, max staleness 1) that is one-step off-policy:
batch k+1 is sampled while step k trains.

The trainer computes everything policy-dependent after a batch is taken: ``loss.old_log_probs=trainer``
scores with its current weights (the policy right before this update, which may be newer than the sampling
one: the ratio is then against that proximal policy and ``loss.tis_cap`` corrects the gap to the sampler),
the reference's log-probs, the KL penalty in the reward (``train.kl_coef_in_loss=false``) and the advantages.

A checkpoint's data position is an :class:`AsyncProgress`; resume restores the policy, the optimizer, the
RNGs, the step, each actor's prompt position, the policy version (the checkpoint's weights are pushed to the
actors first) and the counters. Engine seeds are ``train.seed + 1000 x actor + start step``, so samples after
a resume are fresh draws. A sync checkpoint resumes as actor 0's prompt position.

Faults: an actor that dies is replaced by the pool (``ray.max_actor_restarts``, logged as ``actor_restarts``);
an :class:`ActorFault` stops the run with one line (``errors.RunError``) after a checkpoint of the last
finished step. SIGINT/SIGTERM finish the step, checkpoint and stop. Actors are killed and Ray is shut
down on every way out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from torchrl_grpo.collect.rollout_actors import ActorFault, ActorPool
from torchrl_grpo.engines.weight_check import WeightCheck
from torchrl_grpo.run.evaluation import Evaluator
from torchrl_grpo.run.state import AsyncProgress, RunState
from torchrl_grpo.run.stop_request import StopRequest
from torchrl_grpo.telemetry.recorder import Telemetry
from torchrl_grpo.training.trainer import Trainer


@dataclass
class AsyncRun:
    trainer: Trainer
    state: RunState
    tokenizer: object
    reward_names: list[str]
    total_steps: int
    num_actors: int
    weight_update_frequency: int
    max_staleness: int
    evaluator: Evaluator | None = None  # evaluates the trainer's own policy (the actors may hold older weights)
    weight_check: WeightCheck | None = None  # train.weight_sync_check: each actor checks itself after a push
    engine_dtype: torch.dtype | None = None  # the actors' engines': pushes are sent cast to it


def run_async(run: AsyncRun) -> dict:
    """Train until ``total_steps`` with Ray rollout actors; returns the end-of-run summary."""
    trainer, state = run.trainer, run.state
    progress = AsyncProgress(run.num_actors)
    state.restore(trainer, progress)
    weights = trainer.cpu_weights(run.engine_dtype) if state.resume_from is not None else None
    probe = run.weight_check.probe() if run.weight_check is not None and weights is not None else None
    step = start = state.step
    try:
        with ActorPool(state.config, progress.actor_samplers, state.step, progress.policy_version, weights,
                       probe, log_dir=state.run_dir) as pool:
            print(f"async: {run.num_actors} rollout actor(s) started in Ray ({pool.startup_time:.1f} s); weights pushed "
                  f"every {run.weight_update_frequency} step(s), batches older than {run.max_staleness} version(s) "
                  "dropped", flush=True)
            with Telemetry(state.config, state.run_dir, run.total_steps, step, resumed=step > 0) as telemetry, \
                    StopRequest() as stop:
                eval_engine = trainer_engine(trainer, run.tokenizer, state.config) if run.evaluator else None
                if step == 0 and run.evaluator is not None and run.evaluator.due(0):
                    telemetry.record(0, run.evaluator(eval_engine))
                if run.weight_check is not None:  # waits for actor 0's engine (its first collect comes first)
                    print(run.weight_check.startup(pool), flush=True)
                while step < run.total_steps:
                    actor, (batch, metrics, texts, sampler_state), wait_time = pool.next_batch()
                    progress.actor_samplers[actor] = sampler_state
                    version = int(batch["policy_version"][0])
                    staleness = progress.policy_version - version
                    if staleness > run.max_staleness:
                        progress.stale_dropped += 1
                        continue
                    step, started = step + 1, time.perf_counter()
                    metrics.update(train_step(run, pool, progress, step, batch))
                    if (gap := pool.pop_weight_sync_gap()) is not None:
                        metrics["weight_sync_gap"] = gap
                    progress.staleness_max = max(progress.staleness_max, staleness)
                    metrics.update({"policy_version": version, "staleness": staleness,
                                    "staleness_max": progress.staleness_max, "stale_dropped": progress.stale_dropped,
                                    "actor": actor, "actor_restarts": pool.total_restarts, "batch_wait_time": wait_time,
                                    "step_time": time.perf_counter() - started + wait_time})
                    if run.evaluator is not None and run.evaluator.due(step):
                        metrics.update(run.evaluator(eval_engine))
                    telemetry.log(step, metrics, list(zip(texts, batch["reward"].tolist())))
                    stopped = state.after_step(step, run.total_steps, trainer, run.tokenizer, progress, stop.requested)
                    if stopped:
                        telemetry.print(stopped)
                        break
    except ActorFault as fault:
        raise state.stopped_by(fault, step, start, trainer, run.tokenizer, progress) from None
    return telemetry.summary(run.reward_names, run.total_steps)


def train_step(run: AsyncRun, pool: ActorPool, progress: AsyncProgress, step: int, batch) -> dict:
    """Prepare and optimize ``batch``; every ``weight_update_frequency`` steps (not after the last) push the
    new weights to the actors as the next policy version."""
    metrics = {**run.trainer.prepare(batch), **run.trainer.optimize(batch),
               "trainer_version": progress.policy_version, "weight_push_time": 0.0}
    if step % run.weight_update_frequency == 0 and step < run.total_steps:
        started, progress.policy_version = time.perf_counter(), progress.policy_version + 1
        pool.push(run.trainer.cpu_weights(run.engine_dtype), progress.policy_version,
                  run.weight_check.probe() if run.weight_check is not None else None)
        metrics["weight_push_time"] = time.perf_counter() - started
    return metrics


def trainer_engine(trainer: Trainer, tokenizer, cfg):
    """The trainer's evaluation engine in async mode: the transformers engine over the trained policy itself
    (data-parallel ranks sample it together)."""
    from torchrl_grpo.engines.hf import TransformersEngine

    return TransformersEngine(trainer.policy, tokenizer, seed=int(cfg.train.seed), parallel=trainer.parallel)
