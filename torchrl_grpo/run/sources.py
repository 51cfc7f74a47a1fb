"""Where the loop's batches come from (:class:`torchrl_grpo.run.loop.BatchSource`), and where its weights go.

:class:`LocalSource` (``grpo.py``): the collector in this process over an engine that takes the trainer's
weights after each update, checked by the weight sync check. With ``overlap`` (``train.sync_iter=false``) the
next batch is generated while this one trains (:class:`~torchrl_grpo.collect.prefetch.Prefetch`): sampled by
the weights before this update (staleness <= 1); the push waits for it.

:class:`ActorSource` (``grpo-async.py``): Ray rollout actors collect while the trainer optimizes. Batches more
than ``train.max_staleness`` versions old are dropped (``stale_dropped``); every ``train.weight_update_frequency``
steps the trainer's weights go to every actor as the next policy version. With one actor and the defaults
(frequency 1, max staleness 1) that is one-step off-policy: batch k+1 is sampled while step k trains. The
trainer computes everything policy-dependent after a batch is taken: ``loss.old_log_probs=trainer`` scores with
its current weights (the policy right before this update, which may be newer than the sampling one: the ratio is
then against that proximal policy and ``loss.tis_cap`` corrects the gap to the sampler), the reference's
log-probs, the KL penalty in the reward and the advantages. Its data position is an
:class:`~torchrl_grpo.run.state.AsyncProgress`; resume pushes the checkpoint's weights to the actors first.
Engine seeds are ``train.seed + 1000 x actor + start step``, so samples after a resume are fresh draws. An actor
that dies is replaced by the pool (``ray.max_actor_restarts``, logged as ``actor_restarts``); an
:class:`~torchrl_grpo.collect.rollout_actors.ActorFault` stops the run. Actors are killed and Ray is shut down on
every way out.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import time
from collections.abc import Callable

import torch

from torchrl_grpo.collect.collector import Collector, Group
from torchrl_grpo.collect.prefetch import Prefetch
from torchrl_grpo.collect.rollout_actors import ActorFault, ActorPool
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.core.batch import Batch
from torchrl_grpo.core.errors import RunError
from torchrl_grpo.engines.base import engine_death
from torchrl_grpo.engines.factory import policy_engine
from torchrl_grpo.run.loop import Delivery
from torchrl_grpo.run.state import AsyncProgress, RunState
from torchrl_grpo.training.weight_sync import ActorSync, EngineSync


class LocalSource:
    """Batches from ``collector``; after each update the trainer's weights into its engine.

    An engine whose process dies (vLLM's engine core: a crash, the OOM killer) is replaced by
    ``new_engine(restart, step)`` at once, given the trainer's current weights and checked, and the batch it was
    generating is drawn again from the same prompts, up to ``max_restarts`` times a run; then a RunError stops the
    run with a checkpoint."""

    faults = (RunError,)  # a reward function raised while collecting, or the engine died too often

    def __init__(self, collector: Collector, weights: EngineSync, overlap: bool = False,
                 new_engine: Callable[[int, int], object] | None = None, max_restarts: int = 0,
                 engine_sleeps_on_gpu: bool = False):
        self.collector, self.weights, self.overlap = collector, weights, overlap
        self.engine_sleeps_on_gpu = engine_sleeps_on_gpu
        self.new_engine, self.max_restarts, self.restarts = new_engine, max_restarts, 0
        self.reward_names, self.tokenizer = collector.task.reward_names, collector.tokenizer
        self.exact_engine = None if overlap else collector.engine  # a prefetching engine samples while we save
        # a vLLM engine's devices; the transformers engine samples with the trained policy, on the train devices
        self.engine_devices = getattr(collector.engine, "devices", [])
        self.engine_held = getattr(collector.engine, "cuda_bytes_in_process", {})
        self.prefetch: Prefetch | None = None
        self.total_steps = 0

    @property
    def position(self):
        return self.prefetch.position if self.prefetch is not None else self.collector.sampler

    def saved_position(self):
        return copy.deepcopy(self.position)

    @contextlib.contextmanager
    def running(self, state: RunState, trainer, total_steps: int):
        self.total_steps = total_steps
        if self.overlap:
            self.prefetch = Prefetch(self.collector, version=state.step)
        try:
            yield self
        finally:
            if self.prefetch is not None:
                self.prefetch.close()

    def eval_engine(self, trainer):
        return CurrentEngine(self.collector)

    def ready(self) -> None:
        pass

    def take(self, step: int) -> Delivery:
        started, replaced = time.perf_counter(), {}
        while True:
            before = copy.deepcopy(self.collector.sampler)
            try:
                version, sampled = self.prefetch.next(more=step < self.total_steps) if self.prefetch else (
                    step - 1, None)
                batch, metrics, samples = self.collector.collect(version, sampled)
                break
            except Exception as err:
                replaced = self._replace_dead_engine(err, step)
                self.collector.sampler = before  # the lost batch's prompts are drawn again
        metrics.update(replaced)
        if not self.overlap:  # the engine idles while this batch trains: it gives its GPU memory back meanwhile
            self.collector.engine.sleep()
        return Delivery(batch, metrics, samples, version, started)

    def finish(self, step: int, delivery: Delivery, stopping: bool) -> dict:
        """Pushes even when ``stopping``: this step's evaluation samples the engine."""
        metrics = {}
        if self.prefetch:
            try:
                metrics["batch_wait_time"] = self.prefetch.finish()
            except Exception as err:  # the next batch's generation: its prompts are drawn again
                metrics.update(self._replace_dead_engine(err, step))
        if self.engine_sleeps_on_gpu:
            # what torch's allocator cached of the step's activations is the memory the engine wakes into (the plan
            # counts only what the trainer keeps between steps beside the awake engine)
            torch.cuda.empty_cache()
        try:
            metrics.update(self.weights.push(step))  # checked before the next generation (a prefetch's, next step)
        except Exception as err:
            metrics.update(self._replace_dead_engine(err, step))
        if self.restarts:
            metrics["engine_restarts"] = self.restarts
        if self.prefetch:
            self.prefetch.version = step
        metrics.update({"policy_version": delivery.version, "staleness": step - 1 - delivery.version,
                        "step_time": time.perf_counter() - delivery.started})
        return metrics

    @property
    def fault(self) -> str | None:
        return self.weights.fault

    def _replace_dead_engine(self, err: Exception, step: int) -> dict:
        """Called while handling ``err``: unless it says the engine's process died, it goes on up. Else a new engine
        (its seed apart from the dead one's) takes the dead one's place, with the trainer's current weights, checked;
        a prefetch in flight is dropped, its prompts put back. Returns the check's metrics; a RunError (one line)
        once ``inference_model.max_engine_restarts`` are used up."""
        # (vLLM's own message points to a stack trace the console does not show)
        why = engine_death(err) if self.new_engine is not None else None
        if why is None:
            raise err
        if self.restarts >= self.max_restarts:
            raise RunError(f"{why}; inference_model.max_engine_restarts={self.max_restarts} restart(s) used "
                           "up") from None
        self.restarts += 1
        with contextlib.suppress(Exception):  # what is left of it: its client, its shared memory
            self.collector.engine.close()
        engine = self.new_engine(self.restarts, step)
        self.collector.engine = self.weights.engine = engine
        if not self.overlap:
            self.exact_engine = engine
        if self.prefetch is not None:
            self.prefetch.drop_in_flight()
        checked = self.weights.resend()
        print(f"warning: {why}; started a new one with the trainer's weights "
              f"(restart {self.restarts} of inference_model.max_engine_restarts={self.max_restarts})",
              file=sys.stderr, flush=True)
        return checked


class CurrentEngine:
    """The collector's engine as it is now (one whose process died is replaced): what evaluations sample with."""

    def __init__(self, collector: Collector):
        self._collector = collector

    def __getattr__(self, name: str):
        return getattr(self._collector.engine, name)


class ActorSource:
    """Batches from Ray rollout actors (:class:`~torchrl_grpo.collect.rollout_actors.ActorPool`); every
    ``weight_update_frequency`` steps (not after the last) the trainer's weights to every actor."""

    faults = (ActorFault,)
    exact_engine = None  # the actors sample while the trainer saves
    engine_devices = ()  # Ray gives the actors' engines their GPUs: this process does not know which
    engine_held: dict = {}  # and they hold nothing in this process

    def __init__(self, spec: RunSpec, weights: ActorSync, tokenizer, reward_names: list[str]):
        self.spec, self.weights, self.tokenizer, self.reward_names = spec, weights, tokenizer, reward_names
        actors = spec.actors
        self.num_actors, self.weight_update_frequency = actors.num_actors, actors.weight_update_frequency
        self.max_staleness = actors.max_staleness
        self.progress = AsyncProgress(self.num_actors)
        self.pool: ActorPool | None = None
        self.total_steps = 0

    @property
    def position(self) -> AsyncProgress:
        return self.progress

    def saved_position(self) -> AsyncProgress:
        return self.progress  # as of the last batch the trainer received: the prompts in flight are drawn again

    @contextlib.contextmanager
    def running(self, state: RunState, trainer, total_steps: int):
        self.total_steps = total_steps
        with ActorPool(self.spec, self.progress.actor_samplers, state.step, self.progress.policy_version,
                       log_dir=state.run_dir) as pool:
            self.pool = pool
            self.weights.attach(pool)
            state.resume_engines(self.weights)
            pool.start_collecting()
            print(f"async: {self.num_actors} rollout actor(s) started in Ray ({pool.startup_time:.1f} s); weights "
                  f"pushed every {self.weight_update_frequency} step(s) {pool.transport.name}, batches older than "
                  f"{self.max_staleness} version(s) dropped", flush=True)
            yield self

    def eval_engine(self, trainer):
        """The transformers engine over the trained policy itself (the actors may hold older weights;
        data-parallel ranks sample it together)."""
        return policy_engine(trainer.policy, self.tokenizer, seed=int(trainer.settings.seed), parallel=trainer.parallel)

    def ready(self) -> None:
        line = self.weights.startup()  # waits for actor 0's engine (its first collect comes first)
        if line is not None:
            print(line, flush=True)

    def take(self, step: int) -> Delivery:
        progress = self.progress
        while True:
            actor, (batch, metrics, samples, sampler_state), wait_time = self.pool.next_batch()
            progress.actor_samplers[actor] = sampler_state
            version = int(batch[Batch.POLICY_VERSION][0])
            staleness = progress.policy_version - version
            if staleness <= self.max_staleness:
                return Delivery(batch, metrics, samples, version, time.perf_counter(),
                                {"actor": actor, "staleness": staleness, "wait_time": wait_time})
            progress.stale_dropped += 1

    def finish(self, step: int, delivery: Delivery, stopping: bool) -> dict:
        """No push after the last step, nor once a stop is asked for: the run ends after this step, within a
        scheduler's grace; and the daemons of a Ray cluster this run did not start may be going with the same
        signal (Ray ends a driver whose object store goes away under a put)."""
        progress, extra = self.progress, delivery.extra
        metrics = {"trainer_version": progress.policy_version, "weight_push_time": 0.0}
        due = step % self.weight_update_frequency == 0 and step < self.total_steps and not stopping
        if due and self.weights.changed:
            progress.policy_version += 1
            metrics.update(self.weights.push(progress.policy_version))
        metrics.update(self.weights.landed())
        progress.staleness_max = max(progress.staleness_max, extra["staleness"])
        metrics.update({"policy_version": delivery.version, "staleness": extra["staleness"],
                        "staleness_max": progress.staleness_max, "stale_dropped": progress.stale_dropped,
                        "actor": extra["actor"], "actor_restarts": self.pool.total_restarts,
                        "batch_wait_time": extra["wait_time"],
                        "step_time": time.perf_counter() - delivery.started + extra["wait_time"]})
        return metrics

    @property
    def fault(self) -> str | None:
        return self.weights.fault


class StreamSource(ActorSource):
    """Groups streamed from the rollout actors (``ray.streaming``): a step's batch is the first ``env.num_envs``
    groups to arrive, from any actor, whose oldest token is at most ``train.max_staleness`` policy versions behind
    the trainer's (older ones are dropped, counted in ``stale_dropped``); the rest wait for the next step. Each
    actor's saved position adds the prompts of its groups waiting here to those it has in flight: a resumed run
    opens them all again."""

    def __init__(self, spec: RunSpec, weights: ActorSync, tokenizer, task, turns):
        super().__init__(spec, weights, tokenizer, task.reward_names)
        self.assembler = Collector(task, tokenizer, None, None, spec.collect, turns)
        self.waiting: list[tuple[int, Group]] = []  # (actor, group) in arrival order
        self.positions: list[dict | None] = [None] * self.num_actors  # each actor's, as its last call returned

    def take(self, step: int) -> Delivery:
        progress, wanted = self.progress, self.spec.collect.prompts_per_step
        started, waited, actor = time.perf_counter(), 0.0, 0
        totals = {"generation_time": 0.0, "score_time": 0.0}
        generated, idle = 0, 0.0
        self._drop_stale()  # those that waited here across a push too
        while len(self.waiting) < wanted:
            actor, (groups, metrics, _, position), wait_time = self.pool.next_batch()
            waited += wait_time
            self.positions[actor] = position
            for key in totals:
                totals[key] += metrics[key]
            generated, idle = generated + metrics["generated_tokens"], idle + metrics["idle_time"]
            self.waiting += [(actor, group) for group in groups]
            self._drop_stale()
        taken, self.waiting = self.waiting[:wanted], self.waiting[wanted:]
        self._save_positions()
        batch, metrics, samples = self.assembler.collect(progress.policy_version, ([g for _, g in taken], totals))
        # every token the actors decoded meanwhile (dropped groups' and those still waiting too), and their engines'
        # time without a step to decode (all of them: the waits for this trainer included)
        metrics.update({"stream/generated_tokens": generated, "stream/engine_idle_time": idle})
        version = int(batch[Batch.POLICY_VERSION].min())
        return Delivery(batch, metrics, samples, version, started,
                        {"actor": actor, "staleness": progress.policy_version - version, "wait_time": waited})

    def _drop_stale(self) -> None:
        """Drop (and count) the waiting groups whose oldest token is more than ``train.max_staleness`` versions
        behind the trainer's; their actors open their prompts again."""
        current = self.progress.policy_version

        def oldest(group: Group) -> int:
            return min(min(p.versions, default=current) for p in group.episodes)

        kept = []
        for actor, group in self.waiting:
            if current - oldest(group) <= self.max_staleness:
                kept.append((actor, group))
            else:  # its prompt goes back to its actor: none is lost to staleness
                self.progress.stale_dropped += 1
                self.pool.requeue(actor, group.index)
        self.waiting = kept

    def _save_positions(self) -> None:
        """Each actor's position as a checkpoint keeps it: its sampler, and the prompts of its groups waiting here,
        dropped as stale and not yet opened again, and in flight."""
        for i, position in enumerate(self.positions):
            if position is not None:
                waiting = [g.index for a, g in self.waiting if a == i]
                self.progress.actor_samplers[i] = {"sampler": position["sampler"], "open": [
                    *waiting, *self.pool.reopening(i), *position["open"]]}
