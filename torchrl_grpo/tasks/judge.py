"""An LLM judge as a reward (``env.judge``): an OpenAI-compatible chat endpoint (vLLM's server, OpenAI, ...)
asked to grade each completion, through the ``openai`` client.

Each completion is one request of ``template`` filled with ``{prompt}``, ``{completion}`` and the row's columns;
the score is the last match of ``score_pattern`` in the reply, divided by ``scale``. A batch's requests run
concurrently (at most ``max_concurrency`` at once), each with ``timeout_s`` and up to ``max_retries`` retries
(the client's backoff; on timeouts, connection errors, 429 and 5xx). A request that still fails, or a reply with
no score, is that completion's error, handled as ``env.reward_errors`` says. The API key is read from the
environment variable ``api_key_env`` when a batch is scored: only the variable's name is in the config.
"""
from __future__ import annotations

import asyncio
import os
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from torchrl_grpo.core.errors import ConfigError

DEFAULT_TEMPLATE = ("Rate how well the response answers the request, from 0 (useless) to 10 (perfect).\n\n"
                    "Request:\n{prompt}\n\nResponse:\n{completion}\n\nReply with the score only.")


class Judge:
    def __init__(self, base_url: str, model: str, template: str = DEFAULT_TEMPLATE,
                 score_pattern: str = r"-?\d+(?:\.\d+)?", scale: float = 10.0, max_concurrency: int = 8,
                 timeout_s: float = 60.0, max_retries: int = 2, api_key_env: str = "OPENAI_API_KEY",
                 max_tokens: int = 16, temperature: float = 0.0):
        self.base_url, self.model, self.template = base_url, model, template
        self.pattern, self.scale = re.compile(score_pattern), float(scale)
        self.max_concurrency, self.timeout_s, self.max_retries = max_concurrency, timeout_s, max_retries
        self.api_key_env, self.max_tokens, self.temperature = api_key_env, max_tokens, temperature

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids=None,
                       **columns) -> list:
        """One score per completion, or the exception its request ended with (scored as env.reward_errors says)."""
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url, api_key=os.environ.get(self.api_key_env) or "EMPTY",
                             timeout=self.timeout_s, max_retries=self.max_retries)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def grade(i: int):
            async with gate:
                try:
                    fields = {k: v[i] for k, v in columns.items()}  # a "prompt" column: the prompt below
                    fields.update(prompt=_text(prompts[i]), completion=_text(completions[i]))
                    request = self.template.format(**fields)
                    reply = await client.chat.completions.create(
                        model=self.model, messages=[{"role": "user", "content": request}],
                        max_tokens=self.max_tokens, temperature=self.temperature)
                    return self.parse(reply.choices[0].message.content or "")
                except Exception as err:
                    return err

        try:
            return list(await asyncio.gather(*(grade(i) for i in range(len(completions)))))
        finally:
            await client.close()

    def parse(self, reply: str) -> float:
        found = self.pattern.findall(reply)
        if not found:
            raise ValueError(f"the judge's reply {reply[:80]!r} has no score matching env.judge.score_pattern")
        last = found[-1]
        return float(last if isinstance(last, str) else last[0]) / self.scale


def judge_entry(spec: Mapping[str, Any], columns: Sequence[str]) -> dict:
    """``env.judge`` as an ``env.rewards``-style entry (the judge, its name and weight), its template checked to
    name only ``prompt``, ``completion`` and the task's columns."""
    if not isinstance(spec, Mapping) or not spec.get("base_url") or not spec.get("model"):
        raise ConfigError("env.judge: give at least base_url and model, e.g. {base_url: http://localhost:8000/v1, "
                          "model: Qwen/Qwen2.5-7B-Instruct}")
    known = {"base_url", "model", "template", "score_pattern", "scale", "max_concurrency", "timeout_s",
             "max_retries", "api_key_env", "max_tokens", "temperature", "name", "weight"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"env.judge.{unknown[0]}: unknown key; the keys are {', '.join(sorted(known))}")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(spec.get("api_key_env") or "OPENAI_API_KEY")):
        raise ConfigError("env.judge.api_key_env: give the name of the environment variable that holds the key "
                          "(e.g. OPENAI_API_KEY), never the key itself")
    template = spec.get("template") or DEFAULT_TEMPLATE
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    allowed = {"prompt", "completion", *columns}
    if "completion" not in fields or fields - allowed:
        bad = sorted(fields - allowed)
        raise ConfigError(f"env.judge.template: {'{' + bad[0] + '}' if bad else 'no {completion}'}: a template fills "
                          f"{{completion}} and may use "
                          f"{', '.join('{' + c + '}' for c in sorted(allowed - {'completion'}))}")
    try:
        re.compile(spec.get("score_pattern") or r"x")
    except re.error as err:
        raise ConfigError(f"env.judge.score_pattern: not a regular expression ({err})") from None
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "weight") and v is not None}
    return {"fn": Judge(**kwargs), "name": spec.get("name") or "judge", "weight": float(spec.get("weight", 1.0))}


def _text(value: Any) -> str:
    """A prompt or completion as text: chat messages as ``role: content`` lines."""
    if isinstance(value, str):
        return value
    return "\n".join(f"{m['role']}: {m['content']}" for m in value)
