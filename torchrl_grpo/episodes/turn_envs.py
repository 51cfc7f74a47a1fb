"""What answers the model between its turns in a multi-turn episode (``env.max_steps > 1``): a :class:`TurnEnv`.

After each engine turn but the last, :func:`torchrl_grpo.episodes.play.play` calls ``turn_env.step(task, row,
conversation)``; the :class:`Reply` either ends the episode or gives the messages that follow (a tool's output,
feedback), which the episode inserts token by token. When the episode ends, ``turn_env.score`` gives its reward
components. Two ship here, and ``env.turn_env: {_target_: my_pkg.MyEnv, ...}`` plugs in any other subclass:

- :class:`PythonTool`: a turn holding a fenced ```` ```python ```` block is a call; the last block runs in the
  sandbox (:mod:`torchrl_grpo.episodes.sandbox`) and its output comes back as a ``tool`` message; a turn without one is
  the final answer, judged by the task's rewards.
- :class:`RetryFeedback`: a wrong answer gets "Wrong, try again." and another turn; the reward is that of the
  last answer times ``discount`` per retry.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrl_grpo.core.errors import ConfigError, RunError, import_target
from torchrl_grpo.episodes.sandbox import run_python


@dataclass
class Reply:
    """The environment's answer to a turn: ``messages`` to add and a new turn, or ``done``; ``counts`` add up per
    episode and are logged as their mean per episode (``turns/<name>``)."""

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    counts: dict[str, int] = field(default_factory=dict)


class TurnEnv:
    """Subclass and override :meth:`step` (and :meth:`score` where the reward is not the last turn's)."""

    counters: tuple[str, ...] = ()  # the names of Reply.counts, logged every step (0 when none occurred)

    def step(self, task, row: Mapping[str, Any], conversation: list[dict]) -> Reply:
        """The reply to ``conversation``, which ends with the assistant's turn (its text)."""
        raise NotImplementedError

    def score(self, task, row: Mapping[str, Any], conversation: list[dict], turns: int) -> dict[str, float]:
        """The episode's reward components: by default the task's rewards of the assistant's last turn."""
        return task.score(conversation[-1]["content"], row)


_CODE_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def python_call(text: str) -> str | None:
    """The code of the last fenced ```` ```python ```` block in ``text``, or None (no call: a final answer)."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


class PythonTool(TurnEnv):
    """A Python interpreter as a tool: the last ```` ```python ```` block of a turn runs in a fresh sandboxed
    process (``timeout_s`` wall clock, ``memory_mb``, output capped at ``max_output_chars``; no network, no writes
    outside its temporary folder) and its output (stdout and stderr, or the sandbox's note on a breached limit)
    is the ``tool`` message that follows. A failing call is an error message to the model, never a failed run.
    ``strict=False`` runs without the kernel layers (network namespace, Landlock) a machine lacks."""

    counters = ("tool_calls", "tool_errors", "tool_timeouts")

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 1000,
                 role: str = "tool", strict: bool = True):
        for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_chars", max_output_chars)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"env.turn_env.{name}={value!r}: must be a number > 0")
        self.timeout_s, self.memory_mb, self.max_output_chars = timeout_s, int(memory_mb), int(max_output_chars)
        self.role, self.strict = role, bool(strict)
        try:  # the sandbox works here, before anything heavy starts
            run_python("pass", timeout_s=10, strict=self.strict)
        except RunError as err:
            raise ConfigError(f"env.turn_env (PythonTool): {err}; or set env.turn_env.strict=false to run tool calls "
                              "without the layers this machine lacks") from None

    def step(self, task, row, conversation) -> Reply:
        code = python_call(conversation[-1]["content"])
        if code is None:
            return Reply(done=True)
        result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            max_output_bytes=4 * self.max_output_chars, strict=self.strict)
        output = result.output.strip() or "(no output)"
        if len(output) > self.max_output_chars:
            output = output[: self.max_output_chars] + "\n[output cut]"
        return Reply([{"role": self.role, "content": output}], counts={
            "tool_calls": 1, "tool_errors": int(result.status in ("error", "memory")),
            "tool_timeouts": int(result.status == "timeout")})


class RetryFeedback(TurnEnv):
    """Answer, hear ``feedback`` when wrong (the task's success reward below 1), answer again, up to
    ``env.max_steps`` answers. The reward components are those of the last answer times ``discount ** retries``:
    right at once scores more than right on a retry."""

    counters = ("retries",)

    def __init__(self, feedback: str = "Wrong, try again.", discount: float = 0.5):
        if isinstance(discount, bool) or not isinstance(discount, (int, float)) or not 0 <= discount <= 1:
            raise ConfigError(f"env.turn_env.discount={discount!r}: must be a number in [0, 1]")
        self.feedback, self.discount = str(feedback), float(discount)

    def step(self, task, row, conversation) -> Reply:
        if task.score(conversation[-1]["content"], row)[task.success_reward] >= 1:
            return Reply(done=True)
        return Reply([{"role": "user", "content": self.feedback}], counts={"retries": 1})

    def score(self, task, row, conversation, turns) -> dict[str, float]:
        scale = self.discount ** (turns - 1)
        return {name: scale * value for name, value in task.score(conversation[-1]["content"], row).items()}


@dataclass(frozen=True)
class Turns:
    """How an episode of a task goes (``env.max_steps``, ``env.turn_env``, ``env.transforms``): the engine turns
    it may take, what answers between them, and the user's TorchRL transforms (their configs, built anew for each
    episode's environment). One turn and no transforms is a single-turn episode, played without an environment."""

    max_turns: int = 1
    env: TurnEnv | None = None
    transforms: tuple[Mapping[str, Any], ...] = ()

    @property
    def single(self) -> bool:
        return self.max_turns == 1 and not self.transforms


def build_turn_env(env_cfg, transforms: bool = False) -> TurnEnv | None:
    """``env.turn_env`` built (``{_target_: import.path, **kwargs}``; null: none), checked against
    ``env.max_steps`` (``transforms``: env.transforms are set, which may answer instead): one-line ConfigErrors
    name the key."""
    spec, max_steps = env_cfg.get("turn_env"), int(env_cfg.get("max_steps") or 1)
    if spec is None:
        if max_steps > 1 and not transforms:
            raise ConfigError(f"env.max_steps={max_steps} without env.turn_env: nothing answers between turns; set "
                              "env.turn_env (e.g. {_target_: torchrl_grpo.episodes.turn_envs.PythonTool}) "
                              "or env.max_steps=1")
        return None
    if max_steps < 2:
        raise ConfigError("env.turn_env is set with env.max_steps=1: the environment never gets a turn; set "
                          "env.max_steps to the engine turns an episode may take (e.g. 3), or env.turn_env=null")
    cls = import_target(spec, "env.turn_env", "environment's class", "torchrl_grpo.episodes.turn_envs.PythonTool")
    target = spec["_target_"]
    if not (isinstance(cls, type) and issubclass(cls, TurnEnv)):
        raise ConfigError(f"env.turn_env._target_={target}: not a subclass of torchrl_grpo.episodes.turn_envs.TurnEnv")
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"env.turn_env: {target}({', '.join(kwargs)}) {err}; check its keys") from None
