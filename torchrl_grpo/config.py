"""Validate the composed config and derive the batch arithmetic, once, with errors that name the keys.

The batch vocabulary (see README.md):

* a *step* collects ``env.num_envs`` prompts x ``env.repeats`` completions (= ``train.dialog_turns_per_batch``);
* the step's completions are cut into micro-batches of ``train.optim_batch_size`` completions;
* ``train.gradient_accumulation_steps`` micro-batches make one optimizer step;
* ``train.epochs`` passes are made over each step's completions;
* the run lasts ``train.total_dialog_turns`` completions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from torchrl_grpo.errors import ConfigError
from torchrl_grpo.objective_terms import AGGREGATIONS, IMPORTANCE_LEVELS, KL_ESTIMATORS, OVERLONG, REWARD_SCALES


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

    def table(self) -> str:
        rows = [
            ("prompts per step", f"{self.prompts_per_step}", "env.num_envs"),
            ("completions per prompt (G)", f"{self.group_size}", "env.repeats"),
            ("completions per step", f"{self.completions_per_step}", "train.dialog_turns_per_batch"),
            ("completions per micro-batch", f"{self.micro_batch}", "train.optim_batch_size"),
            ("micro-batches per optimizer step", f"{self.accumulation}", "train.gradient_accumulation_steps"),
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
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be a positive integer")
    return value


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part) if node is not None else None
    return node


def _choice(cfg: DictConfig, key: str, choices) -> str:
    value = _get(cfg, key)
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(choices)}")
    return value


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
    accumulation = _positive_int(cfg, "train.gradient_accumulation_steps")
    if micro_batches % accumulation:
        raise ConfigError(
            f"train.gradient_accumulation_steps={accumulation} does not divide the {micro_batches} micro-batches "
            f"per step ({per_step} completions / train.optim_batch_size={micro}): pick a divisor of {micro_batches}"
        )
    epochs = _positive_int(cfg, "train.epochs")
    total = _positive_int(cfg, "train.total_dialog_turns")
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
    )


def validate(cfg: DictConfig) -> BatchPlan:
    """Check every key the trainer reads before anything heavy starts; returns the batch plan."""
    plan = batch_plan(cfg)
    if _get(cfg, "env.max_steps") != 1:
        raise ConfigError(f"env.max_steps={_get(cfg, 'env.max_steps')}: only single-turn tasks exist yet; set env.max_steps=1")
    _choice(cfg, "loss.aggregation", AGGREGATIONS)
    _choice(cfg, "loss.reward_scale", REWARD_SCALES)
    _choice(cfg, "loss.kl_estimator", KL_ESTIMATORS)
    _choice(cfg, "inference_model.backend", ("vllm", "transformers"))
    _choice(cfg, "optimizer.name", ("AdamW", "Adam", "SGD"))
    sync_iter = _get(cfg, "train.sync_iter")
    if not isinstance(sync_iter, bool):
        raise ConfigError(f"train.sync_iter={sync_iter!r}: must be true or false")
    if not sync_iter and _get(cfg, "mode") == "sync" and _get(cfg, "inference_model.backend") == "transformers":
        raise ConfigError(
            "train.sync_iter=false with inference_model.backend=transformers: that engine samples with the trained "
            "policy itself, which cannot generate while it is optimized; use inference_model.backend=vllm or "
            "train.sync_iter=true"
        )
    for key in ("loss.clip_epsilon_low", "loss.clip_epsilon_high", "train.kl_to_ref_coeff",
                "train.kl_to_inference_coeff", "train.entropy_coeff", "optimizer.weight_decay"):
        value = _get(cfg, key)
        if not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{key}={value!r}: must be a number >= 0")
    for key in ("optimizer.lr", "inference_model.temperature"):
        value = _get(cfg, key)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{key}={value!r}: must be a number > 0")
    top_p = _get(cfg, "inference_model.top_p")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ConfigError(f"inference_model.top_p={top_p!r}: must be in (0, 1]")
    if _choice(cfg, "loss.old_log_probs", ("engine", "trainer")) == "engine" and top_p < 1:
        raise ConfigError(
            f"inference_model.top_p={top_p} with loss.old_log_probs=engine: the engine's log-probs are then "
            "renormalised over the nucleus and the ratio is biased; set loss.old_log_probs=trainer (or top_p=1)"
        )
    # loss variants (docs/objective.md): types, ranges and the combinations that need each other
    aggregation = _get(cfg, "loss.aggregation")
    if _choice(cfg, "loss.importance_level", IMPORTANCE_LEVELS) == "sequence" and aggregation != "sequence_mean":
        raise ConfigError(
            f"loss.aggregation={aggregation} with loss.importance_level=sequence: the sequence ratio (GSPO) gives one "
            "loss per completion, averaged per completion; set loss.aggregation=sequence_mean"
        )
    tis_cap = _get(cfg, "loss.tis_cap")
    if tis_cap is not None:
        if not isinstance(tis_cap, (int, float)) or isinstance(tis_cap, bool) or tis_cap <= 0:
            raise ConfigError(f"loss.tis_cap={tis_cap!r}: must be a number > 0 (e.g. 2), or null to turn TIS off")
        if _get(cfg, "loss.old_log_probs") != "trainer":
            raise ConfigError(
                f"loss.tis_cap={tis_cap} with loss.old_log_probs={_get(cfg, 'loss.old_log_probs')}: the TIS weight "
                "exp(old - sample) is 1 unless the old log-probs are the trainer's; set loss.old_log_probs=trainer "
                "(or loss.tis_cap=null)"
            )
    overlong = _choice(cfg, "loss.overlong", OVERLONG)
    buffer = _get(cfg, "loss.overlong_buffer")
    if buffer is not None and (not isinstance(buffer, int) or isinstance(buffer, bool) or buffer < 1):
        raise ConfigError(
            f"loss.overlong_buffer={buffer!r}: must be a positive number of tokens, or null for "
            "inference_model.max_tokens // 5"
        )
    if overlong == "soft" and buffer is not None and buffer >= plan.max_tokens:
        raise ConfigError(
            f"loss.overlong_buffer={buffer} with inference_model.max_tokens={plan.max_tokens}: the penalty ramp must "
            f"fit in the completion budget; set loss.overlong_buffer below {plan.max_tokens} (or null for "
            f"{max(1, plan.max_tokens // 5)})"
        )
    threshold = _get(cfg, "loss.off_policy_mask_threshold")
    if threshold is not None and (
        not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold <= 0
    ):
        raise ConfigError(
            f"loss.off_policy_mask_threshold={threshold!r}: must be a number > 0 (e.g. 0.5), or null to turn "
            "the off-policy mask off"
        )
    dynamic = _get(cfg, "loss.dynamic_sampling")
    if not isinstance(dynamic, bool):
        raise ConfigError(f"loss.dynamic_sampling={dynamic!r}: must be true or false")
    rounds = _get(cfg, "loss.max_resample_rounds")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise ConfigError(f"loss.max_resample_rounds={rounds!r}: must be an integer >= 0")
    clip = _get(cfg, "optimizer.clip_grad_norm")
    if clip is not None and (not isinstance(clip, (int, float)) or clip <= 0):
        raise ConfigError(f"optimizer.clip_grad_norm={clip!r}: must be > 0, or null for no clipping")
    for key in ("logging.checkpoint_frequency", "logging.log_frequency", "logging.eval_frequency"):
        value = _get(cfg, key)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key}={value!r}: must be an integer >= 0")
    _validate_eval(cfg)
    return plan


def _validate_eval(cfg: DictConfig) -> None:
    """The eval: block (evaluate.py and the trainer's periodic evaluation)."""
    samples = _positive_int(cfg, "eval.samples")
    for key in ("eval.num_prompts", "eval.max_tokens"):
        if _get(cfg, key) is not None:
            _positive_int(cfg, key)
    temperature = _get(cfg, "eval.temperature")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise ConfigError(f"eval.temperature={temperature!r}: must be a number >= 0 (0 = greedy)")
    if samples > 1 and temperature == 0:
        raise ConfigError(f"eval.samples={samples} with eval.temperature=0: greedy decoding gives {samples} identical "
                          "responses; set eval.temperature>0 (e.g. 1.0) for pass@k, or eval.samples=1")
    responses = _get(cfg, "eval.responses")
    if responses is not None and not isinstance(responses, str):
        raise ConfigError(f"eval.responses={responses!r}: give the path of a JSONL file, or null to generate")

