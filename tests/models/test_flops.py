"""The model FLOPs of the update (torchrl_grpo/models/flops.py): each model's N, L, H, Q counted by hand from its
config, the PaLM formula on hand-made rows, and the GPU peaks MFU divides by."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from torchrl_grpo.models.flops import ModelShape, bf16_peak_flops, model_shape, update_flops

# hidden 16, 4 heads of 4, 2 key-value heads (8 wide), MLP 32, vocabulary 64, 2 layers
QWEN2 = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# per layer: q (with bias), k and v (with biases, 8 wide), o; gate, up, down; two RMSNorms
LAYER = (16 * 16 + 16) + 2 * (16 * 8 + 8) + 16 * 16 + 3 * 16 * 32 + 2 * 16
MATMUL_PARAMS = 2 * LAYER + 16 + 64 * 16  # the layers, the final norm, and the output head (vocabulary x hidden)


@pytest.mark.parametrize("tied", [True, False])
def test_the_shape_counts_every_parameter_but_the_input_embedding_and_the_head_once(tied):
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2, tie_word_embeddings=tied))
    # tied, the embedding's one matrix is the head; untied, the head is its own matrix and the embedding is left out
    assert sum(p.numel() for p in model.parameters()) == MATMUL_PARAMS + (0 if tied else 64 * 16)
    assert model_shape(model) == ModelShape(MATMUL_PARAMS, layers=2, heads=4, head_dim=4)


def test_lora_adapters_count_beside_the_base_weights():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(Qwen2ForCausalLM(Qwen2Config(**QWEN2, tie_word_embeddings=True)),
                           LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    # per layer: q's A (2 x 16) and B (16 x 2), v's A (2 x 16) and B (8 x 2)
    assert model_shape(model) == ModelShape(MATMUL_PARAMS + 2 * (32 + 32 + 32 + 16), layers=2, heads=4, head_dim=4)


def test_a_head_dimension_the_config_names_is_taken_over_hidden_by_heads():
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    shape = model_shape(LlamaForCausalLM(config))
    assert (shape.layers, shape.heads, shape.head_dim) == (3, 4, 8)


def test_a_model_without_a_transformers_config_has_no_shape():
    assert model_shape(torch.nn.Linear(4, 4)) is None


def sharded_shape() -> None:
    """FSDP2 over a fake process group of 4 ranks, in a process of its own (this one's default group may be taken,
    e.g. by an in-process vLLM engine of an earlier test)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2, tie_word_embeddings=True))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
        assert model.model.layers[0].mlp.up_proj.weight.to_local().numel() == 32 * 16 // 4
        assert model_shape(model) == ModelShape(MATMUL_PARAMS, layers=2, heads=4, head_dim=4)
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_counts_its_parameters_whole():
    """Each rank holds a quarter of each parameter, a DTensor whose count is the whole parameter's; the tied head
    stays the embedding."""
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-3000:]


def test_forward_flops_follow_the_palm_formula_row_by_row():
    shape = ModelShape(matmul_params=10, layers=2, heads=3, head_dim=4)
    # rows of 3 and 5 tokens: 2 N T + 4 L H Q T^2 each
    three, five = 2 * 10 * 3 + 4 * 2 * 3 * 4 * 9, 2 * 10 * 5 + 4 * 2 * 3 * 4 * 25
    assert (three, five) == (924, 2500)
    assert shape.forward_flops([3, 5]) == 3424
    critic = ModelShape(matmul_params=7, layers=1, heads=1, head_dim=2)  # 2*7*T + 8*T^2: 42 + 72, 70 + 200
    assert update_flops([shape], [3, 5], backward=False) == 3424
    assert update_flops([shape], [3, 5], backward=True) == 3 * 3424  # a backward costs twice the forward
    assert update_flops([shape, critic], [3, 5], backward=True) == 3 * (3424 + 114 + 270)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA A10", 125e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA B200", 2250e12),
    ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 4090", None), ("NVIDIA L40", None),
])
def test_a_gpu_is_matched_by_the_words_of_its_name(name, peak):
    assert bf16_peak_flops(name) == peak


def test_the_throughput_bench_trains_the_recipe_and_counts_its_flops(monkeypatch):
    """bench/train_throughput.py on its tiny shape: the run's trainer learns from every row, and its FLOP/s over
    its tokens/s is the hand count of a row of that length (every row is as long), 3 forwards' worth."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[2] / "bench"))
    import train_throughput

    assert train_throughput.plan(2048, 131072, 16384) == (64, 8, 8)
    assert train_throughput.plan(16384, 131072, 16384) == (8, 1, 8)
    row = train_throughput.measure("tiny", 64, steps=1, overrides=[], step_tokens=512, micro_tokens=128)
    assert (row["rows_per_step"], row["micro_batch_rows"], row["loss_finite"]) == (8, 2, True)
    # tiny: hidden 64, 4 heads of 16, 2 key-value heads (32 wide), MLP 128, vocabulary 512 tied, 2 layers
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 16  # q, k, v, o, MLP, norms, q/k norms
    n = 2 * layer + 64 + 512 * 64
    per_token = 3 * (2 * n + 4 * 2 * 4 * 16 * 64)
    assert row["train_flops_per_s"] / row["train_tokens_per_s"] == pytest.approx(per_token, rel=1e-9)


if __name__ == "__main__":
    sharded_shape()
