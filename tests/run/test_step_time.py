"""The plan's step time (torchrl_grpo/run/step_time.py): the FLOPs of a step's updates and the measured FLOP/s
between row lengths, against values computed here by hand."""
import math

import pytest

from helpers import cfg_with
from torchrl_grpo.config.memory_plan import ModelShape
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.run.step_time import (
    Measured,
    checkpointing_line,
    flops_per_s,
    measured_for,
    step_flops,
    step_time_line,
)

# Qwen2.5-1.5B's published shape (tied): hidden 1536, 28 layers, 12 heads of 128 (2 KV heads), MLP 8960, vocab 151,936
QWEN_1_5B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
             "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "tie_word_embeddings": True}


def gpu_spec(*overrides, gpus=1):
    return resolve_run(cfg_with("model=tiny", "env.num_envs=4", "env.repeats=8", "train.optim_batch_size=8",
                                "inference_model.max_tokens=1000", *overrides), gpu_count=gpus)


def test_flops_per_s_are_log_linear_between_measured_lengths_and_held_beyond():
    measured = [Measured("H200", "m", 1, 1, 1, 1000, 1e12), Measured("H200", "m", 1, 1, 1, 100_000, 3e12)]
    assert flops_per_s(measured, 10_000) == pytest.approx(2e12)  # halfway in log length
    assert flops_per_s(measured, 1000) == 1e12 and flops_per_s(measured, 100_000) == 3e12
    assert flops_per_s(measured, 10) == 1e12 and flops_per_s(measured, 10**7) == 3e12


def test_step_flops_of_a_step_by_hand():
    """6 N T + 12 L H Q T^2 per row (forward 2 N T + 4 L H Q T^2, backward twice it), N every weight of a matmul
    (tied: the embedding once, as the head), for each of the step's completions, each epoch, on one of two ranks."""
    shape = ModelShape.from_config(QWEN_1_5B)
    hidden, layers, vocab, mlp = 1536, 28, 151936, 8960
    per_layer = (hidden * hidden + hidden + 2 * (hidden * 256 + 256)  # q with bias, k and v (2 heads of 128) with bias
                 + hidden * hidden + 3 * hidden * mlp + 2 * hidden)  # o, gate/up/down, two norms
    n = vocab * hidden + layers * per_layer + hidden
    spec = gpu_spec("train.epochs=2", "train.strategy=fsdp", "train_model.num_devices=2", gpus=4)
    assert spec.placement.ranks == 2 and spec.plan.completions_per_step == 32
    row = 1100
    per_row = 3 * (2 * n * row + 4 * layers * 12 * 128 * row * row)
    assert step_flops(shape, spec, row) == 32 * 2 // 2 * per_row


def test_the_plan_gives_a_measured_shape_its_step_time_and_others_why_not():
    shape = ModelShape.from_config(QWEN_1_5B)
    spec = gpu_spec()
    row = 100 + 1000
    measured = measured_for(shape, "NVIDIA H200")
    assert [m.row_tokens for m in measured] == [2048, 16384]
    seconds = step_flops(shape, spec, row) / measured[0].flops_per_s  # below 2,048 tokens: held at its figure
    line = step_time_line(shape, spec, 100, "NVIDIA H200")
    assert f"at least {seconds:.1f} s on an H200 a step, with rows of 1100 tokens" in line  # shorter than measured
    longer = gpu_spec("inference_model.max_tokens=4000", "inference_model.max_model_len=8192")
    between = measured[0].flops_per_s + math.log(4100 / 2048) / math.log(8) * (measured[1].flops_per_s
                                                                              - measured[0].flops_per_s)
    assert f"about {step_flops(shape, longer, 4100) / between:.1f} s on an H200" in step_time_line(
        shape, longer, 100, "NVIDIA H200")
    assert "LoRA" not in line
    assert "this run has LoRA" in step_time_line(shape, gpu_spec("train_model.lora.enabled=true"), 100, None)
    assert "not measured on NVIDIA A100" in step_time_line(shape, spec, 100, "NVIDIA A100-SXM4-80GB")
    other = ModelShape.from_config({**QWEN_1_5B, "num_hidden_layers": 24})
    assert "this model's shape was not measured" in step_time_line(other, spec, 100, None)
    cpu = resolve_run(cfg_with("model=tiny"))
    assert step_time_line(shape, cpu, 100, None).startswith("step time: not planned on a CPU")


def test_where_a_shape_was_measured_both_ways_the_plan_gives_checkpointing_on_and_off():
    """Qwen3-0.6B's shape was measured on an H200 with checkpointing on and off (docs/benchmarks.md); rows of 2,048
    tokens take each way's FLOP/s at that length."""
    qwen3 = ModelShape.from_config({"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
                                    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                                    "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True})
    spec = gpu_spec("inference_model.max_tokens=1948", "inference_model.max_model_len=4096")
    flops = step_flops(qwen3, spec, 2048)
    line = checkpointing_line(qwen3, spec, 100, "NVIDIA H200")
    assert line == (f"  step time, the trainer's updates: gradient checkpointing off {flops / 230.4e12:.1f} s, on "
                    f"{flops / 179.4e12:.1f} s on an H200")
    off = gpu_spec("inference_model.max_tokens=1948", "inference_model.max_model_len=4096",
                   "train_model.gradient_checkpointing=false")
    assert f"about {flops / 230.4e12:.1f} s on an H200" in step_time_line(qwen3, off, 100, "NVIDIA H200")
    assert "checkpointing off" not in step_time_line(qwen3, off, 100, "NVIDIA H200")  # measured so
    assert checkpointing_line(ModelShape.from_config(QWEN_1_5B), spec, 100, "NVIDIA H200") is None  # on only
    assert checkpointing_line(qwen3, resolve_run(cfg_with("model=tiny")), 100, None) is None  # a CPU
