"""Collection logic: dynamic sampling (DAPO) and the soft overlong penalty in the reward, with a scripted
engine whose completions are known in advance (the real engine is exercised by the e2e tests)."""
import datasets
import pytest
import torch

from helpers import cfg_with
from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.engines.base import Completion
from torchrl_grpo.episodes.trajectories import PromptSampler
from torchrl_grpo.tasks import Reward, Task


class ScriptedEngine:
    """Completion j of a prompt says "yes" when the prompt's question is 'mixed' and j is even, else "no";
    'long' questions get max_tokens tokens (truncated)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, *, n, max_tokens, temperature, top_p, top_k=0, min_p=0.0):
        self.calls.append(len(prompts))
        out = []
        for i, ids in enumerate(prompts):
            text = self.tokenizer.decode(ids)
            for j in range(n):
                word = "yes" if "mixed" in text and j % 2 == 0 else "no"
                length = max_tokens if "long" in text else 2
                out.append(Completion(i, [5] * length, [-1.0] * length, "length" if "long" in text else "stop", word))
        return out


def make_collector(tokenizer, questions, *overrides):
    cfg = cfg_with("model=tiny", "env.num_envs=2", "env.repeats=4", "train.optim_batch_size=4",
                   "inference_model.max_tokens=10", *overrides)
    rows = datasets.Dataset.from_dict({"question": questions, "answer": ["0"] * len(questions)})
    task = Task("yes", rows, None, [Reward("yes", lambda c, r: float(c == "yes"))])
    return Collector(task, tokenizer, ScriptedEngine(tokenizer), PromptSampler(len(questions), seed=0),
                     resolve_run(cfg).collect)


def test_dynamic_sampling_replaces_tied_groups(tokenizer):
    # lay the questions out so that the sampler meets: tied, tied | mixed, tied | mixed
    pattern = ["tied a", "tied b", "mixed c", "tied d", "mixed e", "tied f"]
    questions = [None] * 6
    for position, index in enumerate(PromptSampler(6, seed=0).take(6)):
        questions[index] = pattern[position]
    collector = make_collector(tokenizer, questions, "loss=dapo", "loss.overlong=none")
    groups, stats = collector.sample_groups()
    assert [g.row["question"] for g in groups] == ["mixed c", "mixed e"]
    assert collector.engine.calls == [2, 2, 1] and stats["sampling_rounds"] == 3
    assert stats["dropped_group_fraction"] == pytest.approx(3 / 5)


def test_dynamic_sampling_fills_with_tied_groups_when_rounds_run_out(tokenizer):
    collector = make_collector(tokenizer, ["tied a", "tied b", "tied c"], "loss=dapo", "loss.overlong=none",
                               "loss.max_resample_rounds=1")
    groups, stats = collector.sample_groups()
    assert len(groups) == 2 and stats["sampling_rounds"] == 2 and collector.engine.calls == [2, 2]
    assert stats["dropped_group_fraction"] == 1.0


def test_without_dynamic_sampling_ties_are_kept_and_one_round_is_made(tokenizer):
    collector = make_collector(tokenizer, ["tied a", "tied b", "mixed c"])
    groups, stats = collector.sample_groups()
    assert len(groups) == 2 and collector.engine.calls == [2] and "sampling_rounds" not in stats


def test_soft_overlong_penalty_enters_the_reward(tokenizer):
    collector = make_collector(tokenizer, ["long mixed a", "mixed b"], "loss=dapo", "loss.overlong_buffer=4")
    batch, metrics, _ = collector.collect(version=0)
    long_rows = batch["truncated"]
    # full length (10 tokens) with buffer 4 -> penalty -1; the 2-token ones get 0
    expected = batch["rewards", "yes"].float() - long_rows.float()
    assert torch.allclose(batch["reward"], expected)
    assert metrics["overlong_penalty_mean"] == pytest.approx(-long_rows.float().mean().item())
