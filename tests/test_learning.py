"""Does training work? The real loop (vLLM engine, weight push, GRPOLoss, AdamW) on a task the tiny random
model can learn in seconds: the reward is the share of digit characters in the completion."""
import datasets
import torch

from grpo_utils import build_loss, build_optimizer, build_policy
from helpers import cfg_with
from torchrl_grpo.config import validate
from torchrl_grpo.loops import Parts, run_sync
from torchrl_grpo.models import load_tokenizer, merged_state_dict
from torchrl_grpo.tasks import Reward, Task


def digit_share(completion: str, row) -> float:
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def test_reward_rises_on_a_learnable_task(tiny_model_path, vllm_engine, tmp_path):
    cfg = cfg_with("model=tiny", "env.num_envs=4", "env.repeats=8", "train.optim_batch_size=16",
                   "train.total_dialog_turns=640", "inference_model.max_tokens=8", "optimizer.lr=3e-3",
                   "loss.aggregation=token_mean", "logging.progress_bar=false", "logging.checkpoint_frequency=0",
                   "logging.keep_checkpoints=1")
    torch.manual_seed(0)
    rows = datasets.Dataset.from_dict({"question": [f"Say some numbers, {i}." for i in range(32)],
                                       "answer": ["0"] * 32})
    task = Task("digits", rows, system_prompt=None, rewards=[Reward("digits", digit_share)])
    tokenizer = load_tokenizer(tiny_model_path)
    policy = build_policy(cfg, tiny_model_path, ["cpu"], None)
    original = {k: v.clone() for k, v in merged_state_dict(policy).items()}
    parts = Parts(
        cfg=cfg, plan=validate(cfg), run_dir=tmp_path, task=task, tokenizer=tokenizer, policy=policy,
        ref_policy=None, engine=vllm_engine, loss=build_loss(cfg, policy), optimizer=build_optimizer(cfg, policy),
        train_device=torch.device("cpu"), ref_device=None,
        push_weights=lambda: vllm_engine.push_weights(merged_state_dict(policy)), resume_from=None,
    )
    try:
        summary = run_sync(parts)
    finally:
        vllm_engine.push_weights(original)  # the session engine goes back to the tiny model's weights
    trend = summary["reward/digits"]
    assert trend.last_mean > trend.first_mean + 0.2, summary
