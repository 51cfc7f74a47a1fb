"""examples/one_step.py, the one sync step a reader starts from, run on the session's vLLM engine: every piece did
what the page says it does."""
import importlib.util

import torch

from helpers import ROOT
from torchrl_grpo.core.batch import Batch
from torchrl_grpo.models.loading import load_policy, merged_state_dict


def _example():
    spec = importlib.util.spec_from_file_location("one_step", ROOT / "examples" / "one_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_step_builds_every_piece_and_takes_one_checked_update(vllm_engine, tiny_model_path, capsys):
    example = _example()
    try:
        out = example.one_step(engine=vllm_engine)
    finally:  # the shared engine gets the tiny model's own weights back
        vllm_engine.push_weights(merged_state_dict(load_policy(tiny_model_path, dtype=torch.float32, device="cpu")))
    printed = capsys.readouterr().out
    for title in ("task", "trainer", "weight sync", "collector", "trainer.prepare", "trainer.optimize",
                  "weight sync after the update"):
        assert f"\n== {title}\n" in printed, title

    batch, rows = out["batch"], example.PROMPTS * example.GROUP
    length = batch[Batch.TOKENS].shape[1]
    for key in (Batch.TOKENS, Batch.ATTENTION_MASK, Batch.COMPLETION_MASK, Batch.SAMPLE_LOG_PROBS):
        assert batch[key].shape == (rows, length), key
    assert batch[Batch.COMPLETION_MASK].sum(-1).le(example.MAX_TOKENS).all()
    # group advantages: each group's sum is 0, and the length reward left some signal
    advantages = batch[Batch.ADVANTAGE].view(example.PROMPTS, example.GROUP)
    assert torch.allclose(advantages.sum(-1), torch.zeros(example.PROMPTS), atol=1e-5)
    assert advantages.abs().sum() > 0

    trainer = out["trainer"]
    assert trainer.updates == 1
    moved = [name for name, p in trainer.policy.named_parameters() if not torch.equal(p, out["before"][name])]
    assert moved
    assert out["metrics"]["loss_after"] < out["metrics"]["loss_before"]  # the update lowered the surrogate
    assert out["pushed"]["weight_sync_gap"] < 5e-3  # the engine samples with the updated weights
