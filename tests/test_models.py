"""Policy loading: freezing, gradient checkpointing, LoRA wrapping and the merged weights, errors."""
import pytest
import torch

from helpers import LORA
from torchrl_grpo import models
from torchrl_grpo.errors import ConfigError



def test_reference_model_is_frozen(tiny_model_path):
    ref = models.load_policy(tiny_model_path, dtype=torch.bfloat16, device="cpu", trainable=False)
    assert not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.dtype == torch.bfloat16 for p in ref.parameters())


def test_gradient_checkpointing_turns_cache_off(tiny_model_path):
    model = models.load_policy(tiny_model_path, dtype=torch.float32, device="cpu", gradient_checkpointing=True)
    assert model.is_gradient_checkpointing and model.config.use_cache is False
    ids = torch.randint(0, 500, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    # every parameter gets a finite, non-zero gradient through the recomputed activations
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in model.parameters())


def test_plain_merged_state_dict_is_named_parameters(tiny_model_path):
    model = models.load_policy(tiny_model_path, dtype=torch.float32, device="cpu")
    sd = models.merged_state_dict(model)
    assert list(sd) == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" in sd  # untied in the tiny model


def test_lora_trains_only_adapters_and_merges_exactly(tiny_model_path):
    base = models.load_policy(tiny_model_path, dtype=torch.float32, device="cpu")
    base_sd = {k: v.clone() for k, v in models.merged_state_dict(base).items()}
    model = models.load_policy(tiny_model_path, dtype=torch.float32, device="cpu", lora=LORA)

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("lm_head" not in n and "mlp" in n for n in trainable)  # all-linear reaches the MLPs
    assert not any("lm_head" in n for n in trainable)
    ids = torch.randint(0, 500, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in model.named_parameters())

    # LoRA B starts at zero; give it values so that the merge is visible.
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits

    sd = models.merged_state_dict(model)
    assert sd.keys() == base_sd.keys()
    assert not any("lora_" in k or "base_model" in k or "base_layer" in k for k in sd)

    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = base_sd["model.layers.0.self_attn.q_proj.weight"] + (B @ A) * (LORA["alpha"] / LORA["r"])
    torch.testing.assert_close(sd["model.layers.0.self_attn.q_proj.weight"], want)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sd[q], base_sd[q])
    assert torch.equal(sd["model.layers.0.input_layernorm.weight"], base_sd["model.layers.0.input_layernorm.weight"])
    assert torch.equal(sd["lm_head.weight"], base_sd["lm_head.weight"])

    # The trained model is untouched: its base weight is still the original, its output unchanged.
    torch.testing.assert_close(layer.base_layer.weight, base_sd["model.layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)

    # The merged weights in a plain model give the LoRA model's output.
    base.load_state_dict(sd)
    base.eval()
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)


def test_bad_lora_config_names_the_key(tiny_model_path):
    with pytest.raises(ConfigError, match=r"train_model\.lora\.r"):
        models.load_policy(tiny_model_path, dtype=torch.float32, device="cpu", lora={**LORA, "r": 0})
