"""bench/trl_gpu.py's arithmetic and knob mapping, on hand-made metrics (the script itself runs TRL, which the
suite does not install)."""
import csv
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trl_gpu():
    spec = importlib.util.spec_from_file_location("trl_gpu", ROOT / "bench" / "trl_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_gpu"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("trl_gpu", None)


def test_our_figures_skip_the_first_step_and_split_it(trl_gpu, tmp_path):
    rows = [  # step 1 is not timed
        dict(step_time=9.0, generation_time=5.0, train_time=3.0, generation_tokens_per_s=10.0,
             train_tokens_per_s=10.0, reward=0.1, **{"memory/train/peak_gib": 7.0}),
        dict(step_time=2.0, generation_time=1.0, train_time=0.5, generation_tokens_per_s=100.0,
             train_tokens_per_s=400.0, reward=0.2, **{"memory/train/peak_gib": 3.0}),
        dict(step_time=4.0, generation_time=2.0, train_time=1.5, generation_tokens_per_s=50.0,
             train_tokens_per_s=200.0, reward=0.3, **{"memory/train/peak_gib": 4.0}),
    ]
    path = tmp_path / "metrics.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    got = trl_gpu.our_figures(path, completions_per_step=16)
    assert got["steps_timed"] == 2
    assert got["step_s"] == pytest.approx(3.0)  # median of 2 and 4
    assert got["generation_s"] == pytest.approx(1.5) and got["training_s"] == pytest.approx(1.0)
    assert got["rest_s"] == pytest.approx(0.5)
    assert got["completions_per_s"] == pytest.approx(32 / 6)
    assert got["generated_tokens_per_s"] == pytest.approx((100 + 100) / 3)
    assert got["trained_tokens_per_s"] == pytest.approx((200 + 300) / 2)
    assert (got["reward_first"], got["reward_last"]) == (0.1, 0.3)
    assert got["allocator_peak_gib"] == 7.0


def test_trl_figures_read_its_timers_and_token_counts(trl_gpu):
    timers = [{"GRPOTrainer.vLLM.generate": 9.0, "GRPOTrainer._prepare_inputs": 9.5},
              {"GRPOTrainer.vLLM.generate": 1.0, "GRPOTrainer._prepare_inputs": 1.5, "GRPOTrainer.compute_loss": 0.3},
              {"GRPOTrainer.transformers.generate": 2.0, "GRPOTrainer._prepare_inputs": 2.2}]
    logs = [dict(reward=0.0, num_tokens=100, **{"completions/mean_length": 4.0}),
            dict(reward=0.5, num_tokens=300, **{"completions/mean_length": 8.0}),
            dict(reward=1.0, num_tokens=600, **{"completions/mean_length": 2.0})]
    got = trl_gpu.trl_figures(dict(step_s=[10.0, 2.0, 3.0], timers=timers, logs=logs), completions_per_step=4)
    assert got["steps_timed"] == 2 and got["step_s"] == pytest.approx(2.5)
    assert got["generation_s"] == pytest.approx(1.5)
    assert got["training_s"] == pytest.approx((0.5 + 0.8) / 2)  # the step less _prepare_inputs
    assert got["generated_tokens_per_s"] == pytest.approx((8 * 4 + 2 * 4) / 3.0)
    assert got["trained_tokens_per_s"] == pytest.approx((200 + 300) / 1.3)
    assert got["completions_per_s"] == pytest.approx(8 / 5)


def test_trl_settings_follow_our_composed_config(trl_gpu, tmp_path):
    from torchrl_grpo.config.precision import resolve_precision

    overrides = trl_gpu.our_overrides("readme", "tiny", tmp_path, steps=5, prompts=2, max_tokens=16,
                                      extra=["optimizer.lr=3e-5", "train.optim_batch_size=8"])
    cfg = trl_gpu.compose("grpo_arithmetic", overrides)
    assert int(cfg.train.total_dialog_turns) == 80
    kwargs, differ = trl_gpu.trl_settings(cfg, "cuda", tmp_path, 5, resolve_precision(cfg, "cuda", "cuda", "cuda"),
                                          sleep=True)
    assert kwargs["learning_rate"] == 3e-5 and kwargs["max_completion_length"] == 16
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == 16
    assert kwargs["steps_per_generation"] == kwargs["gradient_accumulation_steps"] == 2  # one update per generation
    assert kwargs["num_generations"] == 8 and kwargs["beta"] == 0.0 and kwargs["bf16"] is True
    assert kwargs["use_vllm"] and kwargs["vllm_mode"] == "colocate" and kwargs["vllm_enable_sleep_mode"]
    assert any("old log-probs: ours the trainer's" in line for line in differ)
    table = trl_gpu.settings_table(cfg, kwargs)
    assert "| prompts x completions per step | 2 x 8 | 2 x 8 |" in table
    cpu, _ = trl_gpu.trl_settings(cfg, "cpu", tmp_path, 5, resolve_precision(cfg, "cpu", "cpu", "cpu"), sleep=False)
    assert cpu["use_cpu"] and not cpu["use_vllm"] and "vllm_mode" not in cpu


def test_letter_share_differs_between_random_texts(trl_gpu):
    assert trl_gpu.letter_share("ab12") == 0.5
    assert trl_gpu.letter_share("") == 0.0
    assert trl_gpu.letter_share("é!") == 0.0
