"""torchrl-grpo export: a run's policy as a Hugging Face folder that transformers and a real vLLM engine load, with
a model card written from the run's metrics; LoRA merged or kept as an adapter; one-line errors."""
import json
import os
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from omegaconf import OmegaConf
from safetensors.torch import load_file

from helpers import ROOT, SCRIPT_ENV, needs_vllm
from torchrl_grpo.core.checkpoint import STATE_FILE
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.run.export import evaluation_table, export, model_card

pytestmark = pytest.mark.xdist_group("own_engine")  # the worker that holds the own_engine_run fixture

ROWS = [  # metrics.csv as read back: text cells, evaluations at steps 0 and 4, a step without one
    {"step": "0", "eval/accuracy": "0.414", "eval/reward": "0.5", "eval/pass@1": "0.414", "reward": "",
     "reward/accuracy": ""},
    {"step": "1", "eval/accuracy": "", "eval/reward": "", "eval/pass@1": "", "reward": "0.3", "reward/accuracy": "0.3"},
    {"step": "4", "eval/accuracy": "0.714", "eval/reward": "0.8", "eval/pass@1": "0.714", "reward": "0.7",
     "reward/accuracy": "0.7"},
]
CONFIG = {"model": {"name": "smollm2-135m-instruct"}, "env": {"dataset": "arithmetic", "num_envs": 2, "repeats": 8},
          "optimizer": {"lr": 2e-5}, "train": {"seed": 0, "kl_to_ref_coeff": 0.0},
          "train_model": {"lora": {"enabled": False}}, "inference_model": {"max_tokens": 16},
          "loss": {"aggregation": "sequence_mean"}}


def test_the_evaluation_table_is_the_first_against_the_last_evaluation_up_to_the_step():
    assert evaluation_table(ROWS, 4) == [("accuracy", 0.414, 0.714, 0, 4), ("reward", 0.5, 0.8, 0, 4),
                                         ("pass@1", 0.414, 0.714, 0, 4)]
    assert evaluation_table(ROWS, 3) == []  # one evaluation up to step 3: nothing to compare


def test_the_model_card_carries_the_hubs_metadata_and_the_runs_figures(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(model_card(CONFIG, ROWS, 4, "my-model", figure=True))
    card = ModelCard.load(path)
    meta = card.data.to_dict()
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation" and "grpo" in meta["tags"]
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results == {"accuracy": 0.714, "reward": 0.8, "pass@1": 0.714}
    assert "| accuracy | 0.414 | 0.714 |" in card.text and "| step 0 (before training) | step 4 |" in card.text
    assert "![reward over training](reward.png)" in card.text and "| rewards | accuracy |" in card.text
    assert "| LoRA | no |" in card.text


def export_command(*args, cwd):
    return subprocess.run([sys.executable, "-m", "torchrl_grpo", "export", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **SCRIPT_ENV, "PYTHONPATH": str(ROOT)})


@needs_vllm
def test_an_exported_run_loads_in_transformers_and_vllm_with_the_trained_weights(own_engine_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_grpo.engines.vllm import VLLMEngine

    dest = tmp_path / "my-model"
    done = export_command(own_engine_run.run_dir, dest, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"exported to {dest}/" in done.stdout
    last = sorted((own_engine_run.run_dir / "checkpoints").iterdir())[-1]
    assert not (dest / STATE_FILE).exists() and (dest / "config.json").is_file() and (dest / "README.md").is_file()
    assert load_file(dest / "model.safetensors").keys() == load_file(last / "model.safetensors").keys()
    assert all(torch.equal(a, b) for a, b in zip(load_file(dest / "model.safetensors").values(),
                                                 load_file(last / "model.safetensors").values()))
    tokenizer = AutoTokenizer.from_pretrained(dest)
    assert tokenizer.chat_template, "the chat template travels with the tokenizer"
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in ("What is 2 + 3?", "Hello")]
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    expected = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                             pad_token_id=tokenizer.eos_token_id)
        expected.append(out[0, len(ids):].tolist())
    engine = VLLMEngine(str(dest), dtype="float32", device="cpu", max_model_len=256, seed=0)
    try:
        sampled = [c.token_ids for c in engine.generate(prompts, n=1, max_tokens=8, temperature=0.0)]
    finally:
        engine.close()
    assert sampled == expected
    card = ModelCard.load(dest / "README.md")
    assert card.data.library_name == "transformers" and "| steps | 2 |" in card.text


def test_bad_exports_are_one_line_errors(own_engine_run, tmp_path):
    done = export_command(tmp_path / "nowhere", tmp_path / "out", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nowhere'}: no such run directory"]
    with pytest.raises(ConfigError, match=r"--step 7: .* has checkpoints of steps 1, 2; pick one of them"):
        export(own_engine_run.run_dir, tmp_path / "out", step=7)
    assert export(own_engine_run.run_dir, tmp_path / "step1", step=1).is_dir()
    with pytest.raises(ConfigError, match=r"--adapter: .* holds full weights"):
        export(own_engine_run.run_dir, tmp_path / "out", adapter=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match=r"full exists and is not empty; give a new folder"):
        export(own_engine_run.run_dir, tmp_path / "full")
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(CONFIG), run / ".hydra" / "config.yaml")
    with pytest.raises(ConfigError, match=r"checkpoints: no checkpoint to export"):
        export(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def lora_run(tmp_path, tiny_model_path):
    """A run directory as a LoRA run leaves it: its config and a checkpoint holding the adapter and the tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "lora-run"
    checkpoint = run / "checkpoints" / "step_000003"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(checkpoint)
    torch.save({"step": 3}, checkpoint / STATE_FILE)
    config = {**CONFIG, "model": {"name": "tiny"}, "train_model": {"lora": {"enabled": True, "r": 4, "alpha": 8}},
              "logging": {"checkpoint_dir": "checkpoints"}}
    (run / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(config), run / ".hydra" / "config.yaml")
    return run, model.merge_and_unload().state_dict()


def test_a_lora_run_exports_merged_or_as_its_adapter(tmp_path, tiny_model_path):
    from peft import AutoPeftModelForCausalLM

    run, merged = lora_run(tmp_path, tiny_model_path)
    full = export(run, tmp_path / "merged")
    weights = load_file(full / "model.safetensors")
    assert not (full / "adapter_config.json").exists()
    assert all(torch.allclose(weights[k], merged[k], atol=1e-6) for k in weights)
    assert "| LoRA | r=4, alpha=8 (merged) |" in (full / "README.md").read_text()
    only = export(run, tmp_path / "adapter", adapter=True)
    assert {p.name for p in only.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert not (only / STATE_FILE).exists()
    assert ModelCard.load(only / "README.md").data.library_name == "peft"
    reloaded = AutoPeftModelForCausalLM.from_pretrained(only, dtype=torch.float32).merge_and_unload().state_dict()
    assert all(torch.allclose(reloaded[k], merged[k], atol=1e-6) for k in merged)
    assert json.loads((only / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_an_export_casts_its_weights_to_the_dtype_asked(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    run, merged = lora_run(tmp_path, tiny_model_path)
    with pytest.raises(ConfigError, match=r"--dtype int8: choose one of bfloat16, float16, float32"):
        export(run, tmp_path / "bad", dtype="int8")
    half = export(run, tmp_path / "bf16", dtype="bfloat16")
    weights = load_file(half / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert all(torch.equal(weights[k], merged[k].to(torch.bfloat16)) for k in weights)
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(half).dtype == torch.bfloat16


def test_push_to_hub_uploads_the_exported_folder(tmp_path, tiny_model_path, monkeypatch):
    """The upload itself needs the network: huggingface_hub's two calls are recorded, with the written folder."""
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))
    def upload_folder(self, repo_id, folder_path, **kwargs):
        calls.append(("upload", repo_id, sorted(os.listdir(folder_path))))

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    run, _ = lora_run(tmp_path, tiny_model_path)
    dest = export(run, tmp_path / "pushed", push_to_hub="me/my-model")
    assert calls[0] == ("create", "me/my-model", {"exist_ok": True})
    assert calls[1][:2] == ("upload", "me/my-model")
    assert "README.md" in calls[1][2] and "model.safetensors" in calls[1][2]
    assert 'model="me/my-model"' in (dest / "README.md").read_text()  # the card's snippet loads it from the hub
