"""Per-token log-probs and entropies of a causal LM, with the output head and the log-softmax run a chunk of tokens
at a time.

Over a vocabulary of 150k tokens, the logits of a micro-batch in float32, their log-softmax and the entropy's
product are each 0.6 MB a token: 9.7 GB each at 16k tokens, and the backward keeps them. Here the model's head is
called where the model calls it (so that PEFT, FSDP2 and layers split over devices keep their hooks), but its
``forward`` is swapped, within :func:`token_log_probs`, for one that takes the hidden states of the wanted
positions only and returns each one's log-prob and entropy. It computes them a chunk of float32 logits at a time
(:func:`chunk_bytes`: 64 MiB on a CPU, a share of its memory on a GPU). Where there is more than one chunk and a
gradient is wanted, each chunk runs under activation checkpointing: the backward recomputes its logits in turn. No
[tokens, vocab] tensor larger than one chunk exists in the forward or the backward, at the cost of the head's forward
once more in the backward; a micro-batch whose logits fit one chunk is computed as a whole and kept for the backward,
with no recompute.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int, Shaped
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 64 << 20  # the float32 logits of one chunk of tokens; its log-softmax and gradients are as big
GPU_SHARE = 128  # on a GPU a chunk is this share of its memory, if larger: fewer, larger kernels
# config keys of models that transform the head's output (softcapping, scaling): their logits must stay logits
TRANSFORMED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def token_log_probs(model, tokens: Int[Tensor, "N L"], attention_mask: Shaped[Tensor, "N L"],
                    temperature: float = 1.0, with_entropy: bool = False, wanted: Shaped[Tensor, "N L"] | None = None,
                    entropy_grad: bool = False, packed: bool = False, chunk_bytes: int | None = None
                    ) -> tuple[Float[Tensor, "N L"], Float[Tensor, "N L"] | None]:
    """Log-prob of each token given its prefix, under ``softmax(logits / temperature)``, as [N, L].

    Only the ``wanted`` positions ([N, L] bool; default: all but the first, which has no prefix) are
    computed, the rest are 0: the model's head and the log-softmax run on exactly those tokens (the
    completions), never on prompt or padding positions, which would dominate both the cost and the memory
    of short completions over a full vocabulary (:func:`head_only_at`), and in chunks (module docstring). The
    temperature is the sampling one, so that these log-probs and the engine's describe the same distribution.
    The per-position entropy of that distribution too if asked, differentiable only if ``entropy_grad``
    (otherwise it is a diagnostic and must not cost a backward pass).

    ``packed``: the model reads the rows end to end as one sequence without their padding, its position ids
    starting again at each row, which keeps attention within a row (:func:`packed_inputs`); the values are the
    padded computation's. Rows are the ``attention_mask``'s tokens, contiguous in each row.

    ``chunk_bytes``: float32 logits per chunk (``train.log_prob_chunk_mib``; default :func:`chunk_bytes` of the
    device).
    """
    wanted = torch.ones_like(tokens, dtype=torch.bool) if wanted is None else wanted.to(tokens.device, torch.bool)
    wanted = torch.cat([torch.zeros_like(wanted[:, :1]), wanted[:, 1:]], 1)
    targets = tokens[wanted]  # position t's token is predicted from the hidden state at t - 1
    if packed:
        inputs, positions = packed_inputs(tokens, attention_mask.bool(), wanted)

        def pick(hidden):
            return hidden[0, positions.to(hidden.device)]
    else:
        columns = wanted.any(0).nonzero()
        start = int(columns.min()) if len(columns) else tokens.shape[1]
        window = wanted[:, start:]  # the hidden states kept are those at start - 1 ..., the last predicts nothing
        inputs = {"input_ids": tokens, "attention_mask": attention_mask.long(),
                  "logits_to_keep": tokens.shape[1] - start + 1, "use_cache": False}

        def pick(hidden):
            return hidden[:, :-1][window.to(hidden.device)]
    scores = ChunkedScores(targets, temperature, entropy_grad, chunk_bytes)
    with head_only_at(model, pick), scores.in_head_of(model):
        out = model(**inputs).logits[0]
    if not scores.ran:  # the model transforms its logits: they came out whole
        out = scores(out)
    # with the layers split over several GPUs the scores live on the last one: come back to the inputs'
    taken, entropy = out.to(tokens.device).unbind(-1)
    zeros = torch.zeros(tokens.shape, dtype=taken.dtype, device=tokens.device)
    return zeros.masked_scatter(wanted, taken), zeros.masked_scatter(wanted, entropy) if with_entropy else None


class ChunkedScores:
    """The log-prob of ``targets`` ([n] token ids) and the entropy at each of n positions, [n, 2] in float32 (float64
    for a float64 model), from their logits or from their hidden states and the head, :data:`CHUNK_BYTES` of logits
    at a time (``chunk``; default :func:`chunk_bytes` of the device)."""

    def __init__(self, targets: torch.Tensor, temperature: float, entropy_grad: bool, chunk: int | None = None):
        self.targets, self.temperature, self.entropy_grad, self.chunk = targets, temperature, entropy_grad, chunk
        self.ran = False

    def __call__(self, logits: torch.Tensor, head=None, vocab: int | None = None) -> torch.Tensor:
        """``logits`` [n, vocab], or with ``head`` the hidden states [n, hidden] that ``head`` maps to logits over
        ``vocab`` tokens."""
        size = max(1, (self.chunk or chunk_bytes(logits.device)) // (4 * (vocab or logits.shape[-1])))
        targets = self.targets.to(logits.device)
        # logits within the budget are kept for the backward as they are; beyond it each chunk's are recomputed there
        recompute = head is not None and torch.is_grad_enabled() and len(logits) > size
        chunks = []
        for begin in range(0, max(len(logits), 1), size):  # no row: one empty chunk, the graph stays connected
            rows, taken = logits[begin:begin + size], targets[begin:begin + size]
            if recompute:
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


def chunk_bytes(device: torch.device) -> int:
    """The float32 logits of one chunk on ``device``: :data:`CHUNK_BYTES` on a CPU, where chunks cost no speed; on a
    GPU 1/:data:`GPU_SHARE` of its memory if more (1.1 GiB on an H200, 1,900 tokens of a 150k vocabulary): there
    each chunk launches its kernels from Python three times, and at 64 MiB (110 tokens) a 16k-token micro-batch
    trained 22% slower than with its logits whole."""
    if device.type != "cuda":
        return CHUNK_BYTES
    return max(CHUNK_BYTES, torch.cuda.get_device_properties(device).total_memory // GPU_SHARE)


def packed_inputs(tokens: torch.Tensor, attention: torch.Tensor, wanted: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The model's inputs for ``tokens``' rows ([N, L], ``attention`` their tokens) packed end to end: ids [1, T]
    and position ids restarting at 0 at each row, no attention mask and no KV cache (transformers then builds a causal
    mask within each run of increasing positions: sdpa, eager and flex attention; flash-attention takes them as its
    varlen boundaries); and the packed index of the hidden state that predicts each ``wanted`` token, in row-major
    order."""
    index = attention.flatten().cumsum(0).view_as(attention) - 1  # each token's place in the packed sequence
    previous = torch.cat([torch.zeros_like(index[:, :1]), index[:, :-1]], 1)  # that of the token before it
    positions = (attention.cumsum(-1) - 1)[attention]
    inputs = {"input_ids": tokens[attention].unsqueeze(0), "position_ids": positions.unsqueeze(0), "use_cache": False}
    return inputs, previous[wanted]


def packing_gap(model, read=None) -> float:
    """How much a row's log-probs, read packed after another row, change when that other row changes: 0 where
    attention stays within a row (masked keys add exact zeros, whatever the precision), far from it where a model
    ignores the restarting position ids and lets a row see the one before it. ``read(model, rows, attention)``: what
    is read per token, packed ([N, L]; default the log-probs; a critic's values). A collective under FSDP2."""
    if read is None:
        def read(model, rows, attention):
            return token_log_probs(model, rows, attention, wanted=attention, packed=True)[0]
    embeddings = model.get_input_embeddings().weight
    tokens = torch.randint(1, int(embeddings.shape[0]), (3, 8), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(2, 8, dtype=torch.bool, device=embeddings.device)
    seen = []
    with torch.no_grad():
        for before in tokens[:2]:
            seen.append(read(model, torch.stack([before, tokens[2]]).to(embeddings.device), attention)[1])
    return float((seen[0] - seen[1]).abs().max())


@contextlib.contextmanager
def head_only_at(model, pick):
    """Within this block, ``model``'s output head (``get_output_embeddings()``) sees only the hidden states
    ``pick(hidden)`` selects ([n, hidden], the positions that predict a wanted token), as [1, n, hidden]: the
    logits come out as [1, n, vocab]. A hook on the head rather than the decoder's hidden states, so that the
    head is called where the model calls it, with whatever wraps the model (PEFT, FSDP2, layers split over
    devices) in place."""
    def select(module, args):
        return (pick(args[0]).unsqueeze(0), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()
