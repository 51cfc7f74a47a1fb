"""The trainer's log-probs (head and log-softmax on the wanted positions only, a chunk of tokens at a time) against
the plain computation: every position's logits from the model, a full log-softmax, the token's entry taken; on the
real tiny model in float64, a batch of mixed prompt and completion lengths with padding, plain and LoRA-wrapped,
tied and untied head, one chunk or chunks of three tokens; and no [tokens, vocab] tensor above a chunk's size."""
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import LORA, padded_rows
from torchrl_grpo.models.loading import load_policy
from torchrl_grpo.objective import log_probs
from torchrl_grpo.objective.log_probs import token_log_probs


def mixed_batch(vocab: int):
    """3 rows: prompts of 5, 2 and 4 tokens, completions of 3, 4 and 1, right-padded to 9 columns."""
    return padded_rows(vocab, [(5, 3), (2, 4), (4, 1)], torch.Generator().manual_seed(0))


def plain_log_probs(model, tokens, attention, temperature):
    """Every position's logits, a full log-softmax, the next token's entry: [N, L - 1] for tokens 1..L-1."""
    logits = model(input_ids=tokens, attention_mask=attention.long()).logits[:, :-1].double() / temperature
    log_probs = torch.log_softmax(logits, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1), entropy


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return out


def tied(model):
    """``model`` with its head's weight the input embedding's, as in Qwen's small models."""
    model.lm_head.weight = model.get_input_embeddings().weight
    model.config.tie_word_embeddings = True
    return model


@pytest.mark.parametrize("chunk_tokens", [None, 3], ids=["one_chunk", "chunks_of_3"])
@pytest.mark.parametrize("head", ["untied", "tied"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["plain", "lora"])
def test_log_probs_on_wanted_positions_equal_the_full_computation(tiny_model_path, lora, head, chunk_tokens):
    torch.manual_seed(0)  # the LoRA initialisation
    model = load_policy(tiny_model_path, dtype=torch.float64, device="cpu", lora=lora)
    model = tied(model) if head == "tied" else model
    vocab = model.config.vocab_size
    chunk = 4 * vocab * chunk_tokens if chunk_tokens else None  # train.log_prob_chunk_mib, in bytes
    tokens, attention, completion = mixed_batch(vocab)
    wanted = completion[:, 1:]  # as the plain computation's columns (tokens 1..L-1)
    expected, expected_entropy = plain_log_probs(model, tokens, attention, 0.7)
    weights = torch.linspace(-1, 1, expected.numel(), dtype=torch.float64).view_as(expected)
    ((expected * weights + expected_entropy) * wanted).sum().backward()
    expected_grads = grads(model)

    got, entropy = token_log_probs(model, tokens, attention, 0.7, with_entropy=True, wanted=completion,
                                   entropy_grad=True, chunk_bytes=chunk)
    ((got[:, 1:] * weights + entropy[:, 1:]) * wanted).sum().backward()
    assert got.dtype == torch.float64
    assert torch.allclose(got[:, 1:][wanted], expected[wanted], atol=1e-12, rtol=0)
    assert torch.allclose(entropy[:, 1:][wanted], expected_entropy[wanted], atol=1e-12, rtol=0)
    assert got[~completion].abs().sum() == 0 and entropy[~completion].abs().sum() == 0
    got_grads = grads(model)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in got_grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-12, rtol=1e-9), name


class LargestLogits(TorchDispatchMode):
    """The most rows of any tensor over the vocabulary ([..., vocab], the head's weight and its views aside) made
    while it is on."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.largest = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.shape[-2:] != (
                    self.hidden, self.vocab):
                self.largest = max(self.largest, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_no_tensor_over_the_vocabulary_is_larger_than_a_chunk(tiny_model_path, monkeypatch, entropy_grad):
    """The forward and the backward over 22 completion tokens in chunks of 4 make no [tokens, vocab] tensor of more
    than 4 rows; in one chunk, the whole [22, vocab] is made."""
    model = load_policy(tiny_model_path, dtype=torch.float32, device="cpu")
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    monkeypatch.setattr(log_probs, "CHUNK_BYTES", 4 * vocab * 4)
    tokens = torch.randint(1, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    completion = torch.zeros_like(tokens, dtype=torch.bool)
    completion[0, 3:15], completion[1, 6:] = True, True
    with LargestLogits(vocab, hidden) as forward:
        got, entropy = token_log_probs(model, tokens, torch.ones_like(completion), with_entropy=True,
                                       wanted=completion, entropy_grad=entropy_grad)
    with LargestLogits(vocab, hidden) as backward:
        (got.sum() + entropy.sum()).backward() if entropy_grad else got.sum().backward()
    assert forward.largest == 4 and backward.largest == 4  # rows
    monkeypatch.setattr(log_probs, "CHUNK_BYTES", 1 << 40)  # one chunk: the whole [22, vocab] is made
    with LargestLogits(vocab, hidden) as whole:
        token_log_probs(model, tokens, torch.ones_like(completion), wanted=completion)
    assert whole.largest == 22


def test_a_model_that_transforms_its_logits_gets_them_whole(tiny_model_path, monkeypatch):
    """A softcapping model (Gemma's final_logit_softcapping) applies its cap to what the head returns: the head is
    left alone and the scores are computed from the capped logits."""
    model = load_policy(tiny_model_path, dtype=torch.float64, device="cpu", trainable=False)
    tokens, attention, completion = mixed_batch(model.config.vocab_size)
    with torch.no_grad():
        plain, _ = plain_log_probs(model, tokens, attention, 1.0)
    monkeypatch.setattr(model.config, "final_logit_softcapping", 30.0, raising=False)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape[-1]))
    with torch.no_grad():
        got, _ = token_log_probs(model, tokens, attention, wanted=completion)
    assert seen == [model.config.vocab_size]  # logits, not scores, came out of the head
    assert torch.allclose(got[:, 1:][completion[:, 1:]], plain[completion[:, 1:]], atol=1e-12, rtol=0)


def test_log_probs_of_every_position_by_default(tiny_model_path):
    """No ``wanted``: every token but the first (the weight check's probe)."""
    model = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", trainable=False)
    tokens, attention, _ = mixed_batch(model.config.vocab_size)
    with torch.no_grad():
        expected, _ = plain_log_probs(model, tokens, attention, 1.0)
        got, _ = token_log_probs(model, tokens, attention)
    assert got[:, 0].abs().sum() == 0
    assert torch.allclose(got[:, 1:].double(), expected, atol=1e-5)


def test_a_chunk_is_64_mib_on_a_cpu_and_a_share_of_a_gpus_memory(monkeypatch):
    """On a GPU a chunk is 1/128 of its memory (fewer, larger kernels), never under the CPU's 64 MiB."""
    memory = {}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=memory[torch.device(device).index]))
    memory.update({0: 80 << 30, 1: 4 << 30})
    assert log_probs.chunk_bytes(torch.device("cpu")) == 64 << 20
    assert log_probs.chunk_bytes(torch.device("cuda:0")) == 640 << 20
    assert log_probs.chunk_bytes(torch.device("cuda:1")) == 64 << 20
