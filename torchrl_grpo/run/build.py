"""The composition root of grpo.py, grpo-async.py and evaluate.py: config -> the objects a run needs.

Each ``build_*`` turns one part of the config into one object; :func:`build_sync` and :func:`build_async`
wire them into a :class:`~torchrl_grpo.run.loop.Run` over its batch source. Heavy imports (transformers,
vLLM) happen here, after the config was validated, so that a bad key fails in a second with one line.
"""
from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.placement import adopt_torchrun_ranks, torchrun_launch
from torchrl_grpo.config.precision import LOW_PRECISION, dtype_name, lost_update_share, native_bf16
from torchrl_grpo.config.schema import Env
from torchrl_grpo.config.settings import LossSettings, ModelSettings, OptimizerSettings, TrainSettings
from torchrl_grpo.config.spec import RunSpec, resolve_run
from torchrl_grpo.core.allocator import describe_allocator
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines.factory import policy_engine, run_engine
from torchrl_grpo.engines.weight_check import WeightCheck
from torchrl_grpo.episodes.lengths import fit_prompts
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.trajectories import PromptSampler
from torchrl_grpo.episodes.turn_envs import Turns
from torchrl_grpo.models.adapter import AdapterOff, is_lora
from torchrl_grpo.models.loading import load_policy, load_tokenizer, sparse_tied_embedding_gradient, without_dropout
from torchrl_grpo.models.packed_attention import attend_by_row
from torchrl_grpo.models.sources import context_limit, resolve_model
from torchrl_grpo.objective.critic import token_values
from torchrl_grpo.objective.log_probs import packing_gap
from torchrl_grpo.objective.loss import GRPOLoss
from torchrl_grpo.parallel.ranks import DataParallel, hf_model, shard_model
from torchrl_grpo.run.evaluation import Evaluator
from torchrl_grpo.run.loop import Run
from torchrl_grpo.run.memory import check_memory, settle_auto
from torchrl_grpo.run.sources import ActorSource, LocalSource, StreamSource
from torchrl_grpo.run.state import RunState, TrainerState
from torchrl_grpo.tasks import Task, check_env
from torchrl_grpo.training.critic import Critic
from torchrl_grpo.training.trainer import Trainer
from torchrl_grpo.training.weight_sync import ActorSync, EngineSync, PolicyWeights, samples_with_policy


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_policy(model: ModelSettings, model_path: str, devices: list[str], dtype: torch.dtype,
                 state: RunState | None = None):
    """The trained policy, its weights in ``dtype``: base weights (or, resuming, the checkpoint's: ``state`` says
    which), LoRA if enabled, dropout off (so that the ratio is exactly 1 on fresh data), in eval mode outside
    optimisation."""
    lora = model.lora
    policy = load_policy(
        state.policy_folder(model_path, lora is not None) if state is not None else model_path,
        dtype=dtype,
        device=devices,
        gradient_checkpointing=model.gradient_checkpointing,
        lora=lora,
        attn_implementation=model.attn_implementation,
        trust_remote_code=model.trust_remote_code,
    )
    if state is not None and lora is not None:
        state.restore_adapter(policy)
    without_dropout(policy)
    if model.compile:
        policy.forward = torch.compile(policy.forward)
    return policy.eval()


def build_critic(spec: RunSpec, model_path: str, devices: list[str], parallel: DataParallel | None,
                 state: RunState | None = None) -> Critic:
    """The value model of an actor-critic run (``loss.advantage=gae``): from the checkpoint's ``critic/`` when
    resuming one that has it, else ``critic.model`` (null: the policy's starting model) under a fresh value head; in
    the trained weights' precision on the policy's devices, sharded like it; its own optimizer (``critic.lr``) and
    schedule."""
    trust, critic = spec.model.trust_remote_code, spec.critic
    saved = None if state is None else state.critic_folder()
    if saved is not None:
        source = str(saved)
    else:
        source = model_path if critic.model is None else resolve_model(critic.model, trust, "critic.model")
    model = load_policy(source, dtype=spec.precision.train_weights, device=devices,
                        gradient_checkpointing=spec.model.gradient_checkpointing,
                        attn_implementation=spec.model.attn_implementation, trust_remote_code=trust,
                        value_head=True)
    if parallel is not None:
        model = shard_model(model, spec.precision.autocast_bf16)
    optimizer = build_optimizer(spec.optimizer, model, lr=critic.lr)
    return Critic(model.eval(), optimizer, critic, build_scheduler(spec.optimizer, optimizer, spec.plan))


def build_engine(spec: RunSpec, model_path: str, policy, tokenizer, seed: int,
                 engine_process: str | None = None, parallel: DataParallel | None = None):
    """The rollout engine: vLLM on its device(s) (in the process ``engine_process`` says, default
    ``inference_model.engine_process``), or the transformers fallback sharing the trained policy (with
    ``parallel``, sharded over the ranks, which sample together)."""
    if spec.engine.backend == "transformers":
        return policy_engine(policy, tokenizer, seed=seed, parallel=parallel)
    return run_engine(spec.engine, spec.precision.engine, model_path, spec.placement.inference, seed,
                      **({"engine_process": engine_process} if engine_process else {}))


def build_weight_check(settings: TrainSettings, trainer: Trainer, tokenizer, dtype: torch.dtype) -> WeightCheck | None:
    """The weight sync check (``train.weight_sync_check``) between the trainer and engines of ``dtype``."""
    if not settings.weight_sync_check:
        return None
    return WeightCheck(trainer.policy, tokenizer, dtype, settings.weight_sync_tolerance,
                       log_probs=PolicyWeights(trainer.policy, trainer.parallel).probe_log_probs)


def build_optimizer(opt: OptimizerSettings, policy, lr: float | None = None) -> torch.optim.Optimizer:
    """``optimizer.name`` over the trainable parameters, at ``optimizer.lr`` unless ``lr`` is given. Adam(W) runs
    torch's fused kernel on plain CPU or CUDA tensors, where on CPU torch would pick its per-tensor loop (SmolLM2:
    0.24 -> 0.09 s a step, ``bench/step_breakdown.py``); sharded (DTensor) parameters keep torch's default."""
    from torch.distributed.tensor import DTensor

    params = [p for p in policy.parameters() if p.requires_grad]
    lr = opt.lr if lr is None else lr
    if opt.name == "SGD":
        return torch.optim.SGD(params, lr=lr, weight_decay=opt.weight_decay)
    cls = torch.optim.AdamW if opt.name == "AdamW" else torch.optim.Adam
    fused = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") for p in params) or None
    return cls(params, lr=lr, eps=opt.eps, weight_decay=opt.weight_decay, fused=fused)


def build_scheduler(opt: OptimizerSettings, optimizer: torch.optim.Optimizer,
                    plan) -> torch.optim.lr_scheduler.LRScheduler:
    """``optimizer.scheduler`` with ``optimizer.warmup_steps``: transformers' schedules (TRL's and the HF
    Trainer's), over the run's optimizer steps (``total steps x optimizer steps per step``)."""
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[opt.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=int(opt.warmup_steps),
                         num_training_steps=plan.total_steps * plan.optimizer_steps_per_step)


def build_loss(settings: LossSettings, policy) -> GRPOLoss:
    return GRPOLoss.from_config(
        policy, settings.section, max_tokens=settings.max_tokens, temperature=settings.temperature,
        kl_to_ref_coeff=settings.kl_to_ref_coeff, kl_to_inference_coeff=settings.kl_to_inference_coeff,
        entropy_coeff=settings.entropy_coeff, packed=settings.packed,
        chunk_bytes=settings.log_prob_chunk_bytes,
    )


def check_task_keys(spec: RunSpec) -> None:
    """The ``env`` keys, ``env.eval``'s too, against the chosen task's settings and the keys the rest of the run reads
    (:class:`~torchrl_grpo.config.schema.Env`): one line naming a key no one reads, before anything is loaded."""
    check_env(spec.task, [field.name for field in dataclasses.fields(Env)])


def build_eval_task(spec: RunSpec) -> tuple[Task, Turns]:
    """The task's evaluation split and its episodes' turns: ``env`` with ``env.eval`` merged over it (GSM8K's test
    split, another seed for generated tasks, reasoning-gym's held-out tasks)."""
    return build_episode_task(spec.eval_task)


def build_eval_engine(spec: RunSpec, task: Task, turns: Turns):
    """(engine, tokenizer) for ``evaluate.py``: the configured backend on ``model.name``, no trainer; the rows of
    the evaluation ``task`` that cannot fit the engine's context left out first (:func:`fit_lengths`)."""
    trust = spec.model.trust_remote_code
    model_path = resolve_model(spec.model.name, trust)
    tokenizer = load_tokenizer(model_path, trust)
    fit_lengths(spec, model_path, tokenizer, None, (task, turns))
    policy = None
    if spec.engine.backend == "transformers":
        policy = load_policy(model_path, dtype=spec.precision.engine, device=spec.placement.inference,
                             trainable=False, trust_remote_code=trust)
    return build_engine(spec, model_path, policy, tokenizer, seed=spec.train.seed), tokenizer


def build_trainer(spec: RunSpec, model_path: str, parallel: DataParallel | None = None,
                  state: RunState | None = None) -> Trainer:
    """Policy (from ``state``'s checkpoint when resuming), reference when a KL to it is on (with LoRA, the policy
    with its adapter off: :class:`~torchrl_grpo.models.adapter.AdapterOff`), loss and optimizer; with
    ``parallel`` both models on the rank's own device (its GPU, or the CPU) and sharded over the ranks (FSDP2,
    with its bf16 policy under mixed precision) before the optimizer is built."""
    train_on, ref_on, precision = spec.placement.train, spec.placement.ref, spec.precision
    if parallel is not None:
        train_on = ref_on = [str(parallel.device)]
    elif train_on[0].startswith("cuda"):  # what weight pushes stage on (ranks set theirs in parallel.ranks)
        torch.cuda.set_device(train_on[0])
    policy = build_policy(spec.model, model_path, train_on, precision.train_weights, state)
    if parallel is None or parallel.rank == 0:
        warn_lost_updates(policy, precision.train_weights, spec.optimizer.lr)
    ref_policy, free_reference = None, spec.train.reference and is_lora(policy)
    if spec.train.reference and not free_reference:
        ref_policy = load_policy(model_path, dtype=precision.reference, device=ref_on, trainable=False,
                                 trust_remote_code=spec.model.trust_remote_code)
    mixed = precision.autocast_bf16
    if parallel is not None:
        policy = shard_model(policy, mixed)
        ref_policy = None if ref_policy is None else shard_model(ref_policy, mixed)
    elif not spec.model.compile:  # FSDP2 reduces dense gradients; torch.compile was not tried with sparse ones
        sparse_tied_embedding_gradient(policy)
    if mixed and not native_bf16(train_on[0]):
        print("warning: train.mixed_precision=true on a CPU without native bf16 (AVX-512 BF16 or AMX): bf16 is "
              "emulated and slower than float32 here; set train.mixed_precision=false", file=sys.stderr, flush=True)
    optimizer = build_optimizer(spec.optimizer, policy)
    critic = None
    if spec.critic.enabled:
        critic = build_critic(spec, model_path, train_on, parallel, state)
    if spec.train.micro_batch_tokens is not None:
        for model in (policy, ref_policy, None if critic is None else critic.model):
            if model is not None:
                attend_by_row(model)
        check_packing_keeps_rows_apart(policy)
        if critic is not None:
            check_packing_keeps_rows_apart(critic.model, lambda m, rows, attention: token_values(
                m, rows, attention, attention, packed=True))
    if free_reference:  # the policy with its adapter off: the base model, no second copy of it
        ref_policy, ref_on = AdapterOff(policy), train_on
    return Trainer(policy, ref_policy, build_loss(spec.loss, policy), optimizer, spec.train, torch.device(train_on[0]),
                   torch.device(ref_on[0]) if ref_policy is not None else None, parallel,
                   build_scheduler(spec.optimizer, optimizer, spec.plan), critic)


def warn_lost_updates(policy, dtype: torch.dtype, lr: float) -> None:
    """One warning when master weights in ``dtype`` would keep most entries unchanged at learning rate ``lr``
    (:func:`~torchrl_grpo.config.precision.lost_update_share`): such a run trains, but learns little."""
    if dtype not in LOW_PRECISION:
        return
    share = lost_update_share((p for p in policy.parameters() if p.requires_grad), lr, dtype)
    if share > 0.5:
        print(f"warning: train_model.torch_dtype={dtype_name(dtype)} with optimizer.lr={lr:g}: a step of that size "
              f"leaves {share:.1%} of the weight-matrix entries unchanged (below half a {dtype_name(dtype)} ulp), so "
              "the run learns little; set train_model.torch_dtype=float32 (auto): float32 master weights, still "
              "computing in bf16 (train.mixed_precision)", file=sys.stderr, flush=True)


def check_packing_keeps_rows_apart(policy, read=None) -> None:
    """``train.micro_batch_tokens`` reads rows packed end to end: refused in one line for a model (the policy, or with
    ``read`` the critic) whose attention lets a row see the one before it
    (:func:`~torchrl_grpo.objective.log_probs.packing_gap`)."""
    gap = packing_gap(policy, read)
    if gap > 1e-3:  # 0 on the CPU in float32 and bf16; a row that sees another moves by 0.4 (tiny) to 2.8 (SmolLM2)
        name = type(hf_model(policy)).__name__
        raise ConfigError(f"train.micro_batch_tokens: {name} lets packed rows attend to each other (a row's log-probs "
                          f"moved by {gap:.3g} with the row before it; its attention ignores restarting position "
                          "ids); set train.micro_batch_tokens=null")


def build_follower(spec: RunSpec, parallel: DataParallel) -> tuple[object, ...]:
    """What a data-parallel follower rank holds (:func:`torchrl_grpo.parallel.launcher.follow_rank`): the trainer
    rank 0 builds, sharded alike, what a checkpoint and a push gather of it, and the transformers engine over its
    policy, for its share of what rank 0 samples with the sharded policy (the transformers engine, async
    evaluation)."""
    seed_everything(spec.train.seed)
    trust = spec.model.trust_remote_code
    model_path = resolve_model(spec.model.name, trust)
    trainer = build_trainer(spec, model_path, parallel)
    return (trainer, TrainerState(trainer), PolicyWeights(trainer.policy, parallel),
            policy_engine(trainer.policy, load_tokenizer(model_path, trust), parallel=parallel))


@dataclass
class Inputs:
    """Everything a run reads from the user, checked: the config (resolved into the run spec), the checkpoint to
    resume from, the task's data and reward functions, the model folder and its tokenizer."""

    spec: RunSpec
    state: RunState
    task: Task
    turns: Turns
    eval_task: tuple[Task, Turns] | None
    model_path: str
    tokenizer: object


def read_inputs(cfg: DictConfig, run_dir: Path) -> Inputs:
    """Take torchrun's ranks as the train devices, resolve the run spec (:func:`resolve_run`: every key checked,
    devices placed, precisions resolved) and check the task's ``env`` keys (:func:`check_task_keys`), seed the
    global RNG (before any model is built), build the task and the evaluation task (``logging.eval_frequency > 0``),
    resolve the model, the settings left to auto (:func:`settle_auto`, from its shape), the checkpoint to resume
    from and the tokenizer: every input is read here, so that a bad one fails in one line before the batch plan is
    printed and before any model or engine is built. Rank 0 reads them before any other rank starts (or, under
    torchrun, before it lets them join): a model built into the cache is built once, and the other ranks find it
    there."""
    if (launch := torchrun_launch()) is not None:
        adopt_torchrun_ranks(cfg, launch)
    spec = resolve_run(cfg)
    check_task_keys(spec)
    seed_everything(spec.train.seed)
    task, turns = build_episode_task(spec.task)
    eval_task = build_eval_task(spec) if spec.eval.every > 0 else None

    model_path = resolve_model(spec.model.name, spec.model.trust_remote_code)
    if spec.critic.enabled and spec.critic.model is not None:  # a bad critic.model fails here, in one line
        resolve_model(spec.critic.model, spec.model.trust_remote_code, config_key="critic.model")
    spec, _ = settle_auto(cfg, spec, model_path)  # before the state records the config
    state = RunState(spec, run_dir)
    tokenizer = load_tokenizer(model_path, spec.model.trust_remote_code)
    fit_lengths(spec, model_path, tokenizer, (task, turns), eval_task)
    return Inputs(spec, state, task, turns, eval_task, model_path, tokenizer)


def fit_lengths(spec: RunSpec, model_path: str, tokenizer, task: tuple[Task, Turns] | None,
                eval_task: tuple[Task, Turns] | None) -> None:
    """Before any engine starts: ``inference_model.max_model_len`` within the model's own context, and the rows
    of ``task`` (and ``eval_task``, with the evaluation's completion budget) whose prompt and completion cannot
    fit it left out with one warning line, or refused (``env.overlong_prompts``;
    :mod:`torchrl_grpo.episodes.lengths`)."""
    max_model_len, limit = spec.collect.max_model_len, context_limit(model_path)
    if limit is not None and max_model_len > limit:
        raise ConfigError(f"inference_model.max_model_len={max_model_len} is longer than the model's context "
                          f"({limit} tokens: max_position_embeddings in {model_path}/config.json); set "
                          f"inference_model.max_model_len={limit} or less")
    for where, checked, max_tokens in (("env", task, spec.plan.max_tokens), ("env.eval", eval_task,
                                                                              spec.eval.max_tokens)):
        if checked is None:
            continue
        rows, turns = checked
        dropped = fit_prompts(rows, tokenizer, max_tokens, max_model_len, spec.collect.overlong_prompts, where,
                              turns.max_turns)
        if dropped is not None:
            print(dropped.message, file=sys.stderr, flush=True)


@dataclass
class Common:
    """What both loops start from (the sync one adds an engine and a collector, the async one Ray actors)."""

    spec: RunSpec
    state: RunState
    task: Task
    turns: Turns
    tokenizer: object
    model_path: str
    trainer: Trainer
    evaluator: Evaluator | None


def build_common(i: Inputs, parallel: DataParallel | None = None) -> Common:
    """From the checked inputs (:func:`read_inputs`): the batch plan printed, the evaluator and the trainer."""
    plan = i.spec.plan
    print(f"batch plan:\n{plan.table()}\nplacement: {i.spec.placement.describe()}\nallocator: "
          f"{describe_allocator()}", flush=True)
    check_memory(i.spec, i.model_path)
    evaluator = None
    if i.eval_task is not None:
        eval_task, eval_turns = i.eval_task
        evaluator = Evaluator(eval_task, i.tokenizer, i.spec.eval, plan.total_steps, eval_turns)
    trainer = build_trainer(i.spec, i.model_path, parallel, i.state)
    return Common(i.spec, i.state, i.task, i.turns, i.tokenizer, i.model_path, trainer, evaluator)


def build_sync(cfg: DictConfig, inputs: Inputs, parallel: DataParallel | None = None) -> Run:
    """The sync run: the common pieces and a collector over an engine holding the policy's weights (seeded
    with the step a resume starts after); ``parallel``: this is rank 0 of data-parallel ranks."""
    c = build_common(inputs, parallel)
    print(f"precision: {c.spec.precision.describe(cfg)}", flush=True)
    def new_engine(restart: int = 0, step: int = c.state.step):
        """The engine, seeded by the step it starts at (and apart for each restart after a dead one)."""
        return build_engine(c.spec, c.model_path, c.trainer.policy, c.tokenizer,
                            seed=c.spec.train.seed + step + 1_000_000 * restart,
                            engine_process="own" if parallel is not None else None, parallel=parallel)

    engine = new_engine()
    weights = EngineSync(c.trainer, engine, None if samples_with_policy(c.trainer, engine) else (
        build_weight_check(c.spec.train, c.trainer, c.tokenizer, c.spec.precision.engine)),
        adapter=c.spec.engine.lora_rank is not None)
    c.state.resume_engines(weights)
    if (line := weights.startup()) is not None:
        print(line, flush=True)
    collector = Collector(c.task, c.tokenizer, engine, PromptSampler(len(c.task.rows), c.spec.collect.prompt_seed),
                          c.spec.collect, c.turns)
    vllm = c.spec.engine.backend == "vllm"  # the transformers engine is the policy itself: it cannot die apart
    sleeps_on_gpu = vllm and int(c.spec.engine.sleep) > 0 and c.trainer.device.type == "cuda"
    source = LocalSource(collector, weights, overlap=not c.spec.train.sync_iter,
                         new_engine=new_engine if vllm else None, max_restarts=c.spec.engine.max_restarts,
                         engine_sleeps_on_gpu=sleeps_on_gpu)
    return Run(source, c.trainer, c.state, c.spec, c.evaluator)


def build_async(cfg: DictConfig, inputs: Inputs, parallel: DataParallel | None = None) -> Run:
    """The async run: the common pieces; the Ray actors (with their engines and collectors) start in the loop.
    ``parallel``: this is rank 0 of data-parallel ranks."""
    c = build_common(inputs, parallel)
    print(f"precision: {c.spec.precision.describe(cfg)}", flush=True)
    engine_dtype = c.spec.precision.engine
    weights = ActorSync(c.trainer, build_weight_check(c.spec.train, c.trainer, c.tokenizer, engine_dtype), engine_dtype,
                        adapter=c.spec.engine.lora_rank is not None)
    if c.spec.actors.streaming:
        source = StreamSource(c.spec, weights, c.tokenizer, c.task, c.turns)
    else:
        source = ActorSource(c.spec, weights, c.tokenizer, c.task.reward_names)
    return Run(source, c.trainer, c.state, c.spec, c.evaluator)
