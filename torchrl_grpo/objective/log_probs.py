"""Per-token log-probs and entropies of a causal LM, with the output head and the log-softmax run a chunk of tokens
at a time.

Over a vocabulary of 150k tokens, the logits of a micro-batch in float32, their log-softmax and the entropy's
product are each 0.6 MB a token: 9.7 GB each at 16k tokens, and the backward keeps them. Here the model's head is
called where the model calls it (so that PEFT, FSDP2 and layers split over devices keep their hooks), but its
``forward`` is swapped, within :func:`token_log_probs`, for one that takes the hidden states of the wanted
positions only and returns each one's log-prob and entropy. It computes them :data:`CHUNK_BYTES` of logits at a
time, under activation checkpointing where a gradient is wanted: the backward recomputes each chunk's logits in
turn. No [tokens, vocab] tensor larger than one chunk exists in the forward or the backward, at the cost of the
head's forward once more in the backward.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 64 << 20  # the float32 logits of one chunk of tokens; its log-softmax and gradients are as big
# config keys of models that transform the head's output (softcapping, scaling): their logits must stay logits
TRANSFORMED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def token_log_probs(model, tokens, attention_mask, temperature: float = 1.0, with_entropy: bool = False,
                    wanted: torch.Tensor | None = None, entropy_grad: bool = False):
    """Log-prob of each token given its prefix, under ``softmax(logits / temperature)``, as [N, L].

    Only the ``wanted`` positions ([N, L] bool; default: all but the first, which has no prefix) are
    computed, the rest are 0: the model's head and the log-softmax run on exactly those tokens (the
    completions), never on prompt or padding positions, which would dominate both the cost and the memory
    of short completions over a full vocabulary (:func:`head_only_at`), and in chunks (module docstring). The
    temperature is the sampling one, so that these log-probs and the engine's describe the same distribution.
    The per-position entropy of that distribution too if asked, differentiable only if ``entropy_grad``
    (otherwise it is a diagnostic and must not cost a backward pass).
    """
    wanted = torch.ones_like(tokens, dtype=torch.bool) if wanted is None else wanted.to(tokens.device, torch.bool)
    wanted = torch.cat([torch.zeros_like(wanted[:, :1]), wanted[:, 1:]], 1)
    columns = wanted.any(0).nonzero()
    start = int(columns.min()) if len(columns) else tokens.shape[1]
    window = wanted[:, start:]  # position t's token is predicted from the hidden state at t - 1
    targets = tokens[:, start:][window]
    scores = ChunkedScores(targets, temperature, entropy_grad)
    with head_only_at(model, window), scores.in_head_of(model):
        out = model(input_ids=tokens, attention_mask=attention_mask.long(),
                    logits_to_keep=tokens.shape[1] - start + 1).logits[0]
    if not scores.ran:  # the model transforms its logits: they came out whole
        out = scores(out)
    # with the layers split over several GPUs the scores live on the last one: come back to the inputs'
    taken, entropy = out.to(tokens.device).unbind(-1)
    zeros = torch.zeros(tokens.shape, dtype=taken.dtype, device=tokens.device)
    return zeros.masked_scatter(wanted, taken), zeros.masked_scatter(wanted, entropy) if with_entropy else None


class ChunkedScores:
    """The log-prob of ``targets`` ([n] token ids) and the entropy at each of n positions, [n, 2] in float32 (or
    float64 for a float64 model), from
    their logits or from their hidden states and the head, :data:`CHUNK_BYTES` of logits at a time."""

    def __init__(self, targets: torch.Tensor, temperature: float, entropy_grad: bool):
        self.targets, self.temperature, self.entropy_grad = targets, temperature, entropy_grad
        self.ran = False

    def __call__(self, logits: torch.Tensor, head=None, vocab: int | None = None) -> torch.Tensor:
        """``logits`` [n, vocab], or with ``head`` the hidden states [n, hidden] that ``head`` maps to logits over
        ``vocab`` tokens."""
        size = max(1, CHUNK_BYTES // (4 * (vocab or logits.shape[-1])))
        targets = self.targets.to(logits.device)
        chunks = []
        for begin in range(0, max(len(logits), 1), size):  # no row: one empty chunk, the graph stays connected
            rows, taken = logits[begin:begin + size], targets[begin:begin + size]
            if head is not None and torch.is_grad_enabled():  # the backward recomputes the chunk's logits
                chunks.append(checkpoint(self._chunk, rows, taken, head, use_reentrant=False,
                                         preserve_rng_state=False))
            else:
                chunks.append(self._chunk(rows, taken, head))
        return torch.cat(chunks)

    def _chunk(self, rows: torch.Tensor, taken: torch.Tensor, head) -> torch.Tensor:
        logits = rows if head is None else head(rows)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: softmax in float32
        if self.temperature != 1.0:
            logits = logits / self.temperature
        log_probs = F.log_softmax(logits, dim=-1)
        logp = log_probs.gather(-1, taken.unsqueeze(-1)).squeeze(-1)
        with torch.set_grad_enabled(self.entropy_grad and torch.is_grad_enabled()):
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        return torch.stack([logp, entropy], -1)

    @contextlib.contextmanager
    def in_head_of(self, model):
        """Within this block, ``model``'s head returns these scores ([1, n, 2]) in place of the logits, unless the
        model transforms its logits after the head (:data:`TRANSFORMED_LOGITS`): then the head is left alone."""
        config = getattr(model, "config", None)
        if any(getattr(config, key, None) not in (None, 1, 1.0) for key in TRANSFORMED_LOGITS):
            yield
            return
        head = model.get_output_embeddings()
        own = "forward" in vars(head)  # a forward set on the instance (accelerate's device hooks) stays
        compute = head.forward
        weight = getattr(head, "weight", None)
        vocab = getattr(head, "out_features", None) or (weight.shape[0] if weight is not None else None)

        def scores(hidden, *args, **kwargs):
            self.ran = True
            return self(hidden[0], lambda rows: compute(rows, *args, **kwargs), vocab).unsqueeze(0)

        head.forward = scores
        try:
            yield
        finally:
            if own:
                head.forward = compute
            else:
                del head.forward


@contextlib.contextmanager
def head_only_at(model, window: torch.Tensor):
    """Within this block, ``model``'s output head (``get_output_embeddings()``) sees only the hidden states
    of ``window`` ([N, K] bool over the last K + 1 positions kept by ``logits_to_keep``, the last dropped:
    it predicts nothing), flattened to [1, n, hidden]: the logits come out as [1, n, vocab]. A hook on the
    head rather than the decoder's hidden states, so that the head is called where the model calls it, with
    whatever wraps the model (PEFT, FSDP2, layers split over devices) in place."""
    def select(module, args):
        hidden = args[0][:, :-1]
        return (hidden[window.to(hidden.device)].unsqueeze(0), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()
