"""The run spec: the composed config checked and resolved once, before anything heavy starts.

:func:`resolve_run` validates every key (:func:`~torchrl_grpo.config.validate.validate`), places the roles on this
machine's devices (:func:`~torchrl_grpo.config.placement.place`) and resolves the precision keys for those
devices (:func:`~torchrl_grpo.config.precision.resolve_precision`), gives each part of the run its settings
(:mod:`~torchrl_grpo.config.settings`), then resolves the engine keys that depend on the vLLM installed and on where
the roles run (:mod:`~torchrl_grpo.config.vllm_releases`). Every entry point (train, train-async, eval, plan) takes
its spec from here; below it nothing reads the config, so no ``auto`` is resolved twice.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from torchrl_grpo.config.placement import Placement, place, place_actors
from torchrl_grpo.config.precision import Precision, resolve_precision
from torchrl_grpo.config.settings import (
    ActorSettings,
    CheckpointSettings,
    CollectSettings,
    CriticSettings,
    EngineSettings,
    EvalSettings,
    LoggingSettings,
    LossSettings,
    ModelSettings,
    OptimizerSettings,
    TrainSettings,
)
from torchrl_grpo.config.validate import BatchPlan, auto_keys, validate
from torchrl_grpo.config.vllm_releases import (
    check_actor_engines,
    check_streaming,
    choose_sleep,
    choose_weight_transfer,
)


@dataclass(frozen=True)
class RunSpec:
    """What a run does, in the trainer's terms."""

    plan: BatchPlan             # the batch arithmetic
    placement: Placement        # the devices of the trained, reference and inference models
    precision: Precision        # the precision keys, resolved for those devices
    engine: EngineSettings      # what builds the engines
    collect: CollectSettings    # what the collectors need
    train: TrainSettings        # what the trainer needs besides its model, loss and optimizer
    eval: EvalSettings          # what an evaluation needs
    model: ModelSettings        # where the model comes from
    actors: ActorSettings | None  # the async run's Ray actors (None: a sync run)
    logging: LoggingSettings    # what the telemetry needs
    checkpoint: CheckpointSettings  # what saves and resumes checkpoints
    config: dict[str, Any]      # the whole config, resolved: what checkpoints and wandb record
    loss: LossSettings          # what builds the objective
    critic: CriticSettings      # an actor-critic run's value model (its keys are read in every run)
    optimizer: OptimizerSettings  # the optimizer and its schedule
    auto: tuple[str, ...] = ()  # the keys left to auto, their memory-lean values held until they are chosen
    auto_chosen: str = ""       # what auto chose and why, in one line (config.auto_settings.Choice.line)

    @property
    def task(self) -> dict[str, Any]:
        """The env section: what builds the task (the trainer's and each actor's)."""
        return self.config["env"]

    @property
    def eval_task(self) -> dict[str, Any]:
        """The env section of the task's evaluation split (:func:`eval_env`)."""
        return eval_env(self.task)


def eval_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """The env config of a task's evaluation split, as a plain dict: ``env`` with its ``env.eval`` block merged
    over it (e.g. ``{split: test}`` for GSM8K, another seed for generated tasks, held-out tasks for
    reasoning-gym)."""
    base = OmegaConf.create(env if isinstance(env, DictConfig) else dict(env))
    overrides = base.pop("eval", None) or {}
    return OmegaConf.to_container(OmegaConf.merge(base, overrides), resolve=True)


def resolve_run(cfg: DictConfig, training: bool = True, gpu_count: int | None = None) -> RunSpec:
    """``cfg`` checked and resolved (one-line ConfigErrors naming the keys). ``training=False`` (evaluate.py):
    no reference model takes a device, and no trainer shares a device with the engine. The engines are the rollout
    actors' in async mode (on the GPUs :func:`~torchrl_grpo.config.placement.place_actors` gives them, each taking
    its share of ``inference_model.gpu_memory_utilization``), else the inference model's: their weight transfer and
    sleep level are resolved for those devices (:func:`with_weight_transfer`, :func:`with_sleep`). ``gpu_count``: the
    GPUs to place on (default: this machine's; ``torchrl-grpo plan --gpus`` plans another's)."""
    plan = validate(cfg)
    available = torch.cuda.device_count() if gpu_count is None else gpu_count
    placement = place(cfg, needs_ref=training and float(cfg.train.kl_to_ref_coeff) > 0, gpu_count=available)
    engine_on, memory_share = placement.inference[0], 1.0
    if cfg.get("mode") == "async":
        placement = dataclasses.replace(placement, actors=place_actors(cfg, placement, available))
        engine_on, memory_share = placement.actors.devices[0], placement.actors.memory_share
    precision = resolve_precision(cfg, placement.train[0], engine_on, placement.ref[0])
    spec = RunSpec(plan, placement, precision, EngineSettings.from_config(cfg, plan, engine_on, memory_share),
                   CollectSettings.from_config(cfg, plan), TrainSettings.from_config(cfg, plan, precision),
                   EvalSettings.from_config(cfg, plan), ModelSettings.from_config(cfg),
                   ActorSettings.from_config(cfg, placement.actors) if placement.actors is not None else None,
                   LoggingSettings.from_config(cfg), CheckpointSettings.from_config(cfg, placement),
                   OmegaConf.to_container(cfg, resolve=True), LossSettings.from_config(cfg, plan),
                   CriticSettings.from_config(cfg), OptimizerSettings.from_config(cfg),
                   auto=auto_keys(cfg))
    return with_sleep(with_weight_transfer(spec, training), training)


def with_weight_transfer(spec: RunSpec, training: bool = True) -> RunSpec:
    """``inference_model.weight_transfer`` resolved for where the engines run and the vLLM installed
    (:func:`~torchrl_grpo.config.vllm_releases.choose_weight_transfer`: a one-line error where it cannot work), for
    the devices the engines may be on: the rollout actors' (one that may share a GPU with training takes no NCCL push),
    else the inference model's. An engine asked to run in this process (``inference_model.engine_process=same``)
    takes no push: the key stays as asked. Without ``training`` (``evaluate.py``) no trainer shares the engines'
    devices."""
    engine = spec.engine
    if engine.backend != "vllm" or (spec.actors is None and engine.engine_process == "same"):
        return spec
    engines = spec.placement.inference if spec.actors is None else spec.placement.actors.devices
    if spec.actors is not None:
        check_actor_engines(engines)
        if spec.actors.streaming:
            check_streaming()
    chosen = choose_weight_transfer(engine.weight_transfer, engines, spec.placement.train if training else [])
    return dataclasses.replace(spec, engine=dataclasses.replace(engine, weight_transfer=chosen))


def with_sleep(spec: RunSpec, training: bool = True) -> RunSpec:
    """``inference_model.sleep`` resolved to a level for where the run's engine and training roles are
    (:func:`~torchrl_grpo.config.vllm_releases.choose_sleep`); without ``training`` (``evaluate.py``) nothing trains
    beside the engine."""
    engine = spec.engine
    if engine.backend != "vllm":
        busy = f"inference_model.backend={engine.backend} samples with the trained policy itself"
    elif spec.actors is not None:
        busy = "grpo-async.py's rollout actors generate while the trainer trains"
    elif not spec.train.sync_iter:
        busy = "with train.sync_iter=false the engine generates the next batch while this one trains"
    else:
        busy = None
    beside = [*spec.placement.train, *spec.placement.ref] if training else []
    level = choose_sleep(engine.sleep, spec.placement.inference, beside, busy, adapter=engine.lora_rank is not None)
    return dataclasses.replace(spec, engine=dataclasses.replace(engine, sleep=level))
