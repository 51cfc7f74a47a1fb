"""The settings each part of a run takes from the config, in that part's own terms: the collector's, the
engines', an evaluation's, the trainer's, the Ray actors', telemetry's and the checkpoints'. Each is built once,
from the checked config, by :func:`torchrl_grpo.config.spec.resolve_run`. A comment names each field's key (its
meaning: docs/config-reference.md) and says how the field differs from it, where it does (resolved, derived).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from torchrl_grpo.config.placement import ActorGpus, Placement
from torchrl_grpo.config.precision import Precision
from torchrl_grpo.config.validate import UNSETTLED_ENGINE_SHARE, BatchPlan, check_lora, engine_lora_rank, lora_sync


@dataclass(frozen=True)
class ModelSettings:
    """Where the model comes from (``model.*``: a hub name, a folder or a packaged model's name) and how the trained
    one is built (``train_model.*``)."""

    name: str                       # model.name
    trust_remote_code: bool         # model.trust_remote_code
    compile: bool = False           # model.compile
    gradient_checkpointing: bool = False  # train_model.gradient_checkpointing
    attn_implementation: str = "sdpa"     # train_model.attn_implementation
    lora: dict[str, Any] | None = None    # train_model.lora when enabled (its keys as set), else None

    @classmethod
    def from_config(cls, cfg: DictConfig) -> ModelSettings:
        lora = cfg.train_model.lora
        return cls(name=str(cfg.model.name), trust_remote_code=bool(cfg.model.trust_remote_code),
                   compile=bool(cfg.model.compile),
                   gradient_checkpointing=cfg.train_model.gradient_checkpointing in (True, "auto"),
                   attn_implementation=str(cfg.train_model.attn_implementation),
                   lora=OmegaConf.to_container(lora, resolve=True) if lora.enabled else None)


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer and its learning-rate schedule (``optimizer.*``; the clip is the trainer's)."""

    name: str                       # optimizer.name
    lr: float                       # optimizer.lr
    eps: float                      # optimizer.eps
    weight_decay: float             # optimizer.weight_decay
    scheduler: str                  # optimizer.scheduler
    warmup_steps: int               # optimizer.warmup_steps

    @classmethod
    def from_config(cls, cfg: DictConfig) -> OptimizerSettings:
        opt = cfg.optimizer
        return cls(name=str(opt.name), lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay,
                   scheduler=str(opt.scheduler), warmup_steps=int(opt.warmup_steps))


@dataclass(frozen=True)
class CollectSettings:
    """What the collector needs, in its own terms (``env.*``, ``inference_model.*`` and the loss keys that act
    on collection: DAPO's dynamic sampling and soft overlong penalty)."""

    prompts_per_step: int        # env.num_envs
    group_size: int              # env.repeats
    max_tokens: int              # inference_model.max_tokens
    temperature: float           # inference_model.temperature
    top_p: float                 # inference_model.top_p
    top_k: int                   # inference_model.top_k
    min_p: float                 # inference_model.min_p
    max_model_len: int           # inference_model.max_model_len: a multi-turn episode ends before passing it
    dynamic_sampling: bool       # loss.dynamic_sampling
    max_resample_rounds: int     # loss.max_resample_rounds
    soft_overlong: bool          # loss.overlong == "soft"
    overlong_buffer: int | None  # loss.overlong_buffer
    prompt_seed: int             # env.seed: the prompt order (an actor's: env.seed + its index)
    overlong_prompts: str        # env.overlong_prompts

    @classmethod
    def from_config(cls, cfg: DictConfig, plan: BatchPlan) -> CollectSettings:
        return cls(
            prompts_per_step=plan.prompts_per_step, group_size=plan.group_size, max_tokens=plan.max_tokens,
            temperature=float(cfg.inference_model.temperature), top_p=float(cfg.inference_model.top_p),
            top_k=int(cfg.inference_model.top_k), min_p=float(cfg.inference_model.min_p),
            max_model_len=int(cfg.inference_model.max_model_len),
            dynamic_sampling=bool(cfg.loss.dynamic_sampling), max_resample_rounds=int(cfg.loss.max_resample_rounds),
            soft_overlong=cfg.loss.overlong == "soft", overlong_buffer=cfg.loss.overlong_buffer,
            prompt_seed=int(cfg.env.seed), overlong_prompts=str(cfg.env.overlong_prompts),
        )


@dataclass(frozen=True)
class EngineSettings:
    """What builds a run's engines, the same for the sync engine, ``evaluate.py``'s and each rollout actor's
    (``inference_model.*``; each caller adds its own dtype, devices and seed)."""

    backend: str                    # inference_model.backend
    gpu_memory_utilization: float   # inference_model.gpu_memory_utilization (x a rollout actor's share of its GPU)
    max_model_len: int              # inference_model.max_model_len
    engine_process: str             # inference_model.engine_process
    weight_transfer: str            # inference_model.weight_transfer
    sleep: int | str                # inference_model.sleep: auto | 0 | 1 | 2 (a level once resolved)
    trust_remote_code: bool         # model.trust_remote_code
    prompts_per_step: int           # env.num_envs: with the two below, what a step's KV cache must hold
    completions_per_step: int       # env.num_envs x env.repeats
    max_tokens: int                 # inference_model.max_tokens
    lora_rank: int | None = None    # train_model.lora.sync resolved to adapter: the engine's max_lora_rank, else None
    max_restarts: int = 3           # inference_model.max_engine_restarts
    push_timeout_s: float = 300.0   # inference_model.push_timeout_s
    generate_timeout_s: float = 1800.0  # inference_model.generate_timeout_s
    start_timeout_s: float = 1800.0  # inference_model.start_timeout_s

    @classmethod
    def from_config(cls, cfg: DictConfig, plan: BatchPlan, engine_on: str, memory_share: float = 1.0) -> EngineSettings:
        """``engine_on``: the device the engines run on (a GPU's or the CPU); ``memory_share``: each engine's share of
        its GPU (a rollout actor's ``ray.actor_num_gpus``), which scales its ``gpu_memory_utilization``: two actors
        with half a GPU each take half of what one engine would."""
        inference, lora = cfg.inference_model, cfg.train_model.lora
        adapter = lora_sync(lora, str(inference.backend), engine_on.startswith("cuda")) == "adapter"
        share = inference.gpu_memory_utilization
        utilization = float(UNSETTLED_ENGINE_SHARE if share == "auto" else share) * memory_share
        return cls(backend=str(inference.backend), gpu_memory_utilization=utilization,
                   max_model_len=int(inference.max_model_len), engine_process=str(inference.engine_process),
                   weight_transfer=str(inference.weight_transfer), sleep=inference.sleep,
                   trust_remote_code=bool(cfg.model.trust_remote_code), prompts_per_step=plan.prompts_per_step,
                   completions_per_step=plan.completions_per_step, max_tokens=plan.max_tokens,
                   lora_rank=engine_lora_rank(check_lora(lora)["r"]) if adapter else None,
                   max_restarts=int(inference.max_engine_restarts),
                   push_timeout_s=float(inference.push_timeout_s),
                   generate_timeout_s=float(inference.generate_timeout_s),
                   start_timeout_s=float(inference.start_timeout_s))


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation needs (``eval.*``; the trainer's also ``logging.eval_frequency``)."""

    num_prompts: int | None      # eval.num_prompts
    samples: int                 # eval.samples
    temperature: float           # eval.temperature
    max_tokens: int              # eval.max_tokens, null resolved to inference_model.max_tokens
    max_model_len: int           # inference_model.max_model_len: a multi-turn episode ends before passing it
    every: int                   # logging.eval_frequency
    responses: str | None = None  # eval.responses

    @classmethod
    def from_config(cls, cfg: DictConfig, plan: BatchPlan) -> EvalSettings:
        e = cfg.eval
        return cls(num_prompts=None if e.num_prompts is None else int(e.num_prompts), samples=int(e.samples),
                   temperature=float(e.temperature),
                   max_tokens=plan.max_tokens if e.max_tokens is None else int(e.max_tokens),
                   max_model_len=int(cfg.inference_model.max_model_len), every=int(cfg.logging.eval_frequency),
                   responses=None if e.responses is None else str(e.responses))


def kl_split(cfg: DictConfig) -> tuple[float, float]:
    """``train.kl_to_ref_coeff`` as (its coefficient in the loss, in the reward): ``train.kl_coef_in_loss`` puts
    it in one of them."""
    coeff = float(cfg.train.kl_to_ref_coeff)
    return (coeff, 0.0) if cfg.train.kl_coef_in_loss else (0.0, coeff)


@dataclass(frozen=True)
class LossSettings:
    """The objective's settings (``loss.*``, and the ``train.*`` coefficients that weigh its terms), what
    :meth:`~torchrl_grpo.objective.loss.GRPOLoss.from_config` builds the loss from."""

    section: dict[str, Any]         # loss.*: the clip range, each registered family, each surrogate modifier
    max_tokens: int                 # inference_model.max_tokens: constant_sum's constant
    temperature: float              # inference_model.temperature: the log-probs' distribution
    kl_to_ref_coeff: float          # train.kl_to_ref_coeff in the loss (0 with train.kl_coef_in_loss=false)
    kl_to_inference_coeff: float    # train.kl_to_inference_coeff
    entropy_coeff: float            # train.entropy_coeff
    packed: bool                    # train.micro_batch_tokens set: the policy reads rows packed
    log_prob_chunk_bytes: int | None = None  # train.log_prob_chunk_mib (None: the device's default)

    @classmethod
    def from_config(cls, cfg: DictConfig, plan: BatchPlan) -> LossSettings:
        return cls(section=OmegaConf.to_container(cfg.loss, resolve=True),
                   max_tokens=int(cfg.inference_model.max_tokens), temperature=float(cfg.inference_model.temperature),
                   kl_to_ref_coeff=kl_split(cfg)[0], kl_to_inference_coeff=float(cfg.train.kl_to_inference_coeff),
                   entropy_coeff=float(cfg.train.entropy_coeff), packed=plan.micro_batch_tokens is not None,
                   log_prob_chunk_bytes=plan.chunk_bytes)


@dataclass(frozen=True)
class CriticSettings:
    """The ``critic.*`` keys the trainer reads (an actor-critic run's: ``loss.advantage=gae``)."""

    gamma: float                    # critic.gamma
    lmbda: float                    # critic.lmbda
    value_clip: float | None        # critic.value_clip
    whiten_advantages: bool         # critic.whiten_advantages
    enabled: bool = False           # loss.advantage=gae: the run has a critic
    model: str | None = None        # critic.model
    lr: float = 1e-5                # critic.lr

    @classmethod
    def from_config(cls, cfg: DictConfig) -> CriticSettings:
        c = cfg.critic
        return cls(gamma=float(c.gamma), lmbda=float(c.lmbda),
                   value_clip=None if c.value_clip is None else float(c.value_clip),
                   whiten_advantages=bool(c.whiten_advantages), enabled=cfg.loss.advantage == "gae",
                   model=None if c.model is None else str(c.model), lr=float(c.lr))


@dataclass(frozen=True)
class TrainSettings:
    """What the trainer needs besides its model, loss and optimizer, in its own terms."""

    group_size: int                 # env.repeats: advantages are computed per group
    micro_batch: int                # train.optim_batch_size
    accumulation: int               # train.gradient_accumulation_steps
    epochs: int                     # train.epochs
    temperature: float              # inference_model.temperature: the log-probs' distribution
    recompute_old_log_probs: bool   # loss.old_log_probs resolved (Precision.trainer_old_log_probs)
    kl_in_reward_coeff: float       # train.kl_to_ref_coeff when train.kl_coef_in_loss is false, else 0
    reward_scale: str               # loss.reward_scale
    clip_grad_norm: float | None    # optimizer.clip_grad_norm
    mixed_precision: bool           # train.mixed_precision resolved: bf16 autocast (Precision.autocast_bf16)
    max_nonfinite_updates: int      # train.max_nonfinite_updates
    seed: int                       # train.seed
    no_signal_patience: int = 0     # train.no_signal_patience
    min_ess: float = 0.5            # train.min_ess
    no_signal_stop: bool = False    # train.no_signal_stop
    micro_batch_tokens: int | None = None  # train.micro_batch_tokens
    log_prob_chunk_bytes: int | None = None  # train.log_prob_chunk_mib (None: the device's default)
    reference: bool = False         # train.kl_to_ref_coeff > 0: a KL to the reference model, in the loss or reward
    sync_iter: bool = True          # train.sync_iter
    weight_sync_check: bool = True  # train.weight_sync_check
    weight_sync_tolerance: float | None = None  # train.weight_sync_tolerance
    check_memory: bool = True       # train.check_memory
    rank_timeout_s: float = 1800.0  # train.rank_timeout_s
    auto_cpu_memory_share: float = 0.5  # train.auto_cpu_memory_share

    @classmethod
    def from_config(cls, cfg: DictConfig, plan: BatchPlan, precision: Precision) -> TrainSettings:
        clip = cfg.optimizer.clip_grad_norm
        return cls(
            group_size=plan.group_size, micro_batch=plan.micro_batch, accumulation=plan.accumulation,
            micro_batch_tokens=plan.micro_batch_tokens, log_prob_chunk_bytes=plan.chunk_bytes,
            epochs=plan.epochs, temperature=float(cfg.inference_model.temperature),
            recompute_old_log_probs=precision.trainer_old_log_probs,
            kl_in_reward_coeff=kl_split(cfg)[1],
            reward_scale=cfg.loss.reward_scale, clip_grad_norm=None if not clip else float(clip),
            mixed_precision=precision.autocast_bf16,
            max_nonfinite_updates=int(cfg.train.max_nonfinite_updates), seed=int(cfg.train.seed),
            no_signal_patience=int(cfg.train.no_signal_patience), min_ess=float(cfg.train.min_ess),
            no_signal_stop=bool(cfg.train.no_signal_stop), reference=float(cfg.train.kl_to_ref_coeff) > 0,
            sync_iter=bool(cfg.train.sync_iter), weight_sync_check=bool(cfg.train.weight_sync_check),
            weight_sync_tolerance=cfg.train.weight_sync_tolerance, check_memory=bool(cfg.train.check_memory),
            rank_timeout_s=float(cfg.train.rank_timeout_s),
            auto_cpu_memory_share=float(cfg.train.auto_cpu_memory_share),
        )


@dataclass(frozen=True)
class ActorSettings:
    """What the async run's Ray rollout actors need (``ray.*``, and the async ``train.*`` keys)."""

    address: str | None             # ray.address
    init: dict[str, Any]            # ray.init
    num_actors: int                 # ray.num_actors
    actor_num_cpus: float           # ray.actor_num_cpus
    collect_timeout_s: float        # ray.collect_timeout_s
    max_actor_restarts: int         # ray.max_actor_restarts
    weight_update_frequency: int    # train.weight_update_frequency
    max_staleness: int              # train.max_staleness
    gpus: ActorGpus                 # where the actors' engines run (config.placement.place_actors)
    streaming: bool = False         # ray.streaming

    @property
    def actor_num_gpus(self) -> float:
        """``ray.actor_num_gpus`` resolved (``auto`` too)."""
        return self.gpus.per_actor

    @classmethod
    def from_config(cls, cfg: DictConfig, gpus: ActorGpus) -> ActorSettings:
        ray = cfg.ray
        return cls(address=None if ray.address is None else str(ray.address),
                   init=OmegaConf.to_container(ray.init, resolve=True) if ray.init is not None else {},
                   num_actors=int(ray.num_actors), actor_num_cpus=float(ray.actor_num_cpus),
                   collect_timeout_s=float(ray.collect_timeout_s),
                   max_actor_restarts=int(ray.max_actor_restarts),
                   weight_update_frequency=int(cfg.train.weight_update_frequency),
                   max_staleness=int(cfg.train.max_staleness), gpus=gpus, streaming=bool(ray.streaming))


@dataclass(frozen=True)
class LoggingSettings:
    """What the run's telemetry needs (``logging.*``): the console, ``metrics.csv``, ``samples.jsonl``, wandb,
    TensorBoard, MLflow."""

    log_frequency: int          # logging.log_frequency (0 taken as 1)
    samples_frequency: int      # logging.samples_frequency
    show_completions: int       # logging.show_completions
    progress_bar: bool          # logging.progress_bar
    verbose: bool               # logging.verbose
    wandb: bool                 # logging.wandb.enabled
    wandb_mode: str             # logging.wandb.mode
    wandb_project: str | None   # logging.wandb.project
    run_name: str | None        # logging.experiment_name
    exp_name: str               # train.exp_name
    tensorboard: bool = False   # logging.tensorboard
    mlflow: bool = False        # logging.mlflow.enabled
    mlflow_tracking_uri: str | None = None  # logging.mlflow.tracking_uri
    mlflow_experiment: str | None = None    # logging.mlflow.experiment

    @classmethod
    def from_config(cls, cfg: DictConfig) -> LoggingSettings:
        log, wandb, mlflow = cfg.logging, cfg.logging.wandb, cfg.logging.mlflow
        return cls(log_frequency=max(1, int(log.log_frequency)), samples_frequency=int(log.samples_frequency),
                   show_completions=int(log.show_completions), progress_bar=bool(log.progress_bar),
                   verbose=log.verbose is True, wandb=bool(wandb.enabled), wandb_mode=str(wandb.mode),
                   wandb_project=wandb.project, run_name=log.experiment_name or None,
                   exp_name=str(cfg.train.exp_name), tensorboard=bool(log.tensorboard),
                   mlflow=bool(mlflow.enabled), mlflow_tracking_uri=mlflow.tracking_uri,
                   mlflow_experiment=mlflow.experiment)


@dataclass(frozen=True)
class CheckpointSettings:
    """What saves and resumes checkpoints (``logging.checkpoint_*``, ``train.resume``)."""

    directory: str      # logging.checkpoint_dir
    frequency: int      # logging.checkpoint_frequency
    keep: int           # logging.keep_checkpoints
    resume: Any         # train.resume
    ranks: int          # the data-parallel ranks that write one (1: one process)

    @classmethod
    def from_config(cls, cfg: DictConfig, placement: Placement) -> CheckpointSettings:
        log = cfg.logging
        return cls(directory=str(log.checkpoint_dir), frequency=int(log.checkpoint_frequency),
                   keep=int(log.keep_checkpoints), resume=cfg.train.resume, ranks=placement.ranks)
