"""One GRPO step, built by hand from the package's pieces, each printing what it produced.

This is what ``grpo.py`` wires together from the config (``torchrl_grpo/run/build.py``), without the config:
the task and its prompts, the vLLM engine that samples, the collector that turns groups of completions into a
TensorDict batch, the trainer with its GRPO loss and optimizer, and the weight sync that puts the update into the
engine and checks that it landed. Read it top to bottom, then ``docs/architecture.md`` for where each piece lives.

    python examples/one_step.py     # about a minute on a laptop CPU: a tiny random model, the vLLM CPU engine
"""
from __future__ import annotations

import torch

from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.settings import CollectSettings, TrainSettings
from torchrl_grpo.core.batch import Batch
from torchrl_grpo.engines.vllm import VLLMEngine
from torchrl_grpo.engines.weight_check import WeightCheck
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.trajectories import PromptSampler
from torchrl_grpo.models.loading import load_policy, load_tokenizer
from torchrl_grpo.models.sources import resolve_model
from torchrl_grpo.objective.loss import GRPOLoss, total_loss
from torchrl_grpo.training.trainer import Trainer
from torchrl_grpo.training.weight_sync import EngineSync, PolicyWeights

PROMPTS, GROUP, MAX_TOKENS, SEED = 2, 4, 16, 0  # a step of PROMPTS x GROUP completions of at most MAX_TOKENS
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"

# The task: arithmetic questions generated offline by reasoning-gym (the keys of config/env/arithmetic.yaml's env:
# section). A random model never answers one right, so its own rewards (accuracy, answer format) are weighted 0 and
# logged, and TRL's first example's reward teaches: -|20 - characters| (torchrl_grpo/tasks/examples.py).
TASK = {"dataset": "arithmetic", "size": 200, "seed": SEED, "split": "train",
        "tasks": [{"name": "products", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}],
        "reward_weights": {"accuracy": 0.0, "answer_format": 0.0},
        "rewards": [{"_target_": "torchrl_grpo.tasks.examples.length_reward", "name": "length", "weight": 1.0}]}


def show(title: str, **values) -> None:
    print(f"\n== {title}")
    for name, value in values.items():
        print(f"   {name}: {value}")


def build_engine(model_path: str) -> VLLMEngine:
    """The rollout engine: vLLM in this process, float32 like the trained weights (so their log-probs agree)."""
    engine = VLLMEngine(model_path, dtype="float32", device=DEVICE, max_model_len=512, seed=SEED)
    show("engine", model=model_path, device=DEVICE)
    return engine


def build_collector(model_path: str, engine) -> tuple[Collector, object]:
    """The task (its prompts and rewards) and the collector that samples GROUP completions of PROMPTS prompts."""
    task, turns = build_episode_task(TASK)
    tokenizer = load_tokenizer(model_path)
    show("task", rows=len(task.rows), rewards=task.reward_names, first_prompt=repr(task.prompt_text(task.rows[0])))
    settings = CollectSettings(
        prompts_per_step=PROMPTS, group_size=GROUP, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        min_p=0.0, max_model_len=512, dynamic_sampling=False, max_resample_rounds=0, soft_overlong=False,
        overlong_buffer=None, prompt_seed=SEED, overlong_prompts="drop")
    return Collector(task, tokenizer, engine, PromptSampler(len(task.rows), SEED), settings, turns), tokenizer


def build_trainer(model_path: str) -> Trainer:
    """The trained policy (float32 master weights), GRPO's loss at its defaults (token ratio clipped at 0.2, each
    completion's token mean, then the batch's), AdamW, and one optimizer step over the whole batch in micro-batches
    of 4 completions. The engine's sampling log-probs are the ratio's denominator (``loss.old_log_probs=engine``)."""
    policy = load_policy(model_path, dtype=torch.float32, device=DEVICE).eval()
    settings = TrainSettings(
        group_size=GROUP, micro_batch=4, accumulation=PROMPTS * GROUP // 4, epochs=1, temperature=1.0,
        recompute_old_log_probs=False, kl_in_reward_coeff=0.0, reward_scale="group", clip_grad_norm=1.0,
        mixed_precision=False, max_nonfinite_updates=3, seed=SEED)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    trainer = Trainer(policy, None, GRPOLoss(policy), optimizer, settings, torch.device(DEVICE), None)
    show("trainer", parameters=sum(p.numel() for p in policy.parameters()), loss="GRPOLoss() (grpo's defaults)",
         optimizer="AdamW lr=1e-3", micro_batches=f"{settings.accumulation} of {settings.micro_batch} completions")
    return trainer


def collect(collector: Collector):
    """One step's batch: PROMPTS x GROUP completions, sampled by policy version 0, scored by the task's rewards."""
    batch, metrics, samples = collector.collect(version=0)
    shapes = {key: f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
              for key, value in batch.items() if isinstance(value, torch.Tensor)}
    show("collector", batch=f"TensorDict of {batch.batch_size[0]} rows", **shapes,
         rewards_by_group=batch[Batch.REWARD].view(PROMPTS, GROUP).tolist(),
         a_completion=repr(samples[0]["completion"]),
         generation_tokens_per_s=f"{metrics['generation_tokens_per_s']:.0f}")
    return batch


def surrogate(trainer: Trainer, batch) -> dict:
    """GRPOLoss on the prepared batch under the trainer's current weights, without a gradient."""
    with torch.no_grad():
        losses = trainer.loss(batch.to(trainer.device))
    return {"total": total_loss(losses).item(), "ratio_mean": losses["ratio_mean"].item(),
            "clip_fraction": (losses["clip_fraction_low"] + losses["clip_fraction_high"]).item()}


def train(trainer: Trainer, batch) -> dict:
    """Prepare the batch (group advantages: each reward minus its group's mean, over the group's std), then optimize:
    one clipped-surrogate update over the batch's micro-batches. The loss on the same batch before and after shows
    the update: the ratio moves off 1 where the advantage pushed it, and the surrogate falls."""
    prepared = trainer.prepare(batch)
    show("trainer.prepare", advantages_by_group=[[round(a, 3) for a in group]
                                                 for group in batch[Batch.ADVANTAGE].view(PROMPTS, GROUP).tolist()],
         tied_group_fraction=prepared["tied_group_fraction"])
    before = surrogate(trainer, batch)
    metrics = trainer.optimize(batch)
    after = surrogate(trainer, batch)
    show("trainer.optimize", updates=trainer.updates,
         **{key: f"{metrics[key]:.4g}" for key in ("loss", "grad_norm", "train_tokens_per_s")},
         **{f"{key} before -> after": f"{before[key]:.4g} -> {after[key]:.4g}" for key in before})
    return {**metrics, "loss_before": before["total"], "loss_after": after["total"]}


def build_sync(trainer: Trainer, engine, tokenizer) -> EngineSync:
    """What puts the trainer's updates into the engine and checks that they landed: the engine's log-probs of a probe
    text against the trainer's, here at the start (the same weights) and after every push."""
    check = WeightCheck(trainer.policy, tokenizer, torch.float32, None,
                        log_probs=PolicyWeights(trainer.policy).probe_log_probs)
    weights = EngineSync(trainer, engine, check)
    show("weight sync", at_start=weights.startup())
    return weights


def push(weights: EngineSync) -> dict:
    """The update into the engine as policy version 1, then checked."""
    pushed = weights.push(version=1)
    show("weight sync after the update", pushed_in_s=f"{pushed['weight_push_time']:.2f}",
         log_prob_gap=f"{pushed['weight_sync_gap']:.2e} (allowed: {weights.check.tolerance:.0e})")
    return pushed


def one_step(engine: VLLMEngine | None = None) -> dict:
    """Build every piece and run one sync step; ``engine``: an engine on the tiny model to use instead of a new one
    (it then holds the step's weights). Returns what each piece produced."""
    torch.manual_seed(SEED)
    model_path = resolve_model("tiny")  # a tiny random Qwen2, built offline into the model cache
    own = engine is None
    engine = build_engine(model_path) if own else engine
    try:
        collector, tokenizer = build_collector(model_path, engine)
        trainer = build_trainer(model_path)
        before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
        weights = build_sync(trainer, engine, tokenizer)
        batch = collect(collector)
        metrics = train(trainer, batch)
        pushed = push(weights)
    finally:
        if own:
            engine.close()
    return {"batch": batch, "metrics": metrics, "pushed": pushed, "trainer": trainer, "before": before}


if __name__ == "__main__":
    one_step()
