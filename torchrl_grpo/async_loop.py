"""The async GRPO loop: Ray actors collect scored groups while the trainer optimizes (``grpo-async.py``).

Each :class:`RolloutActor` (one Ray actor process) owns a task, a tokenizer, an inference engine (vLLM in
the actor's own process on the CPU; on a GPU the one Ray gives it) and a :class:`PromptSampler` seeded
``env.seed + actor index``. Its ``collect`` is :func:`loops.collect` over a light :class:`loops.Parts`
without policy, reference or optimizer; every batch carries ``policy_version``, the version of the weights
that sampled it (0 = the starting weights; each weight push bumps it by one).

The trainer keeps one outstanding ``collect`` per actor, takes batches as they finish (``ray.wait``),
resubmits that actor's next ``collect`` at once (so generation overlaps with the optimizer step), drops
batches more than ``train.max_staleness`` versions old (``stale_dropped``), optimizes with
:func:`loops.optimize` and every ``train.weight_update_frequency`` steps pushes ``merged_state_dict`` to
every actor (one ``ray.put``; each actor runs its calls in order, so the push lands after the collect it
is running and the next collect samples with the new weights). With one actor and the defaults
(frequency 1, max staleness 1) that is one-step off-policy: batch k+1 is sampled while step k trains.

Policy-dependent log-probs are computed in the trainer after a batch is taken: ``loss.old_log_probs=trainer``
scores with the trainer's current weights (the policy right before this update, which may be newer than
the sampling one: the ratio is then against that proximal policy and ``loss.tis_cap`` corrects the gap to
the sampler), and ``train.kl_to_ref_coeff > 0`` scores with the reference model (KL in the loss only:
``train.kl_coef_in_loss=false`` is refused, it would change rewards after the actor computed advantages).

Checkpoints reuse the sync loop's (``loops._save``/``loops._resume``); the ``sampler`` entry of
``trainer_state.pt`` holds, for the async loop, each actor's prompt-sampler state as of the last batch the
trainer *received* from it (taken or dropped), the policy version and the counters. Resume restores the
policy, the optimizer, the trainer RNGs and shuffle generator, the step, each actor's prompt position
(the prompts of batches in flight at save time are drawn again), the version (the checkpoint weights are
pushed to the actors first) and the counters. Engine seeds are ``train.seed + 1000 x actor + start step``,
so samples after a resume are fresh draws. A sync checkpoint resumes as actor 0's prompt position.

Faults: a dead actor, an exception in an actor, or no batch within ``ray.collect_timeout_s`` stop the run
with one line (:class:`AsyncRunError`) after a checkpoint of the last finished step. SIGINT/SIGTERM
finish the step, checkpoint and stop. Actors are killed and Ray is shut down on every way out.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from torchrl_grpo.config import batch_plan
from torchrl_grpo.errors import ConfigError, one_line
from torchrl_grpo.evaluation import eval_due, evaluate_policy
from torchrl_grpo.loops import (
    Parts, StopRequest, _checkpoint_due, _print_summary, _resume, _save, collect, optimize, trainer_log_probs,
)
from torchrl_grpo.telemetry import Telemetry, summarize
from torchrl_grpo.trajectories import PromptSampler

# Test-only fault injection: an actor calls os._exit(1) at the start of its N-th collect (1-based). Read by
# the trainer (not the actor) and handed to every actor's constructor; tests/test_async.py uses it.
EXIT_AT_ENV = "TORCHRL_GRPO_TEST_ACTOR_EXIT_AT"


class AsyncRunError(Exception):
    """The async run cannot go on (an actor died or hung): printed as one line, exit code 1."""


def check_async_config(cfg: DictConfig) -> None:
    """The async-only keys and the combinations the actor split cannot honour."""
    train, ray_cfg = cfg.train, cfg.get("ray")
    if ray_cfg is None:
        raise ConfigError("mode=async needs the ray: block of config/mode/async.yaml; run grpo-async.py (it adds mode=async)")
    for key, value in (("ray.num_actors", ray_cfg.num_actors), ("train.weight_update_frequency", train.weight_update_frequency)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}={value!r}: must be a positive integer")
    for key, value in (("train.max_staleness", train.max_staleness), ("ray.actor_num_cpus", ray_cfg.actor_num_cpus),
                       ("ray.actor_num_gpus", ray_cfg.actor_num_gpus)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{key}={value!r}: must be a number >= 0")
    timeout = ray_cfg.collect_timeout_s
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ConfigError(f"ray.collect_timeout_s={timeout!r}: must be a number of seconds > 0")
    if float(train.kl_to_ref_coeff) > 0 and not train.kl_coef_in_loss:
        raise ConfigError(
            "train.kl_coef_in_loss=false with train.kl_to_ref_coeff>0 in async mode: the KL penalty would change the "
            "rewards after the rollout actor computed the advantages; set train.kl_coef_in_loss=true (KL in the loss)"
        )


def actor_config(cfg: DictConfig) -> dict:
    """What a rollout actor sees: the run's config with the policy-dependent parts off (the trainer does them)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["loss"]["old_log_probs"] = "engine"
    plain["train"]["kl_to_ref_coeff"] = 0.0
    return plain


class RolloutActor:
    """One rollout worker (wrapped with ``ray.remote`` by :func:`run_async`; plain Python otherwise).

    ``sampler_state``: a :meth:`PromptSampler.state_dict` to continue from (resume), else a fresh order
    seeded ``env.seed + index``. ``exit_at``: test-only, ``os._exit(1)`` at the start of that collect.
    """

    def __init__(self, cfg: dict, index: int, engine_seed: int, sampler_state: dict | None = None,
                 exit_at: int | None = None):
        from torchrl_grpo.models import load_tokenizer, resolve_model
        from torchrl_grpo.rollout import make_engine
        from torchrl_grpo.tasks import build_task

        self.cfg = OmegaConf.create(cfg)
        self.index, self.exit_at, self.calls, self.version = index, exit_at, 0, 0
        task = build_task(self.cfg.env)
        model_path = resolve_model(str(self.cfg.model.name))
        tokenizer = load_tokenizer(model_path)
        inference = self.cfg.inference_model
        device = "cuda:0" if torch.cuda.is_available() and float(self.cfg.ray.actor_num_gpus) > 0 else "cpu"
        dtype = inference.torch_dtype
        if dtype in (None, "auto"):
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        kwargs = {"dtype": dtype, "device": device, "seed": engine_seed}
        if inference.backend == "vllm":
            kwargs.update(gpu_memory_utilization=float(inference.gpu_memory_utilization),
                          max_model_len=int(inference.max_model_len))
        engine = make_engine(inference.backend, model_path, **kwargs)
        self.sampler = PromptSampler(len(task.rows), int(self.cfg.env.seed) + index)
        if sampler_state is not None:
            self.sampler.load_state_dict(sampler_state)
        self.parts = Parts(
            cfg=self.cfg, plan=batch_plan(self.cfg), run_dir=Path("."), task=task, tokenizer=tokenizer, policy=None,
            ref_policy=None, engine=engine, loss=None, optimizer=None, train_device=torch.device("cpu"),
            ref_device=None, push_weights=None, resume_from=None,
        )

    def collect(self):
        """One scored, advantage-stamped batch at the current weights: (batch, metrics, samples, sampler state)."""
        self.calls += 1
        if self.exit_at is not None and self.calls >= self.exit_at:
            os._exit(1)  # test-only: die like a crashed worker (no exception, no cleanup)
        batch, metrics, samples = collect(self.parts, self.sampler, version=self.version)
        return batch, metrics, samples[:4], self.sampler.state_dict()

    def push_weights(self, state_dict, version: int) -> None:
        """New weights into the engine; the version changes only once they are in."""
        self.parts.engine.push_weights(state_dict)
        self.version = version

    def close(self) -> None:
        self.parts.engine.close()


class AsyncState:
    """What the async loop checkpoints under ``trainer_state.pt['sampler']`` (see the module docstring)."""

    def __init__(self, num_actors: int):
        self.actor_samplers: list[dict | None] = [None] * num_actors
        self.policy_version = 0
        self.stale_dropped = 0
        self.staleness_max = 0

    def state_dict(self) -> dict:
        return {"actor_samplers": list(self.actor_samplers), "policy_version": self.policy_version,
                "stale_dropped": self.stale_dropped, "staleness_max": self.staleness_max}

    def load_state_dict(self, state: dict) -> None:
        if "actor_samplers" not in state:  # a sync checkpoint: its prompt position continues as actor 0's
            state = {"actor_samplers": [state]}
        saved = list(state["actor_samplers"])[: len(self.actor_samplers)]
        self.actor_samplers[: len(saved)] = saved
        self.policy_version = int(state.get("policy_version", 0))
        self.stale_dropped = int(state.get("stale_dropped", 0))
        self.staleness_max = int(state.get("staleness_max", 0))


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


def run_async(parts: Parts) -> dict:
    """Train until ``plan.total_steps`` with Ray rollout actors; returns the end-of-run summary."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    cfg, plan = parts.cfg, parts.plan
    check_async_config(cfg)
    ray_cfg = cfg.ray
    num_actors, timeout = int(ray_cfg.num_actors), float(ray_cfg.collect_timeout_s)
    frequency, max_staleness = int(cfg.train.weight_update_frequency), int(cfg.train.max_staleness)
    ckpt_dir = parts.run_dir / cfg.logging.checkpoint_dir
    generator = torch.Generator().manual_seed(int(cfg.train.seed))
    state = AsyncState(num_actors)
    start_step = _resume(parts, state, generator)
    exit_at = int(os.environ[EXIT_AT_ENV]) if os.environ.get(EXIT_AT_ENV) else None

    started = time.perf_counter()
    kwargs = ray_init_kwargs(cfg)
    try:
        ray.init(**kwargs)
    except Exception as err:  # no cluster at ray.address, a bad ray.init key, ...
        ray.shutdown()
        raise ConfigError(f"ray.address={cfg.ray.address}: could not start or join Ray ({one_line(err)})") from None
    actors, step = [], start_step
    telemetry = None
    try:
        remote_cls = ray.remote(RolloutActor)
        plain = actor_config(cfg)
        for i in range(num_actors):
            actors.append(remote_cls.options(
                num_cpus=float(ray_cfg.actor_num_cpus), num_gpus=float(ray_cfg.actor_num_gpus), max_restarts=0,
            ).remote(plain, i, int(cfg.train.seed) + 1000 * i + start_step, state.actor_samplers[i], exit_at))
        pushes = []
        if parts.resume_from is not None:  # the actors start from the base weights: give them the checkpoint's
            weights = ray.put(_state_dict(parts))
            pushes = [a.push_weights.remote(weights, state.policy_version) for a in actors]
        pending = {actors[i].collect.remote(): i for i in range(num_actors)}
        print(f"async: {num_actors} rollout actor(s) started in Ray ({time.perf_counter() - started:.1f} s); "
              f"weights pushed every {frequency} step(s), batches older than {max_staleness} version(s) dropped",
              flush=True)
        telemetry = Telemetry(cfg, parts.run_dir, plan.total_steps, start_step, resumed=start_step > 0)
        eval_engine = _eval_engine(parts) if parts.eval_task is not None else None
        if start_step == 0 and eval_due(cfg, 0, plan.total_steps):
            telemetry.record(0, evaluate_policy(parts, eval_engine))
        with StopRequest() as stop:
            while step < plan.total_steps:
                waited = time.perf_counter()
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
                if not ready:
                    busy = ", ".join(str(i) for i in sorted(pending.values()))
                    raise _Fault(f"no batch from rollout actor(s) {busy} within ray.collect_timeout_s={timeout:g} s")
                ref = ready[0]
                actor = pending.pop(ref)
                try:
                    batch, rollout_metrics, samples, sampler_state = ray.get(ref, timeout=timeout)
                except GetTimeoutError:
                    raise _Fault(f"rollout actor {actor}'s batch could not be fetched within "
                                 f"ray.collect_timeout_s={timeout:g} s") from None
                except RayError as err:
                    raise _Fault(f"rollout actor {actor} failed during collect ({one_line(err)})") from None
                wait_time = time.perf_counter() - waited
                state.actor_samplers[actor] = sampler_state
                pending[actors[actor].collect.remote()] = actor  # keep the actor busy while we train
                _check_pushes(ray, pushes)
                batch_version = int(batch["policy_version"][0])
                staleness = state.policy_version - batch_version
                if staleness > max_staleness:
                    state.stale_dropped += 1
                    continue
                step += 1
                step_started = time.perf_counter()
                extra = trainer_log_probs(parts, batch)
                train_metrics = optimize(parts, batch, generator)
                trained_with, push_time = state.policy_version, 0.0
                if step % frequency == 0 and step < plan.total_steps:
                    push_started = time.perf_counter()
                    state.policy_version += 1
                    weights = ray.put(_state_dict(parts))
                    pushes += [a.push_weights.remote(weights, state.policy_version) for a in actors]
                    push_time = time.perf_counter() - push_started
                state.staleness_max = max(state.staleness_max, staleness)
                metrics = {**rollout_metrics, **extra, **train_metrics,
                           "policy_version": batch_version, "trainer_version": trained_with,
                           "staleness": staleness, "staleness_max": state.staleness_max,
                           "stale_dropped": state.stale_dropped, "actor": actor, "batch_wait_time": wait_time,
                           "weight_push_time": push_time,
                           "step_time": time.perf_counter() - step_started + wait_time}
                if eval_due(cfg, step, plan.total_steps):
                    metrics.update(evaluate_policy(parts, eval_engine))
                telemetry.log(step, metrics, samples)
                if _checkpoint_due(cfg, step, plan.total_steps) or stop.requested:
                    _save(parts, ckpt_dir, step, state, generator)
                if stop.requested:
                    telemetry.print(f"stopped after step {step} (checkpoint saved); continue with "
                                    f"train.resume=auto hydra.run.dir={parts.run_dir}")
                    break
    except _Fault as fault:
        where = "no step finished in this run, nothing new to save"
        if step > start_step:
            _save(parts, ckpt_dir, step, state, generator)
            where = f"checkpoint of step {step} saved in {ckpt_dir}"
        raise AsyncRunError(f"{fault}; stopped ({where}; continue with train.resume=auto "
                            f"hydra.run.dir={parts.run_dir})") from None
    finally:
        if telemetry is not None:
            telemetry.close()
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        ray.shutdown()
    window = max(1, min(5, plan.total_steps // 4))
    summary = summarize(telemetry.csv.rows, ["reward"] + [f"reward/{n}" for n in parts.task.reward_names], window)
    _print_summary(telemetry, summary, window)
    return summary


def _eval_engine(parts: Parts):
    """The trainer's evaluation engine in async mode: the transformers engine over the trained policy itself
    (the vLLM engines live in the rollout actors and may hold older weights)."""
    from torchrl_grpo.hf_engine import TransformersEngine

    return TransformersEngine(parts.policy, parts.tokenizer, seed=int(parts.cfg.train.seed))


class _Fault(Exception):
    """Internal: a Ray-side failure, turned into AsyncRunError after the checkpoint."""


def _state_dict(parts: Parts) -> dict:
    """The policy's HF-named weights as CPU tensors (what ``ray.put`` ships to the actors)."""
    from torchrl_grpo.models import merged_state_dict

    return {name: t.detach().to("cpu") for name, t in merged_state_dict(parts.policy).items()}


def _check_pushes(ray, pushes: list) -> None:
    """Raise a finished weight push's error (a failed push leaves that actor's version unchanged)."""
    from ray.exceptions import RayError

    if not pushes:
        return
    done, rest = ray.wait(list(pushes), num_returns=len(pushes), timeout=0)
    pushes[:] = rest
    for ref in done:
        try:
            ray.get(ref)
        except RayError as err:
            raise _Fault(f"a weight push to a rollout actor failed ({one_line(err)})") from None
