"""``TransformersEngine``: the :class:`~torchrl_grpo.engines.base.Engine` over an HF causal LM, with its own
batched, KV-cached sampling loop, and the nucleus (top-p) mask it shares with the tests.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from torchrl_grpo.engines.base import Completion, Engine
from torchrl_grpo.engines.weight_check import probe_log_probs
from torchrl_grpo.parallel.ranks import collective


def nucleus_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-p nucleus set to -inf, by vLLM's rule.

    Sort ascending, drop the tokens whose cumulative probability is <= 1 - top_p, always keep the
    largest.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return logits.scatter(-1, order, sorted_logits)


def truncated(logits: torch.Tensor, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """Logits with the tokens sampling may not pick set to -inf, by vLLM's rules in its order: ``min_p`` (drop
    tokens below ``min_p`` times the most likely one's probability), then ``top_k``, then ``top_p`` over what is
    left. Log-softmaxed, they give the log-probs vLLM reports (``processed_logprobs``)."""
    if min_p > 0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return nucleus_mask(logits, top_p) if top_p < 1.0 else logits


class TransformersEngine(Engine):
    """Sampling with an HF causal LM: a batched, left-padded, KV-cached loop written here.

    Temperature and top-p as in vLLM (:func:`nucleus_mask`); log-probs computed in float32 from the
    step's logits; stops at any eos id of the tokenizer or the model's generation config
    (``finish_reason="stop"``, eos kept in ``token_ids``), else ``"length"``. A ``torch.Generator`` seeded at
    construction makes it reproducible.

    ``model`` may be the trainer's own model object: ``push_weights`` is then a no-op for tensors that
    already are the model's parameters.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0, parallel=None):
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self.parallel = parallel  # a DataParallel: ``model`` is sharded over its ranks, which sample together
        self._generators: dict[torch.device, torch.Generator] = {}
        eos: set[int] = set()
        for source in (getattr(tokenizer, "eos_token_id", None),
                       getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
            if source is None:
                continue
            eos.update(int(t) for t in (source if isinstance(source, (list, tuple)) else [source]))
        if not eos:
            raise ValueError("TransformersEngine: neither the tokenizer nor the generation config names an eos token")
        self.eos_token_ids = sorted(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]

    def _generator(self, device: torch.device) -> torch.Generator:
        """The engine's generator on ``device`` (seeded once, on first use there)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def sampling_state(self) -> dict | None:
        """The state of each device's generator."""
        return {str(device): g.get_state() for device, g in self._generators.items()}

    def load_sampling_state(self, state: dict) -> None:
        for device, generator_state in state.items():
            self._generator(torch.device(device)).set_state(generator_state)

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
    ) -> list[Completion]:
        rows = [[int(t) for t in p] for p in prompt_token_ids for _ in range(n)]
        cut = (top_p, top_k, min_p)
        if not rows:
            return []
        if self.parallel is None:
            generator = self._generator(next(self.model.parameters()).device)
            sampled = self._sample(rows, max_tokens, temperature, cut, generator, stop=bool)
        else:  # each rank samples a share with the sharded policy; rank 0's generator seeds the call
            call_seed = int(torch.randint(2 ** 62, (1,), generator=self._generator(torch.device("cpu"))))
            sampled = self.sample_share(rows, max_tokens, temperature, cut, call_seed)
        return [Completion(i // n, ids, logps, "stop" if stopped else "length",
                           self.tokenizer.decode(ids, skip_special_tokens=True))
                for i, (ids, logps, stopped) in enumerate(sampled)]

    @collective
    @torch.no_grad()
    def sample_share(self, rows: list[list[int]], max_tokens: int, temperature: float,
                     cut: tuple[float, int, float], call_seed: int) -> list[tuple[list[int], list[float], bool]] | None:
        """On every data-parallel rank (rank 0 from :meth:`generate`, the others when it announces the call):
        sample this rank's share of ``rows`` (padded to a multiple of the ranks with copies of the first) with a
        generator seeded from ``call_seed`` and the rank, stepping until every rank's rows are done: each step
        is a forward of the sharded policy, which every rank must take together. Rank 0 gets all rows' samples
        in order, the others None."""
        parallel = self.parallel
        padded = rows + [rows[0]] * (-len(rows) % parallel.world_size)
        device = next(self.model.parameters()).device
        seed = int(np.random.SeedSequence([call_seed, parallel.rank]).generate_state(1)[0])
        generator = torch.Generator(device=device).manual_seed(seed)
        mine = self._sample(padded[parallel.share(len(padded))], max_tokens, temperature, cut, generator,
                            stop=parallel.all_true)
        shares = parallel.gather_objects(mine)
        return None if shares is None else [row for share in shares for row in share][: len(rows)]

    def _sample(self, rows: list[list[int]], max_tokens: int, temperature: float, cut: tuple[float, int, float],
                generator: torch.Generator, stop) -> list[tuple[list[int], list[float], bool]]:
        """(token ids, their log-probs, stopped at eos) for each row; ``cut``: (top_p, top_k, min_p), see
        :func:`truncated`; ``stop(all rows done)`` says whether to stop stepping (data-parallel ranks step until
        all ranks are done)."""
        model = self.model
        device = next(model.parameters()).device
        batch, width = len(rows), max(len(r) for r in rows)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token sits in the last column
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attention[i, width - len(r):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        eos = torch.tensor(self.eos_token_ids, device=device)

        tokens = torch.empty((batch, 0), dtype=torch.long, device=device)
        logps = torch.empty((batch, 0), dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.full((batch,), max_tokens, dtype=torch.long, device=device)
        was_training = model.training
        model.eval()
        try:
            past, step_ids, step_positions = None, input_ids, positions
            for step in range(max_tokens):
                out = model(
                    input_ids=step_ids,
                    attention_mask=attention,
                    position_ids=step_positions,
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
                if temperature > 0:
                    logits = logits / temperature
                    logits = truncated(logits, *cut)
                    log_dist = torch.log_softmax(logits, dim=-1)
                    next_ids = torch.multinomial(log_dist.exp(), 1, generator=generator)[:, 0]
                else:  # greedy; log-probs of the untempered distribution, as vLLM reports them
                    log_dist = torch.log_softmax(logits, dim=-1)
                    next_ids = logits.argmax(dim=-1)
                next_ids = torch.where(done, torch.full_like(next_ids, self.pad_token_id), next_ids)
                tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
                logps = torch.cat([logps, log_dist.gather(-1, next_ids[:, None])], dim=1)
                stopped = ~done & torch.isin(next_ids, eos)
                lengths = torch.where(stopped, torch.full_like(lengths, step + 1), lengths)
                done = done | stopped
                if stop(bool(done.all())):
                    break
                step_ids = next_ids[:, None]
                step_positions = step_positions[:, -1:] + 1
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        finally:
            model.train(was_training)

        tokens, logps, lengths, done = tokens.cpu(), logps.cpu(), lengths.cpu(), done.cpu()
        return [(tokens[i, :k].tolist(), logps[i, :k].tolist(), bool(done[i]))
                for i, k in enumerate(lengths.tolist())]

    def score(self, token_ids: Sequence[int]) -> list[float]:
        self.model.eval()
        return probe_log_probs(self.model, token_ids).tolist()

    def push_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights into the engine's model (skipping tensors that already are its own).

        A PEFT-wrapped model can only be the trainer's own (make_engine loads plain models), which
        already samples with its live adapters: the push is then a no-op.
        """
        model = getattr(self.model, "_orig_mod", self.model)  # torch.compile wrapper
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            return
        own = model.state_dict()
        unknown = [name for name in state_dict if name not in own]
        if unknown:
            raise KeyError(f"TransformersEngine.push_weights: the engine model has no parameter {unknown[0]!r} "
                           f"({len(unknown)} unknown)")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                target = own[name]
                if target.data_ptr() == tensor.data_ptr() and target.device == tensor.device:
                    continue  # the trainer's own model: already current
                target.copy_(tensor.detach())

    def close(self) -> None:
        """Drop the references to the model and the generators."""
        self.model = None
        self._generators.clear()
