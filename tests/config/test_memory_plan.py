"""The memory plan's arithmetic (torchrl_grpo/config/memory_plan.py) against values computed here by hand and
against the models transformers and PEFT build, and ``torchrl-grpo plan`` as users run it."""
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, cfg_with
from torchrl_grpo.config.memory_plan import (
    CHUNK_BYTES,
    CPU_PROCESS_BASELINE,
    VLLM_CPU_WORKING,
    Batch,
    Engine,
    ModelShape,
    activation_bytes,
    logits_bytes,
    plan_memory,
    trainer_role,
)
from torchrl_grpo.config.spec import resolve_run

GiB = 2 ** 30
# a hand-made shape: 2 layers, hidden 8, 2 heads of 4 (1 KV head), MLP 16, vocabulary 32, its own head
SMALL = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "tie_word_embeddings": False}
# q 8x8, k 8x4, v 8x4, o 8x8, gate/up/down 8x16 each, two norms of 8: per layer
LAYER = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16 + 2 * 8
PARAMS = 32 * 8 + 2 * LAYER + 8 + 32 * 8  # embedding, layers, final norm, head


def spec_of(*overrides):
    return resolve_run(cfg_with("model=tiny", "train.mixed_precision=false", *overrides))


def role_items(role) -> dict[str, int]:
    return {item.name: item.bytes for item in role.items}


def test_the_parameter_count_is_by_hand_and_is_what_transformers_builds():
    from transformers import AutoConfig, AutoModelForCausalLM

    assert ModelShape.from_config(SMALL).parameters == PARAMS
    shapes = [SMALL,
              {**SMALL, "model_type": "qwen2", "tie_word_embeddings": True},  # q, k, v biases; tied head
              {**SMALL, "model_type": "qwen3"},  # a norm over each head's q and k
              {**SMALL, "attention_bias": True, "mlp_bias": True}]
    for fields in shapes:
        config = AutoConfig.for_model(**fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert ModelShape.from_config(config.to_dict()).parameters == sum(p.numel() for p in model.parameters())


def test_a_config_without_a_decoders_shape_is_one_line():
    from torchrl_grpo.core.errors import ConfigError

    with pytest.raises(ConfigError, match="^model.name: its config.json has no intermediate_size;"):
        ModelShape.from_config({k: v for k, v in SMALL.items() if k != "intermediate_size"})
    with pytest.raises(ConfigError, match="^model.name: its config.json gives a decoder's shape"):
        ModelShape.from_config({**SMALL, "hidden_size": None})


def test_lora_trains_r_times_in_plus_out_per_linear_layer_as_peft_builds_it():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    per_layer = 4 * ((8 + 8) + (8 + 4) + (8 + 4) + (8 + 8) + 3 * (8 + 16))
    assert ModelShape.from_config(SMALL).lora_parameters({"r": 4}) == 2 * per_layer
    assert ModelShape.from_config(SMALL).lora_parameters({"r": 4, "target_modules": ["q_proj"]}) == 2 * 4 * 16
    model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**SMALL)),
                           LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * per_layer


def test_the_trainer_holds_weights_gradients_and_adam_state_and_fsdp_ranks_divide_them():
    shape = ModelShape.from_config(SMALL)
    batch = Batch(64, 16, "")
    one = role_items(trainer_role(shape, spec_of(), batch, None))
    assert (one["weights"], one["gradients"], one["optimizer state"]) == (PARAMS * 4, PARAMS * 4, 2 * PARAMS * 4)
    two = trainer_role(shape, spec_of("train_model.num_devices=2"), batch, None)
    items = role_items(two)
    assert (items["weights"], items["gradients"], items["optimizer state"]) == (PARAMS * 2, PARAMS * 2, PARAMS * 4)
    assert two.processes == 2  # on the CPU each rank is a process of the one machine
    # each rank gathers one layer and the root (embedding, head) in float32, weights and gradients
    assert items["FSDP2 gathered"] == (LAYER + 2 * 32 * 8) * 4 * 2


def test_a_layer_split_over_gpus_puts_each_share_of_the_layers_on_its_gpu():
    """train.strategy=layer_split: three layers over two GPUs, two on the first with the embedding, one on the second
    with the final norm, the head and the logits; together what one GPU would hold, bar the per-device constants."""
    shape = ModelShape.from_config({**SMALL, "num_hidden_layers": 3})
    spec = resolve_run(cfg_with("model=tiny", "train.strategy=layer_split", "train_model.num_devices=2",
                                "train.kl_to_ref_coeff=0"), gpu_count=3)
    assert spec.placement.train == ["cuda:0", "cuda:1"] and spec.placement.ranks == 1
    batch = Batch(64, 16, "")
    devices = plan_memory(shape, spec, batch, {"cuda:0": 80 * GiB, "cuda:1": 80 * GiB}, Engine(1000))
    first, second = (role_items(d.roles[0]) for d in devices[:2])
    weight = spec.precision.train_weights.itemsize
    assert first["weights"] == (32 * 8 + 2 * LAYER) * weight
    assert second["weights"] == (LAYER + 8 + 32 * 8) * weight
    assert first["gradients"] == first["weights"] and second["optimizer state"] == 2 * second["weights"]
    assert "logits chunk" not in first and second["logits chunk"] > 0
    whole = role_items(trainer_role(shape, spec, batch, 80 * GiB, "cuda:0"))
    assert first["weights"] + second["weights"] == whole["weights"] == (PARAMS + LAYER) * weight
    # checkpointing: each layer's input (8 x the residual's bytes a token) where the layer is, the recompute of one
    # layer and the hidden-state gradients on each GPU
    per_layer_input = 64 * 8 * weight
    assert first["activations"] - second["activations"] == per_layer_input
    assert whole["activations"] - first["activations"] == per_layer_input
    lora = resolve_run(cfg_with("model=tiny", "train.strategy=layer_split", "train_model.num_devices=2",
                                "train_model.lora.enabled=true", "train_model.lora.modules_to_save=[lm_head]"),
                       gpu_count=3)
    shares = [role_items(d.roles[0]) for d in plan_memory(shape, lora, batch, {}, Engine(1000))[:2]]
    adapters = shape.lora_parameters(lora.model.lora) - 32 * 8  # the saved head apart
    assert [s["gradients"] // 4 for s in shares] == [adapters * 2 // 3, adapters // 3 + 32 * 8]


def test_with_lora_the_gradients_and_optimizer_state_are_the_adapters_only():
    shape = ModelShape.from_config(SMALL)
    lora = shape.lora_parameters({"r": 8})
    items = role_items(trainer_role(shape, spec_of("train_model.lora.enabled=true"), Batch(64, 16, ""), None))
    assert items["weights"] == PARAMS * 4 + lora * 4
    assert (items["gradients"], items["optimizer state"]) == (lora * 4, 2 * lora * 4)
    # a vLLM engine on the CPU takes merged weights: every targeted weight, base + adapter, built at once
    assert items["merged weights for a push"] == 2 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16) * 4


def test_activations_by_hand_and_checkpointing_keeps_only_each_layers_input():
    shape, batch = ModelShape.from_config(SMALL), Batch(100, 10, "")
    # float32: per layer and token two norms' input and output (4 x 8), q, k and v repeated to 2 heads, the
    # attention's output and o_proj's input (5 x 8), the MLP's gate, SiLU, up and product (4 x 16)
    layer = (4 * 8 + 5 * 8 + 4 * 16) * 4
    hidden_grads = 3 * 8 * 4
    spec = spec_of()
    assert activation_bytes(shape, spec, batch, checkpointing=False) == 100 * (2 * layer + hidden_grads)
    assert activation_bytes(shape, spec, batch, checkpointing=True) == 100 * (2 * 8 * 4 + layer + hidden_grads)
    deep = ModelShape.from_config({**SMALL, "num_hidden_layers": 24})
    assert activation_bytes(deep, spec, batch, True) < activation_bytes(deep, spec, batch, False) / 5


def test_the_logits_are_at_most_four_chunks_of_the_heads_float32_output():
    shape = ModelShape.from_config({**SMALL, "vocab_size": 2 ** 16})
    chunk = CHUNK_BYTES // (4 * 2 ** 16)  # 256 tokens
    assert logits_bytes(shape, Batch(10_000, 100, ""), "cpu", None) == 4 * 100 * 2 ** 16 * 4  # one chunk holds it
    assert logits_bytes(shape, Batch(10_000, 5_000, ""), "cpu", None) == 4 * chunk * 2 ** 16 * 4
    # on a GPU a chunk is 1/128 of its memory when that is more than 64 MiB
    gpu_chunk = 80 * GiB // 128 // (4 * 2 ** 16)
    assert logits_bytes(shape, Batch(10_000, 5_000, ""), "cuda:0", 80 * GiB) == 4 * gpu_chunk * 2 ** 16 * 4
    # train.log_prob_chunk_mib: its MiB on either device, up to the micro-batch's completion tokens
    assert logits_bytes(shape, Batch(10_000, 5_000, ""), "cuda:0", 80 * GiB, 1 << 30) == 4 * 4096 * 2 ** 16 * 4
    assert logits_bytes(shape, Batch(10_000, 5_000, ""), "cpu", None, 2 << 30) == 4 * 5_000 * 2 ** 16 * 4


def test_the_cpu_total_adds_the_process_the_trainer_and_the_engine():
    shape, spec = ModelShape.from_config(SMALL), spec_of()
    [cpu] = plan_memory(shape, spec, Batch(64, 16, ""), {"cpu": 8 * GiB}, Engine(kv_tokens=1000))
    assert [r.name for r in cpu.roles] == ["process", "trainer", "engine"]
    engine = role_items(cpu.roles[2])
    assert engine == {"weights": PARAMS * 4, "KV cache": 1000 * 2 * 2 * 4 * 4,  # K and V, 2 layers, 1 KV head of 4
                      "working memory": VLLM_CPU_WORKING + PARAMS * 4}
    assert cpu.total == CPU_PROCESS_BASELINE + cpu.roles[1].bytes + sum(engine.values())
    assert cpu.fits and not plan_memory(shape, spec, Batch(64, 16, ""), {"cpu": GiB // 2}, Engine(1000))[0].fits
    # data-parallel ranks: each is a process, and the engine runs in processes of its own (vLLM's core and worker)
    [cpu] = plan_memory(shape, spec_of("train_model.num_devices=2"), Batch(64, 16, ""), {"cpu": 8 * GiB}, Engine(1000))
    assert [r.processes for r in cpu.roles] == [2, 2, 1]
    assert role_items(cpu.roles[2])["its processes"] == 2 * CPU_PROCESS_BASELINE


def test_the_plan_command_prints_each_device_total_and_refuses_a_bad_override_in_one_line(tmp_path):
    command = [sys.executable, "-m", "torchrl_grpo", "plan", "--config-name", "grpo_arithmetic", "model=tiny",
               "--prompt-tokens", "100"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = [float(v) for v in re.findall(r"^    \S.*?(\d+\.\d\d) GiB", out.stdout, re.M)]
    total = float(re.search(r"^  total\s+(\d+\.\d\d) GiB of [\d.]+ GiB: fits", out.stdout, re.M).group(1))
    assert abs(total - sum(sizes)) <= 0.01 * len(sizes)  # the items, each rounded
    assert total == pytest.approx((CPU_PROCESS_BASELINE + VLLM_CPU_WORKING) / GiB, abs=0.05)  # tiny weighs nothing
    assert "4 rows x 116 tokens" in out.stdout and not list(tmp_path.iterdir())  # nothing written
    assert out.stdout.splitlines()[-1].startswith("step time: not planned on a CPU")
    bad = subprocess.run([*command[:4], "train.optim_batch_size=3"], cwd=tmp_path, capture_output=True, text=True,
                         env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "train.optim_batch_size=3" in bad.stderr and not bad.stdout


def test_a_run_that_cannot_fit_even_with_short_prompts_is_refused_in_one_line_naming_the_keys(
        tiny_model_path, monkeypatch, capsys):
    from torchrl_grpo.core.errors import ConfigError
    from torchrl_grpo.run import memory

    monkeypatch.setattr(memory, "device_memory", lambda device, given=None: GiB // 4)  # below the process alone
    with pytest.raises(ConfigError, match=r"^memory plan: cpu needs 0\.\d GiB .* has 0\.2 GiB; to fit: .*"
                                          r"train_model\.lora\.enabled=true.*train\.check_memory=false") as refused:
        memory.check_memory(spec_of(), tiny_model_path)
    assert "gradient_checkpointing" not in str(refused.value)  # on already: not a way to fit
    memory.check_memory(spec_of("train.check_memory=false"), tiny_model_path)
    assert "warning: the memory plan does not fit" in capsys.readouterr().out
    monkeypatch.undo()
    memory.check_memory(spec_of(), tiny_model_path)  # the machine holds it
    assert re.fullmatch(r"memory plan: cpu \d\.\d of [\d.]+ GiB \(process 0\.6, trainer 0\.\d, engine 0\.3\) "
                        r"\(torchrl-grpo plan shows the parts\)\n", capsys.readouterr().out)


def test_on_a_shared_gpu_a_sleeping_engine_frees_its_share_while_the_trainer_trains():
    import dataclasses

    from torchrl_grpo.config.placement import Placement

    shape, spec = ModelShape.from_config(SMALL), spec_of("train_model.torch_dtype=bfloat16")
    gpu = Placement(["cuda:0"], ["cuda:0"], ["cuda:0"], shared=True)
    capacity = 80 * GiB

    def plan(sleep, tokens=64):
        engine = dataclasses.replace(spec.engine, sleep=sleep, gpu_memory_utilization=0.5)
        [device] = plan_memory(shape, dataclasses.replace(spec, placement=gpu, engine=engine),
                               Batch(tokens, tokens // 4, ""), {"cuda:0": capacity}, Engine(1000))
        return device

    awake, asleep = plan(0), plan(2)
    assert [r.name for r in awake.roles] == ["trainer", "engine"]  # no process baseline on a GPU
    trainer, reserved = awake.roles[0].bytes, 40 * GiB
    assert role_items(awake.roles[1]) == {"weights": PARAMS * 2, "KV cache and activations": reserved - PARAMS * 2}
    assert awake.total == trainer + reserved
    # while the engine generates the trainer keeps its bf16 weights and AdamW's two states, not a step's gradients,
    # activations and logits
    kept = PARAMS * 2 * 3
    assert trainer > kept
    assert asleep.total == reserved + kept  # the engine generating beside them is the larger phase here
    assert plan(1).total == asleep.total  # level 1 moves the weights to the CPU's memory: the GPU is as free
    long_rows = plan(2, tokens=100_000_000)  # a micro-batch whose activations outgrow the engine's share
    assert long_rows.total == long_rows.roles[0].bytes > reserved + kept  # then training is the peak


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
                                  "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-3B"])
def test_the_shipped_shapes_are_what_transformers_builds_and_load_offline(name, monkeypatch):
    """Hub models' config.json shipped for planning offline: their parameter counts as transformers builds them (on
    the meta device: no memory), read by the plan where the hub is unreachable."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchrl_grpo.models.sources import model_config, shipped_shape

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hub-cache")  # not cached: the shipped shape
    fields = model_config(name)
    assert fields == shipped_shape(name) == shipped_shape(name.upper())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    assert ModelShape.from_config(fields).parameters == sum(p.numel() for p in model.parameters())


def test_data_parallel_gpus_each_hold_a_rank_and_a_tensor_parallel_share_of_the_engine():
    """``torchrl-grpo plan --gpus 8``: eight FSDP2 ranks, each on its GPU with its share of the weights and of each
    micro-batch; an engine over four of them, a quarter of its weights on each."""
    from torchrl_grpo.core.errors import ConfigError
    from torchrl_grpo.run.memory import PlanOptions, plan_options, run_memory_plan

    options, rest = plan_options(["--gpus", "8", "--device-memory=80", "train_model.num_devices=8",
                                  "inference_model.num_devices=4"])
    assert options == PlanOptions(None, 80.0, 8) and rest == ["train_model.num_devices=8",
                                                              "inference_model.num_devices=4"]
    spec = resolve_run(cfg_with("model=tiny", "train.strategy=fsdp", "train.optim_batch_size=8", *rest), gpu_count=8)
    devices, prompt = run_memory_plan(spec, prompt_tokens=100, device_gib=80)
    assert [d.name for d in devices] == [f"cuda:{i}" for i in range(8)]
    assert [[r.name for r in d.roles] for d in devices] == [["trainer", "engine"]] * 4 + [["trainer"]] * 4
    assert all(d.capacity == 80 * GiB for d in devices)
    one = resolve_run(cfg_with("model=tiny", "train.optim_batch_size=8", "train_model.num_devices=1",
                               "inference_model.num_devices=1"), gpu_count=1)
    [single], _ = run_memory_plan(one, prompt_tokens=100, device_gib=80)
    rank, whole = role_items(devices[0].roles[0]), role_items(single.roles[0])
    assert rank["activations"] * 8 == whole["activations"]  # one row of the micro-batch's eight
    assert role_items(devices[0].roles[1])["weights"] * 4 == role_items(single.roles[1])["weights"]
    with pytest.raises(ConfigError, match="^--gpus 8: give each GPU's memory too"):
        plan_options(["--gpus", "8"])
