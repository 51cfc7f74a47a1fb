"""Streaming generation (``ray.streaming``): a vLLM engine that keeps requests in flight across weight pushes.

The caller submits requests (:meth:`StreamingEngine.submit`) and advances the engine a few decoding steps at a time
(:meth:`StreamingEngine.advance`), which returns the requests that finished meanwhile; it never waits for a whole
batch. A push (:meth:`StreamingEngine.pushing`) lands between two decoding steps: the scheduler is paused with its
requests kept (vLLM's ``pause_scheduler(mode="keep")``; an engine in this process steps only when asked, so it is
paused between calls already), the weights are loaded, and the same requests go on with the new ones, none lost or
restarted. Their KV cache of the tokens before the push stays as the old weights computed it, as in PipelineRL and
TRL's AsyncGRPO; the log-probs the engine reports for the tokens after it are those of the new weights over that
cache, which is what sampled them.

vLLM labels each output token with the weight version its engine core held when it sampled the token
(``CompletionOutput.weight_versions``); the engine's version is set to the policy version with each push, so every
token carries the policy version that sampled it. Requests carry a cache salt of the version they started under:
a request started after a push never reuses prefix blocks the old weights computed (a reset of the prefix cache
does nothing while requests run).
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines.vllm import SCORING, prompt_log_probs, sampled_log_probs


@dataclass
class Streamed:
    """One finished request: what :class:`~torchrl_grpo.engines.base.Completion` holds, and the policy version that
    sampled each token."""

    key: Hashable
    token_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish_reason: str
    text: str


class StreamingEngine:
    """Requests in flight over ``engine`` (a :class:`~torchrl_grpo.engines.vllm.VLLMEngine`), sampled with the
    given settings; ``version``: the policy version of the engine's weights now."""

    def __init__(self, engine, *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0, version: int = 0):
        import vllm

        self.engine, self.llm = engine, engine.llm
        self.core = self.llm.llm_engine
        if not hasattr(self.core, "set_weight_version"):
            raise ConfigError(f"ray.streaming=true needs vLLM's weight versions on output tokens, which vLLM "
                              f"{vllm.__version__} lacks; use vLLM 0.32 or later, or ray.streaming=false")
        self.params = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                           min_p=min_p, logprobs=0, detokenize=False)
        self._sampling_params = vllm.SamplingParams
        self.keys: dict[str, Hashable] = {}  # request id -> the caller's key
        self.ready: list[Streamed] = []  # finished while a score waited: the next advance returns them
        self._ids = itertools.count()
        self.version = version
        self.core.set_weight_version(str(version))

    @property
    def in_flight(self) -> int:
        return len(self.keys)

    def submit(self, key: Hashable, prompt_ids: Sequence[int]) -> None:
        """Start a request for one completion of ``prompt_ids``; :meth:`advance` returns it under ``key``."""
        [seed] = self.engine.sampling.request_seeds(1)
        params = self._sampling_params(**self.params, seed=seed)
        prompt = {"prompt_token_ids": [int(t) for t in prompt_ids], "cache_salt": f"policy-{self.version}"}
        request_id = f"stream-{next(self._ids)}"  # outputs and aborts name it so (vLLM adds a suffix inside)
        self.core.add_request(request_id, prompt, params)
        self.keys[request_id] = key

    def advance(self, max_steps: int | None = None) -> list[Streamed]:
        """Decode until a request finishes (or ``max_steps`` engine steps, or nothing is in flight); the finished
        ones."""
        finished, self.ready = self.ready, []
        steps = 0
        while self.keys and not finished and (max_steps is None or steps < max_steps):
            finished += [self._streamed(out) for out in self._step() if out.finished]
            steps += 1
        return finished

    def score(self, token_ids: Sequence[int]) -> list[float]:
        """What :meth:`~torchrl_grpo.engines.vllm.VLLMEngine.score` gives (prompt log-probs of ``token_ids[1:]``),
        beside the requests in flight, which go on meanwhile (those that finish wait for the next
        :meth:`advance`): ``LLM.generate`` would run them all to their end and keep their outputs."""
        ids = [int(t) for t in token_ids]
        request_id = f"score-{next(self._ids)}"
        self.core.add_request(request_id, {"prompt_token_ids": ids, "cache_salt": f"policy-{self.version}"},
                              self._sampling_params(**SCORING))
        while True:
            for out in self._step():
                if out.request_id == request_id:
                    return prompt_log_probs(out, ids)
                if out.finished:
                    self.ready.append(self._streamed(out))

    def _step(self) -> list:
        with self.engine.sampling.drawing():
            return self.core.step()

    def _streamed(self, out) -> Streamed:
        key = self.keys.pop(out.request_id)
        [c] = out.outputs
        ids = list(c.token_ids)
        log_probs = sampled_log_probs(c)
        versions = [0] * len(ids)
        for span in c.weight_versions or ():
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
        if ids and not c.weight_versions:
            raise RuntimeError("vLLM returned no weight versions for a finished request")
        return Streamed(key, ids, log_probs, versions, str(c.finish_reason),
                        self.engine.tokenizer.decode(ids, skip_special_tokens=True))

    @contextlib.contextmanager
    def pushing(self, version: int) -> Iterator[None]:
        """Around a push of policy ``version``'s weights: the scheduler paused with its requests kept (an engine in
        its own process; one in this process runs no step meanwhile), then labelled ``version`` and resumed."""
        from vllm.v1.engine.core_client import InprocClient

        own_process = not isinstance(self.core.engine_core, InprocClient)  # its core steps without being asked
        if own_process:
            self.core.engine_core.call_utility("pause_scheduler", "keep", False)
        try:
            yield
            self.core.set_weight_version(str(version))
            self.version = version
        finally:
            if own_process:
                self.core.engine_core.call_utility("resume_scheduler")

    def abort(self) -> list[Hashable]:
        """Drop every request in flight; their keys."""
        keys = list(self.keys.values())
        if self.keys:
            self.core.abort_request(list(self.keys))
            self.keys.clear()
        return keys
