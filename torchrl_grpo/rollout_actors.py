"""Ray rollout actors for ``grpo-async.py``: each runs a :class:`Collector` over its own engine, and the
:class:`ActorPool` keeps one ``collect`` in flight per actor, hands finished batches to the trainer and
ships new weights to every actor.

Each :class:`RolloutActor` (one Ray actor process) owns a task, a tokenizer, an engine (vLLM in the
actor's own process on the CPU; on a GPU the one Ray gives it) and a prompt sampler seeded ``env.seed +
actor index``; every batch carries ``policy_version``, the version of the weights that sampled it (0 = the
starting weights; each push bumps it by one). A push is one ``ray.put``; each actor runs its calls in
order, so the push lands after the collect it is running and the next collect samples with the new weights.

Faults (a dead actor, an exception in an actor, no batch within ``ray.collect_timeout_s``, a failed push)
raise :class:`ActorFault`, which the loop turns into one line after a checkpoint.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from torchrl_grpo.config import CollectSettings
from torchrl_grpo.errors import ConfigError, one_line

# Test-only fault injection: an actor calls os._exit(1) at the start of its N-th collect (1-based). Read by
# the trainer (not the actor) and handed to every actor's constructor; tests/test_async.py uses it.
EXIT_AT_ENV = "TORCHRL_GRPO_TEST_ACTOR_EXIT_AT"


class ActorFault(Exception):
    """A Ray-side failure: the run cannot go on."""


class RolloutActor:
    """One rollout worker (wrapped with ``ray.remote`` by :class:`ActorPool`; plain Python otherwise).

    ``sampler_state``: a prompt sampler's ``state_dict`` to continue from (resume), else a fresh order seeded
    ``env.seed + index``. ``exit_at``: test-only, ``os._exit(1)`` at the start of that collect.
    """

    def __init__(self, cfg: dict, index: int, engine_seed: int, sampler_state: dict | None = None,
                 exit_at: int | None = None):
        from torchrl_grpo.collector import Collector
        from torchrl_grpo.model_sources import resolve_model
        from torchrl_grpo.models import load_tokenizer
        from torchrl_grpo.placement import resolve_dtype
        from torchrl_grpo.rollout import make_engine
        from torchrl_grpo.tasks import build_task
        from torchrl_grpo.trajectories import PromptSampler

        cfg = OmegaConf.create(cfg)
        self.exit_at, self.calls, self.version = exit_at, 0, 0
        task = build_task(cfg.env)
        model_path = resolve_model(str(cfg.model.name))
        inference = cfg.inference_model
        device = "cuda:0" if torch.cuda.is_available() and float(cfg.ray.actor_num_gpus) > 0 else "cpu"
        dtype = str(resolve_dtype(inference.torch_dtype, device)).removeprefix("torch.")
        kwargs = {"dtype": dtype, "device": device, "seed": engine_seed,  # vLLM-only ones: make_engine drops them
                  "gpu_memory_utilization": float(inference.gpu_memory_utilization),
                  "max_model_len": int(inference.max_model_len), "engine_process": str(inference.engine_process)}
        sampler = PromptSampler(len(task.rows), int(cfg.env.seed) + index)
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        self.collector = Collector(task, load_tokenizer(model_path), make_engine(inference.backend, model_path, **kwargs),
                                   sampler, CollectSettings.from_config(cfg))

    def collect(self):
        """One scored batch at the current weights: (batch, metrics, first texts, sampler state)."""
        self.calls += 1
        if self.exit_at is not None and self.calls >= self.exit_at:
            os._exit(1)  # test-only: die like a crashed worker (no exception, no cleanup)
        batch, metrics, texts = self.collector.collect(version=self.version)
        return batch, metrics, texts[:4], self.collector.sampler.state_dict()

    def push_weights(self, state_dict, version: int) -> None:
        """New weights into the engine; the version changes only once they are in."""
        self.collector.engine.push_weights(state_dict)
        self.version = version

    def close(self) -> None:
        self.collector.engine.close()


def ray_init_kwargs(cfg: DictConfig) -> dict:
    """``ray.init`` arguments: ``ray.address`` (null: start a private local Ray; auto or host:port: join one)
    and every key of ``ray.init``; a local Ray gets ``num_cpus`` = what the actors ask for plus one for the
    trainer's own tasks, unless ``ray.init.num_cpus`` says otherwise (Ray would otherwise count every core).
    null maps to Ray's ``"local"``: a bare ``ray.init()`` joins whatever cluster ``RAY_ADDRESS`` or an earlier
    ``ray start`` on this machine left behind, and then refuses ``num_cpus``."""
    ray_cfg = cfg.ray
    kwargs = {k: v for k, v in OmegaConf.to_container(ray_cfg.init, resolve=True).items() if v is not None}
    address = ray_cfg.address or "local"
    kwargs.setdefault("include_dashboard", False)
    if address == "local":
        kwargs.setdefault("num_cpus", max(1, int(round(ray_cfg.num_actors * float(ray_cfg.actor_num_cpus)))) + 1)
    else:
        kwargs.pop("num_cpus", None)  # a running cluster has its resources already
    # workers import torchrl_grpo: make the repository importable from any working directory
    root = str(Path(__file__).resolve().parents[1])
    env_vars = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    runtime_env = kwargs.setdefault("runtime_env", {})
    runtime_env.setdefault("env_vars", {}).update({**env_vars, **runtime_env.get("env_vars", {})})
    return {"address": address, **kwargs}


class ActorPool:
    """Starts Ray and ``ray.num_actors`` actors (each continuing from its saved prompt position and seeded
    ``train.seed + 1000 x actor + start step``), keeps one collect in flight per actor, and shuts all down on
    exit. ``weights``: the checkpoint's weights to push before the first collect (resume), else None."""

    def __init__(self, cfg: DictConfig, actor_samplers: list[dict | None], start_step: int, version: int,
                 weights: dict | None = None):
        import ray

        self.ray, self.timeout = ray, float(cfg.ray.collect_timeout_s)
        started, self.actors, self.pushes = time.perf_counter(), [], []
        try:
            ray.init(**ray_init_kwargs(cfg))
        except Exception as err:  # no cluster at ray.address, a bad ray.init key, ...
            ray.shutdown()
            raise ConfigError(f"ray.address={cfg.ray.address}: could not start or join Ray ({one_line(err)})") from None
        try:
            self._start(cfg, actor_samplers, start_step, version, weights)
        except BaseException:
            self.__exit__()
            raise
        self.startup_time = time.perf_counter() - started

    def _start(self, cfg: DictConfig, actor_samplers, start_step: int, version: int, weights: dict | None) -> None:
        ray = self.ray
        exit_at = int(os.environ[EXIT_AT_ENV]) if os.environ.get(EXIT_AT_ENV) else None
        remote_cls, plain = ray.remote(RolloutActor), OmegaConf.to_container(cfg, resolve=True)
        for i, sampler_state in enumerate(actor_samplers):
            self.actors.append(remote_cls.options(
                num_cpus=float(cfg.ray.actor_num_cpus), num_gpus=float(cfg.ray.actor_num_gpus), max_restarts=0,
            ).remote(plain, i, int(cfg.train.seed) + 1000 * i + start_step, sampler_state, exit_at))
        if weights is not None:  # the actors start from the base weights: give them the checkpoint's
            self.push(weights, version)
        self.pending = {actor.collect.remote(): i for i, actor in enumerate(self.actors)}

    def next_batch(self):
        """The next finished collect: ``(actor index, (batch, metrics, texts, sampler state), seconds waited)``;
        that actor's next collect starts at once, so generation overlaps the trainer's step."""
        from ray.exceptions import GetTimeoutError, RayError

        waited = time.perf_counter()
        ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=self.timeout)
        if not ready:
            busy = ", ".join(str(i) for i in sorted(self.pending.values()))
            raise ActorFault(f"no batch from rollout actor(s) {busy} within ray.collect_timeout_s={self.timeout:g} s")
        actor = self.pending.pop(ready[0])
        try:
            result = self.ray.get(ready[0], timeout=self.timeout)
        except GetTimeoutError:
            raise ActorFault(f"rollout actor {actor}'s batch could not be fetched within "
                             f"ray.collect_timeout_s={self.timeout:g} s") from None
        except RayError as err:
            raise ActorFault(f"rollout actor {actor} failed during collect ({one_line(err)})") from None
        wait_time = time.perf_counter() - waited
        self.pending[self.actors[actor].collect.remote()] = actor
        self._check_pushes()
        return actor, result, wait_time

    def push(self, weights: dict, version: int) -> None:
        """``weights`` (CPU tensors) to every actor, as policy ``version``."""
        ref = self.ray.put(weights)
        self.pushes += [a.push_weights.remote(ref, version) for a in self.actors]

    def _check_pushes(self) -> None:
        """Raise a finished weight push's error (a failed push leaves that actor's version unchanged)."""
        from ray.exceptions import RayError

        if not self.pushes:
            return
        done, self.pushes = self.ray.wait(list(self.pushes), num_returns=len(self.pushes), timeout=0)
        for ref in done:
            try:
                self.ray.get(ref)
            except RayError as err:
                raise ActorFault(f"a weight push to a rollout actor failed ({one_line(err)})") from None

    def __enter__(self) -> ActorPool:
        return self

    def __exit__(self, *exc) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.ray.shutdown()
