"""Does training work? The real loop (vLLM engine, weight push, GRPOLoss, AdamW) on a task the tiny random
model can learn in seconds: the reward is the share of digit characters in the completion."""
import datasets
import torch

from grpo_utils import build_loss, build_optimizer, build_policy
from helpers import cfg_with, metric_rows
from torchrl_grpo.collector import Collector
from torchrl_grpo.config import CollectSettings, TrainSettings, validate
from torchrl_grpo.models import load_tokenizer, merged_state_dict
from torchrl_grpo.run_state import RunState
from torchrl_grpo.sync_loop import SyncRun, run_sync
from torchrl_grpo.trainer import Trainer
from torchrl_grpo.trajectories import PromptSampler
from torchrl_grpo.tasks import Reward, Task
from torchrl_grpo.weight_check import WeightCheck


def digit_share(completion: str, row) -> float:
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def test_reward_rises_on_a_learnable_task(tiny_model_path, vllm_engine, tmp_path):
    cfg = cfg_with("model=tiny", "env.num_envs=4", "env.repeats=8", "train.optim_batch_size=16",
                   "train.gradient_accumulation_steps=1", "train.total_dialog_turns=640", "inference_model.max_tokens=8",
                   "optimizer.lr=3e-3", "loss.aggregation=token_mean", "logging.progress_bar=false", "logging.checkpoint_frequency=0",
                   "logging.keep_checkpoints=1")
    torch.manual_seed(0)
    rows = datasets.Dataset.from_dict({"question": [f"Say some numbers, {i}." for i in range(32)],
                                       "answer": ["0"] * 32})
    task = Task("digits", rows, system_prompt=None, rewards=[Reward("digits", digit_share)])
    tokenizer = load_tokenizer(tiny_model_path)
    policy = build_policy(cfg, tiny_model_path, ["cpu"], None)
    original = {k: v.clone() for k, v in merged_state_dict(policy).items()}
    trainer = Trainer(policy, None, build_loss(cfg, policy), build_optimizer(cfg, policy), TrainSettings.from_config(cfg, "cpu"),
                      torch.device("cpu"), None)
    collector = Collector(task, tokenizer, vllm_engine, PromptSampler(len(rows), 0), CollectSettings.from_config(cfg))
    check = WeightCheck(policy, tokenizer, torch.float32, None)  # every real push must pass it
    check.startup(vllm_engine)
    run = SyncRun(collector, trainer, RunState(cfg, tmp_path), validate(cfg).total_steps, weight_check=check)
    try:
        summary = run_sync(run)
    finally:
        vllm_engine.push_weights(original)  # the session engine goes back to the tiny model's weights
    assert all(float(r["weight_sync_gap"]) < 1e-4 for r in metric_rows(tmp_path))
    trend = summary["reward/digits"]
    assert trend.last_mean > trend.first_mean + 0.2, summary
