"""The sync GRPO loop: collect -> (reference log-probs) -> advantages -> epochs of micro-batches with
gradient accumulation and clipping -> optimizer -> push weights to the engine, until the plan's steps.

Everything it needs arrives built in :class:`Parts` (``grpo_utils.build`` makes them from the config), so
the loop reads as the algorithm and nothing else.
"""
from __future__ import annotations

import contextlib
import copy
import math
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from torchrl_grpo import checkpoint
from torchrl_grpo.config import BatchPlan
from torchrl_grpo.evaluation import eval_due, evaluate_policy
from torchrl_grpo.objective import GRPOLoss, first_completion_column, token_log_probs, total_loss
from torchrl_grpo.objective_terms import group_advantages, overlong_penalty
from torchrl_grpo.tasks import Task, per_task_means
from torchrl_grpo.telemetry import Telemetry, summarize
from torchrl_grpo.trajectories import PromptSampler, build_batch, prompt_token_ids, reward_tensors


@dataclass
class Parts:
    cfg: object
    plan: BatchPlan
    run_dir: Path
    task: Task
    tokenizer: object
    policy: torch.nn.Module
    ref_policy: torch.nn.Module | None
    engine: object
    loss: GRPOLoss
    optimizer: torch.optim.Optimizer
    train_device: torch.device
    ref_device: torch.device | None
    push_weights: callable  # () -> None: the trainer's weights into the engine
    resume_from: Path | None  # the checkpoint the builder loaded the weights from, if resuming
    eval_task: Task | None = None  # the evaluation split, when logging.eval_frequency > 0


def run_sync(parts: Parts) -> dict:
    """Train until ``plan.total_steps``; returns the end-of-run summary (first vs last steps)."""
    cfg, plan = parts.cfg, parts.plan
    sampler = PromptSampler(len(parts.task.rows), int(cfg.env.seed))
    ckpt_dir = parts.run_dir / cfg.logging.checkpoint_dir
    generator = torch.Generator().manual_seed(int(cfg.train.seed))
    start_step = _resume(parts, sampler, generator)
    telemetry = Telemetry(cfg, parts.run_dir, plan.total_steps, start_step, resumed=start_step > 0)
    prefetch = None if cfg.train.sync_iter else Prefetch(parts, sampler, version=start_step)
    try:
        if start_step == 0 and eval_due(cfg, 0, plan.total_steps):
            telemetry.record(0, evaluate_policy(parts, parts.engine))
        with StopRequest() as stop:
            for step in range(start_step + 1, plan.total_steps + 1):
                _step(parts, step, sampler, generator, telemetry, prefetch)
                if _checkpoint_due(cfg, step, plan.total_steps) or stop.requested:
                    _save(parts, ckpt_dir, step, prefetch.position if prefetch else sampler, generator)
                if stop.requested:
                    telemetry.print(f"stopped after step {step} (checkpoint saved); continue with "
                                    f"train.resume=auto hydra.run.dir={parts.run_dir}")
                    break
    finally:
        if prefetch is not None:
            prefetch.close()
        telemetry.close()
    window = max(1, min(5, plan.total_steps // 4))
    summary = summarize(telemetry.csv.rows, ["reward"] + [f"reward/{n}" for n in parts.task.reward_names], window)
    _print_summary(telemetry, summary, window)
    return summary


def _step(parts: Parts, step: int, sampler: PromptSampler, generator: torch.Generator, telemetry: Telemetry,
          prefetch: Prefetch | None = None):
    """Collect, optimize, push the weights, log. With ``prefetch`` the next step's generation overlaps this
    step's scoring and optimizer, and the push waits for it."""
    started = time.perf_counter()
    version, sampled = prefetch.next(more=step < parts.plan.total_steps) if prefetch else (step - 1, None)
    batch, rollout_metrics, samples = collect(parts, sampler, version, sampled)
    train_metrics = optimize(parts, batch, generator)
    waits = {"batch_wait_time": prefetch.finish()} if prefetch else {}
    push_started = time.perf_counter()
    parts.push_weights()
    if prefetch:
        prefetch.version = step
    metrics = {**rollout_metrics, **train_metrics, **waits, "policy_version": version, "staleness": step - 1 - version,
               "weight_push_time": time.perf_counter() - push_started, "step_time": time.perf_counter() - started}
    if eval_due(parts.cfg, step, parts.plan.total_steps):
        metrics.update(evaluate_policy(parts, parts.engine))
    telemetry.log(step, metrics, samples)


class StopRequest:
    """The first SIGINT/SIGTERM asks the loop to stop after the current step with a checkpoint (nothing
    is lost); a second one interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class Prefetch:
    """``train.sync_iter=false``: the next step's groups are generated in a background thread while this step
    is scored and optimized, as in the original recipe: batch k+1 is sampled by the weights before step k's
    update (staleness <= 1). vLLM runs in this process and is used by one thread at a time: the weight push
    (and any evaluation) comes after :meth:`finish`. Policy-dependent log-probs are computed in the trainer
    when the batch is taken. A checkpoint saves :attr:`position`, the prompt order before the prefetched
    prompts: on resume that batch is simply sampled again, with the checkpoint's weights. The in-process
    engine samples from torch's global generator (swapped in around each generate): a trainer that draws
    from it too (LoRA dropout) makes runs not bit-reproducible."""

    def __init__(self, parts: Parts, sampler: PromptSampler, version: int):
        self.parts, self.sampler = parts, sampler
        self.version = version  # the policy version of the weights in the engine
        self.position = copy.deepcopy(sampler)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-prefetch")
        self._running, self._ready = None, None

    def next(self, more: bool) -> tuple[int, tuple[list[Group], dict]]:
        """This step's (policy version, groups): prefetched during the last step, or generated now (a run's
        first step); then, if ``more`` steps follow, starts generating the next step's at the engine's weights."""
        ready = self._ready or (self.version, sample_groups(self.parts, self.sampler))
        self._ready, self.position = None, copy.deepcopy(self.sampler)
        if more:
            self._running = (self.version, self._pool.submit(sample_groups, self.parts, self.sampler))
        return ready

    def finish(self) -> float:
        """Wait for the generation in flight (before the engine may take new weights); returns the seconds waited."""
        if self._running is None:
            return 0.0
        started = time.perf_counter()
        version, future = self._running
        self._ready, self._running = (version, future.result()), None
        return time.perf_counter() - started

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # the engine must not be closed under a generate in flight


@dataclass
class Group:
    """One prompt, its G completions and their reward components (task rewards, unweighted)."""

    row: dict
    prompt: list[int]
    completions: list
    components: list[dict]


def sample_groups(parts: Parts, sampler: PromptSampler) -> tuple[list[Group], dict]:
    """The step's ``prompts_per_step`` groups. With ``loss.dynamic_sampling`` (DAPO), groups whose rewards
    all tie (no signal) are replaced by fresh prompts for up to ``loss.max_resample_rounds`` more rounds;
    if still short, tied groups fill the rest so that the step keeps its size. Ties are judged on the task
    reward plus the overlong penalty, before any KL penalty (which would untie everything)."""
    cfg, plan, task = parts.cfg, parts.plan, parts.task
    dynamic = bool(cfg.loss.dynamic_sampling)
    kept, spare, rounds, sampled, generation_time = [], [], 0, 0, 0.0
    while len(kept) < plan.prompts_per_step and (rounds == 0 or (dynamic and rounds <= cfg.loss.max_resample_rounds)):
        rows = [task.rows[i] for i in sampler.take(plan.prompts_per_step - len(kept))]
        prompts = prompt_token_ids(task, parts.tokenizer, rows)
        started = time.perf_counter()
        completions = parts.engine.generate(
            prompts, n=plan.group_size, max_tokens=plan.max_tokens,
            temperature=float(cfg.inference_model.temperature), top_p=float(cfg.inference_model.top_p),
        )
        generation_time += time.perf_counter() - started
        for j, row in enumerate(rows):
            mine = completions[j * plan.group_size: (j + 1) * plan.group_size]
            group = Group(row, prompts[j], mine, [task.score(c.text, row) for c in mine])
            rewards = torch.tensor([task.total(c) for c in group.components]) + _overlong(parts, mine)
            (spare if dynamic and bool((rewards == rewards[0]).all()) else kept).append(group)
        rounds, sampled = rounds + 1, sampled + len(rows)
    dropped = len(spare)
    kept += spare[: plan.prompts_per_step - len(kept)]
    stats = {"generation_time": generation_time}
    if dynamic:
        stats.update({"dropped_group_fraction": dropped / sampled, "sampling_rounds": rounds})
    return kept, stats


def _overlong(parts: Parts, completions) -> torch.Tensor:
    """DAPO's soft overlong penalty per completion (``loss.overlong=soft``), else zeros."""
    lengths = torch.tensor([len(c.token_ids) for c in completions])
    if parts.cfg.loss.overlong != "soft":
        return torch.zeros(len(completions))
    return overlong_penalty(lengths, parts.plan.max_tokens, parts.cfg.loss.overlong_buffer)


def collect(parts: Parts, sampler: PromptSampler, version: int, sampled: tuple[list[Group], dict] | None = None):
    """One collection step: prompts -> G completions each -> scored, advantage-stamped batch. ``sampled``: the
    step's :func:`sample_groups` already generated (by :class:`Prefetch`), else they are generated here."""
    cfg, plan = parts.cfg, parts.plan
    groups, metrics = sampled or sample_groups(parts, sampler)
    completions = [replace(c, prompt_index=g) for g, group in enumerate(groups) for c in group.completions]
    batch = build_batch([g.prompt for g in groups], completions, plan.group_size, parts.tokenizer.pad_token_id,
                        version)
    components = [c for g in groups for c in g.components]
    batch.update(reward_tensors(parts.task, components))
    if cfg.loss.overlong == "soft":
        penalty = _overlong(parts, completions)
        batch["reward"] = batch["reward"] + penalty
        metrics["overlong_penalty_mean"] = penalty.mean().item()
    batch["old_log_probs"] = batch["sample_log_probs"]
    metrics.update(trainer_log_probs(parts, batch))
    if parts.ref_policy is not None:
        if not cfg.train.kl_coef_in_loss:  # KL penalty in the reward (k1 summed over the completion)
            kl = ((batch["sample_log_probs"] - batch["ref_log_probs"]) * batch["completion_mask"]).sum(-1)
            batch["reward"] = batch["reward"] - float(cfg.train.kl_to_ref_coeff) * kl
            metrics["kl_penalty_in_reward"] = kl.mean().item()
    advantage, tied = group_advantages(batch["reward"], plan.group_size, cfg.loss.reward_scale)
    batch["advantage"] = advantage
    lengths = batch["completion_mask"].sum(-1).float()
    metrics.update({
        "reward": batch["reward"].mean().item(),
        "reward_std": batch["reward"].std().item() if len(batch) > 1 else 0.0,
        **{f"reward/{k}": v.float().mean().item() for k, v in batch["rewards"].items()},
        "advantage_abs_mean": advantage.abs().mean().item(),
        "tied_group_fraction": tied.float().mean().item(),
        "completion_length": lengths.mean().item(),
        "completion_length_max": lengths.max().item(),
        "truncated_fraction": batch["truncated"].float().mean().item(),
        "generation_tokens_per_s": lengths.sum().item() / max(metrics["generation_time"], 1e-9),
        **per_task_means([g.row for g in groups for _ in g.completions], components,
                         [parts.task.total(c) for c in components]),
    })
    samples = [(c.text, r) for c, r in zip(completions, batch["reward"].tolist())]
    return batch, metrics, samples


def trainer_log_probs(parts: Parts, batch) -> dict:
    """The log-probs only a process holding the policy can add: the policy's own before its update
    (``loss.old_log_probs=trainer``, replacing the engine's) and the reference's; returns metrics."""
    metrics = {}
    if parts.cfg.loss.old_log_probs == "trainer":
        batch["old_log_probs"] = scored_log_probs(parts, parts.policy, parts.train_device, batch)
        gap = (batch["old_log_probs"] - batch["sample_log_probs"]).abs()[batch["completion_mask"]]
        metrics["engine_trainer_logp_gap_max"] = gap.max().item()
    if parts.ref_policy is not None:
        batch["ref_log_probs"] = scored_log_probs(parts, parts.ref_policy, parts.ref_device, batch)
    return metrics


@torch.no_grad()
def scored_log_probs(parts: Parts, model, device, batch) -> torch.Tensor:
    """Completion-token log-probs of ``batch`` under ``model`` (reference, or the policy before its update),
    computed once per step in micro-batches; 0 outside completions."""
    out = torch.zeros_like(batch["sample_log_probs"])
    temperature = float(parts.cfg.inference_model.temperature)
    for idx in torch.arange(len(batch)).split(parts.plan.micro_batch):
        mb = _trim(batch[idx]).to(device)
        logp, _ = token_log_probs(model, mb["tokens"], mb["attention_mask"], temperature,
                                  start=first_completion_column(mb["completion_mask"]))
        out[idx, : logp.shape[1]] = logp.float().cpu() * mb["completion_mask"].cpu()
    return out


def optimize(parts: Parts, batch, generator: torch.Generator) -> dict:
    """``epochs`` passes of shuffled micro-batches; one optimizer step per ``accumulation`` micro-batches."""
    cfg, plan = parts.cfg, parts.plan
    params = [p for p in parts.policy.parameters() if p.requires_grad]
    clip = cfg.optimizer.clip_grad_norm
    history: dict[str, list[float]] = {}
    trained_tokens, skipped, started = 0, 0, time.perf_counter()
    parts.policy.train()
    for _ in range(plan.epochs):
        order = torch.randperm(len(batch), generator=generator).split(plan.micro_batch)
        for first in range(0, len(order), plan.accumulation):
            micro = [_trim(batch[idx]).to(parts.train_device) for idx in order[first: first + plan.accumulation]]
            weights = [parts.loss.accumulation_weight(mb) for mb in micro]
            for mb, weight in zip(micro, weights):
                with _autocast(cfg, parts.train_device):
                    losses = parts.loss(mb)
                (total_loss(losses) * (weight / max(sum(weights), 1e-9))).backward()
                for key, value in losses.items():
                    history.setdefault(key, []).append(value.detach().float().item())
                trained_tokens += int(mb["attention_mask"].sum())
            grad_norm = torch.nn.utils.clip_grad_norm_(params, float(clip) if clip else math.inf)
            if torch.isfinite(grad_norm):
                parts.optimizer.step()
            else:  # a NaN/inf gradient would poison the weights: drop this update, say so in the metrics
                skipped += 1
            parts.optimizer.zero_grad(set_to_none=True)
            history.setdefault("grad_norm", []).append(grad_norm.item())
    parts.policy.eval()
    elapsed = time.perf_counter() - started
    metrics = {key: sum(v) / len(v) for key, v in history.items()}
    metrics["loss"] = sum(metrics[k] for k in metrics if k.startswith("loss_"))
    metrics["clip_fraction"] = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
    metrics["ratio_max"] = max(history["ratio_max"])
    metrics.update({"skipped_updates": skipped, "lr": parts.optimizer.param_groups[0]["lr"],
                    "train_time": elapsed, "train_tokens_per_s": trained_tokens / max(elapsed, 1e-9)})
    return metrics


def _trim(batch):
    """Drop the padding columns no row of this micro-batch uses."""
    used = int(batch["attention_mask"].any(0).nonzero().max()) + 1
    return batch.apply(lambda t: t[:, :used] if t.dim() == 2 else t)


def _autocast(cfg, device: torch.device):
    if cfg.train.mixed_precision and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _checkpoint_due(cfg, step: int, total: int) -> bool:
    every = int(cfg.logging.checkpoint_frequency)
    return step == total or (every > 0 and step % every == 0)


def _save(parts: Parts, ckpt_dir: Path, step: int, sampler: PromptSampler, generator: torch.Generator) -> None:
    from omegaconf import OmegaConf

    state = {
        "step": step,
        "optimizer": parts.optimizer.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": checkpoint.rng_state(),
        "shuffle_rng": generator.get_state(),
        "config": OmegaConf.to_container(parts.cfg, resolve=True),
    }
    checkpoint.save(ckpt_dir, step, parts.policy, parts.tokenizer, state, keep=int(parts.cfg.logging.keep_checkpoints))


def _resume(parts: Parts, sampler: PromptSampler, generator: torch.Generator) -> int:
    """Restore optimizer, data position and RNG from ``parts.resume_from`` (the builder loaded the weights
    from it); returns the step to continue after."""
    point = parts.resume_from
    if point is None:
        return 0
    state = checkpoint.load_state(point)
    parts.optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    checkpoint.set_rng_state(state["rng"])
    generator.set_state(state["shuffle_rng"])
    print(f"resumed from {point} (step {state['step']})", flush=True)
    return int(state["step"])


def _print_summary(telemetry: Telemetry, summary: dict, window: int) -> None:
    width = max([len(key) for key in summary] + [8])
    telemetry.print(f"{'summary:':<{width + 2}} {'first step':>12} {f'first {window} mean':>14} {f'last {window} mean':>14}")
    for key, trend in summary.items():
        telemetry.print(f"  {key:<{width}} {trend.first_step:>12.3f} {trend.first_mean:>14.3f} {trend.last_mean:>14.3f}")
    evaluated = [r for r in telemetry.csv.rows if r.get("eval/accuracy") not in (None, "")]
    if len(evaluated) > 1:  # before vs after training, on the held-out evaluation split
        first, last = evaluated[0], evaluated[-1]
        telemetry.print(f"  eval, step {int(first['step'])} -> step {int(last['step'])}: " + " | ".join(
            f"{key} {float(first[f'eval/{key}']):.3f} -> {float(last[f'eval/{key}']):.3f}" for key in ("accuracy", "reward")))
