"""Does training work? The real loop (vLLM engine, weight push, GRPOLoss, AdamW) on a task the tiny random
model can learn in seconds: the reward is the share of digit characters in the completion; and the same as
the well-formedness of tool calls over two-turn episodes."""
import math

import datasets
import torch

from helpers import cfg_with, metric_rows
from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.engines.weight_check import WeightCheck
from torchrl_grpo.episodes.trajectories import PromptSampler
from torchrl_grpo.episodes.turn_envs import Reply, TurnEnv, Turns
from torchrl_grpo.models.loading import load_tokenizer, merged_state_dict
from torchrl_grpo.run.build import build_trainer
from torchrl_grpo.run.loop import Run, run_loop
from torchrl_grpo.run.sources import LocalSource
from torchrl_grpo.run.state import RunState
from torchrl_grpo.tasks import Reward, Task
from torchrl_grpo.training.weight_sync import EngineSync


def digit_share(completion: str, row) -> float:
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def _train(cfg, task, tiny_model_path, vllm_engine, tmp_path, turns=None, check=False):
    """The real loop over ``task`` with the run's trainer (:func:`build_trainer`) and the session engine, which goes
    back to the tiny model's weights afterwards; ``check``: every push must pass the weight sync check. Returns the
    run's summary."""
    torch.manual_seed(0)
    spec = resolve_run(cfg)
    tokenizer = load_tokenizer(tiny_model_path)
    trainer = build_trainer(spec, tiny_model_path)
    original = {k: v.clone() for k, v in merged_state_dict(trainer.policy).items()}
    collector = Collector(task, tokenizer, vllm_engine, PromptSampler(len(task.rows), 0), spec.collect,
                          *(() if turns is None else (turns,)))
    weight_check = None
    if check:
        weight_check = WeightCheck(trainer.policy, tokenizer, torch.float32, None)
        weight_check.startup(vllm_engine)
    run = Run(LocalSource(collector, EngineSync(trainer, collector.engine, weight_check)), trainer,
              RunState(spec, tmp_path), spec)
    try:
        return run_loop(run)
    finally:
        vllm_engine.push_weights(original)


LEARN = ("model=tiny", "env.num_envs=4", "env.repeats=8", "train.optim_batch_size=16",
         "train.gradient_accumulation_steps=1", "train.total_dialog_turns=640", "inference_model.max_tokens=8",
         "optimizer.lr=3e-3", "loss.aggregation=token_mean", "logging.progress_bar=false",
         "logging.checkpoint_frequency=0", "logging.keep_checkpoints=1")


def test_reward_rises_on_a_learnable_task(tiny_model_path, vllm_engine, tmp_path):
    rows = datasets.Dataset.from_dict({"question": [f"Say some numbers, {i}." for i in range(32)],
                                       "answer": ["0"] * 32})
    task = Task("digits", rows, system_prompt=None, rewards=[Reward("digits", digit_share)])
    summary = _train(cfg_with(*LEARN), task, tiny_model_path, vllm_engine, tmp_path, check=True)
    # steps pushed
    assert all(float(r["weight_sync_gap"]) < 1e-4 for r in metric_rows(tmp_path) if r["weight_sync_gap"])
    trend = summary["reward/digits"]
    assert trend.last_mean > trend.first_mean + 0.2, summary


def prompt_bonus(completion: str, row) -> float:
    """1 for the prompts that ask for it, 0 for the others: known from the prompt alone, whatever is sampled."""
    return float("bonus" in row["question"])


def test_ppo_critic_learns_to_predict_the_returns(tiny_model_path, vllm_engine, tmp_path):
    """loss=ppo, one completion per prompt, a reward the prompt alone decides (a bonus some prompts ask for): the
    critic's explained variance of the returns rises from about 0 as it learns which prompts get it."""
    rows = datasets.Dataset.from_dict({"question": [f"Say some numbers{' bonus' * (i % 2)}, {i}." for i in range(32)],
                                       "answer": ["0"] * 32})
    task = Task("bonus", rows, system_prompt=None, rewards=[Reward("bonus", prompt_bonus)])
    cfg = cfg_with(*LEARN, "loss=ppo", "env.num_envs=32", "env.repeats=1", "critic.lr=3e-3")
    summary = _train(cfg, task, tiny_model_path, vllm_engine, tmp_path)
    explained = summary["explained_variance"]
    assert explained.first_mean < 0.3 and explained.last_mean > 0.6, summary
    logged = metric_rows(tmp_path)
    assert all(math.isfinite(float(r[key])) for r in logged for key in ("value_loss", "critic_grad_norm"))


class DigitTool(TurnEnv):
    """A tool whose call is a whole turn and whose argument must be digits: it answers how many digits the call
    held. ``score``: the episode's well-formedness, the mean digit share of its calls (every turn is one)."""

    def step(self, task, row, conversation):
        call = conversation[-1]["content"]
        return Reply([{"role": "tool", "content": f"{sum(ch.isdigit() for ch in call)} digits"}])

    def score(self, task, row, conversation, turns):
        calls = [m["content"] for m in conversation if m["role"] == "assistant"]
        return {"well_formed": sum(digit_share(c, row) for c in calls) / len(calls)}


def test_a_reward_for_well_formed_tool_calls_rises_over_two_turn_episodes(tiny_model_path, vllm_engine, tmp_path):
    """The multi-turn path learns: each episode is two calls with the tool's answer inserted between them, and
    the reward (well-formed calls) rises; the second turns, sampled after inserted ids, learn too."""
    rows = datasets.Dataset.from_dict({"question": [f"Call the tool, {i}." for i in range(32)], "answer": ["0"] * 32})
    task = Task("calls", rows, system_prompt=None, rewards=[Reward("well_formed", digit_share)])
    summary = _train(cfg_with(*LEARN), task, tiny_model_path, vllm_engine, tmp_path, Turns(2, DigitTool()))
    logged = metric_rows(tmp_path)
    assert all(float(r["turns/engine_turns"]) == 2 for r in logged)
    trend = summary["reward/well_formed"]
    assert trend.last_mean > trend.first_mean + 0.2, summary
