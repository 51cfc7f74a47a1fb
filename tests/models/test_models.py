"""Policy loading: freezing, gradient checkpointing, LoRA wrapping and the merged weights, errors."""
import pytest
import torch

from helpers import LORA
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.models import loading as models


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


def tied_model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float().train()


def test_a_tied_embedding_gets_the_same_dense_gradient_and_update_through_sparse_rows():
    """Two micro-batches with repeated tokens, accumulated, clipped, and a fused AdamW step: the same as with the
    dense embedding backward, to float rounding (the rows are summed in another order), and .grad stays dense."""
    dense, sparse = tied_model(), tied_model()
    assert models.sparse_tied_embedding_gradient(sparse) and sparse.get_input_embeddings().sparse
    ids = torch.randint(0, 40, (2, 3, 10), generator=torch.Generator().manual_seed(1))  # 40 of 96 rows, repeated
    updated = []
    for model in (dense, sparse):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for mb in ids:
            model(input_ids=mb, labels=mb).loss.backward()
        weight = model.get_input_embeddings().weight
        assert weight.grad.layout == torch.strided
        updated.append(weight.grad.clone())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        updated.append(weight.detach().clone())
    dense_grad, dense_weight, sparse_grad, sparse_weight = updated
    assert dense_grad[40:].abs().sum() > 0  # the head's gradient covers every row; the embedding's only 40
    torch.testing.assert_close(sparse_grad, dense_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sparse_weight, dense_weight, rtol=1e-5, atol=1e-6)


def test_an_untied_or_frozen_embedding_stays_dense(tiny_model_path):
    untied = models.load_policy(tiny_model_path, dtype=torch.float32, device="cpu")  # the tiny model is untied
    assert not models.sparse_tied_embedding_gradient(untied) and not untied.get_input_embeddings().sparse
    frozen = tied_model().requires_grad_(False)
    assert not models.sparse_tied_embedding_gradient(frozen)
