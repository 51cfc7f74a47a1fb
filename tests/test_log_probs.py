"""The trainer's log-probs (head and log-softmax on the wanted positions only) against the plain computation:
every position's logits from the model, a full log-softmax, the token's entry taken; on the real tiny model,
a batch of mixed prompt and completion lengths with padding, plain and LoRA-wrapped."""
import pytest
import torch

from helpers import LORA
from torchrl_grpo.models.loading import load_policy
from torchrl_grpo.objective.loss import token_log_probs


def mixed_batch(vocab: int):
    """3 rows: prompts of 5, 2 and 4 tokens, completions of 3, 4 and 1, right-padded to 9 columns."""
    g = torch.Generator().manual_seed(0)
    lengths = [(5, 3), (2, 4), (4, 1)]
    width = max(p + c for p, c in lengths) + 1
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    attention = torch.zeros_like(tokens, dtype=torch.bool)
    completion = torch.zeros_like(attention)
    for i, (p, c) in enumerate(lengths):
        tokens[i, : p + c] = torch.randint(1, vocab, (p + c,), generator=g)
        attention[i, : p + c] = True
        completion[i, p: p + c] = True
    return tokens, attention, completion


def plain_log_probs(model, tokens, attention, temperature):
    """Every position's logits, a full log-softmax, the next token's entry: [N, L - 1] for tokens 1..L-1."""
    logits = model(input_ids=tokens, attention_mask=attention.long()).logits[:, :-1].float() / temperature
    log_probs = torch.log_softmax(logits, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1), entropy


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return out


@pytest.mark.parametrize("lora", [None, LORA], ids=["plain", "lora"])
def test_log_probs_on_wanted_positions_equal_the_full_computation(tiny_model_path, lora):
    model = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", lora=lora)
    tokens, attention, completion = mixed_batch(model.config.vocab_size)
    wanted = completion[:, 1:]  # as the plain computation's columns (tokens 1..L-1)
    expected, expected_entropy = plain_log_probs(model, tokens, attention, 0.7)
    (expected * wanted).sum().backward()
    expected_grads = grads(model)

    got, entropy = token_log_probs(model, tokens, attention, 0.7, with_entropy=True, wanted=completion)
    got.sum().backward()
    assert torch.allclose(got[:, 1:][wanted], expected[wanted], atol=1e-5)
    assert torch.allclose(entropy[:, 1:][wanted], expected_entropy[wanted], atol=1e-5)
    assert got[~completion].abs().sum() == 0 and entropy[~completion].abs().sum() == 0
    for name, grad in grads(model).items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-6), name


def test_log_probs_of_every_position_by_default(tiny_model_path):
    """No ``wanted``: every token but the first (the weight check's probe)."""
    model = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", trainable=False)
    tokens, attention, _ = mixed_batch(model.config.vocab_size)
    with torch.no_grad():
        expected, _ = plain_log_probs(model, tokens, attention, 1.0)
        got, _ = token_log_probs(model, tokens, attention)
    assert got[:, 0].abs().sum() == 0
    assert torch.allclose(got[:, 1:], expected, atol=1e-5)
