"""What the objective's tests share: a table language model whose log-probs are known by hand, and plain-Python
statistics."""
import math

import torch
from tensordict import TensorDict


def mean(xs):
    return sum(xs) / len(xs)


def unbiased_std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


class TableLM(torch.nn.Module):
    """A 'language model' whose next-token logits depend only on the current token (a learnable table),
    so that expected log-probs can be computed by hand."""

    def __init__(self, vocab=5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g, dtype=torch.float64))
        self.head = torch.nn.Identity()  # the "hidden state" is already the logits row

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, use_cache=False):
        hidden = self.table[input_ids]
        return type("Out", (), {"logits": self.head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)})()


def hand_logp(model, tokens, temperature):
    table = model.table.detach()
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for i in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            row = (table[tokens[i, t - 1]] / temperature).tolist()
            z = math.log(sum(math.exp(x) for x in row))
            out[i, t] = row[tokens[i, t]] - z
    return out


def loss_batch(tokens, mask, adv, old, ref, sample=None, truncated=None):
    data = {
        "tokens": tokens,
        "attention_mask": torch.ones_like(tokens, dtype=torch.bool),
        "completion_mask": mask,
        "advantage": adv,
        "old_log_probs": old,
        "sample_log_probs": old if sample is None else sample,
        "truncated": torch.zeros(tokens.shape[0], dtype=torch.bool) if truncated is None else truncated,
    }
    if ref is not None:
        data["ref_log_probs"] = ref
    return TensorDict(data, batch_size=[tokens.shape[0]])
