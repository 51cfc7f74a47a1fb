"""An OpenEnv environment as a task (``env=openenv``): episodes played against an OpenEnv server (Meta's
``openenv-core``: Gymnasium-style reset/step over a WebSocket, one session per episode).

A row is a reset seed; its prompt is the text the server's ``reset(seed=...)`` observation carries in
``env.observation_field`` (read once per seed when the task is built, so the ``G`` episodes of a group share it,
and a server that is not there fails in one line before anything heavy starts). Each model turn goes to the
episode's session as the action ``{env.action_field: text}``; the observation's text comes back as the next user
message (:class:`torchrl_grpo.episodes.openenv_turns.OpenEnvTurns`) until the server says done or the episode
reaches ``env.max_steps`` turns. The reward, ``env_reward``, is the episode's return: the sum of its steps'
rewards. With ``env.max_steps=1`` and no turn environment each completion is one step of a fresh session.

Sessions are found by the episode's seed and the turns played so far: two episodes with the same seed and turns
hold sessions in the same state (the server is deterministic for a seed), so either serves. A reset or step
that fails, times out (``env.timeout_s``) or loses its connection ends its episode; its reward is then the
error, handled as ``env.reward_errors`` says (stop the run, or score 0 and count it).
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import datasets

from torchrl_grpo.core.background_loop import BackgroundLoop
from torchrl_grpo.core.errors import ConfigError, one_line
from torchrl_grpo.tasks.base import Reward, Task
from torchrl_grpo.tasks.registry import register_task, setting

REWARD = "env_reward"


class ServerError(Exception):
    """A reset or step that failed, timed out or lost its connection."""


@dataclass
class _Session:
    client: Any
    returns: float = 0.0


class OpenEnvServer:
    """Sessions with one OpenEnv server, callable from any thread: the WebSocket clients live on one event loop
    of their own, in a daemon thread."""

    def __init__(self, url: str, action_field: str, observation_field: str, timeout_s: float,
                 reset_kwargs: Mapping[str, Any] | None = None):
        from openenv.core import GenericEnvClient

        self.client_cls, self.url, self.action_field = GenericEnvClient, url, action_field
        self.observation_field, self.timeout_s, self.reset_kwargs = (observation_field, timeout_s,
                                                                     dict(reset_kwargs or {}))
        self.loop = BackgroundLoop("openenv")
        self.lock = threading.Lock()
        self.idle: dict[tuple, list[_Session]] = {}  # (seed, turns so far) -> sessions waiting for the next turn
        self.ended: dict[tuple, list[float | ServerError]] = {}  # (seed, turns) -> returns of episodes that ended

    def _call(self, coroutine, what: str):
        try:
            return self.loop.run(coroutine, self.timeout_s)
        except TimeoutError:
            raise ServerError(f"OpenEnv server {self.url}: {what} timed out after {self.timeout_s:g} s "
                              "(env.timeout_s)") from None
        except Exception as err:
            raise ServerError(f"OpenEnv server {self.url}: {what} failed ({one_line(err)})") from None

    def _text(self, observation: Mapping[str, Any]) -> str:
        if self.observation_field not in observation:
            raise ServerError(f"OpenEnv server {self.url}: its observation has no field {self.observation_field!r} "
                              f"(env.observation_field); it has {', '.join(observation) or 'none'}")
        return str(observation[self.observation_field])

    def _open(self, seed: int) -> tuple[_Session, Mapping[str, Any]]:
        client = self.client_cls(base_url=self.url, connect_timeout_s=self.timeout_s,
                                 message_timeout_s=self.timeout_s)
        session = _Session(client)
        try:
            self._call(client.connect(), "connecting")
            result = self._call(client.reset(seed=seed, **self.reset_kwargs), f"reset(seed={seed})")
            return session, result.observation
        except BaseException:
            self._close(session)
            raise

    def _close(self, session: _Session) -> None:
        try:
            self._call(session.client.close(), "closing a session")
        except ServerError:
            pass  # a session that went away is closed

    def opening(self, seed: int) -> str:
        """The prompt of ``seed``'s episodes: the text of a reset's observation."""
        session, observation = self._open(seed)
        self._close(session)
        if self.observation_field not in observation:
            raise ConfigError(f"env.observation_field={self.observation_field}: the reset's observation has no such "
                              f"field; it has {', '.join(observation) or 'none'}")
        return str(observation[self.observation_field])

    def turn(self, seed: int, earlier: tuple[str, ...], text: str) -> str | None:
        """Play ``text`` in an episode of ``seed`` that played ``earlier`` turns: the server's reply, or None where
        the episode ended (its return, or the error that ended it, is kept for :meth:`episode_return`)."""
        played = (seed, *earlier, text)
        session = self._take(self.idle, (seed, *earlier))
        try:
            if session is None:
                if earlier:
                    raise ServerError(f"OpenEnv server {self.url}: no session holds this episode")
                session, _ = self._open(seed)
            result = self._call(session.client.step({self.action_field: text}), "step")
            session.returns += float(result.reward or 0.0)
            reply = None if result.done else self._text(result.observation)
        except ServerError as err:
            if session is not None:
                self._close(session)
            self._keep(self.ended, played, err)
            return None
        if reply is None:
            self._close(session)
            self._keep(self.ended, played, session.returns)
        else:
            self._keep(self.idle, played, session)
        return reply

    def failed(self, seed: int, turns: tuple[str, ...]) -> bool:
        """Whether an episode of ``seed`` that played ``turns`` was ended by an error (see :meth:`turn`)."""
        with self.lock:
            return isinstance((self.ended.get((seed, *turns)) or [None])[-1], ServerError)

    def _keep(self, table: dict, key: tuple, value) -> None:
        with self.lock:
            table.setdefault(key, []).append(value)

    def _take(self, table: dict, key: tuple):
        """One of ``table[key]``, or None; a key left with none goes (a long run's episodes leave nothing)."""
        with self.lock:
            kept = table.get(key)
            if not kept:
                return None
            value = kept.pop()
            if not kept:
                del table[key]
            return value

    def episode_return(self, seed: int, turns: tuple[str, ...]) -> float:
        """The return of an episode of ``seed`` that played ``turns``, the last one played now unless the server
        already ended the episode on it; its session closes. Raises the :class:`ServerError` that ended it."""
        played = (seed, *turns)
        result = self._take(self.ended, played)
        if result is None:
            if self.turn(seed, turns[:-1], turns[-1]) is not None:  # the server wanted more: the episode is over
                session = self._take(self.idle, played)
                self._close(session)
                return session.returns
            result = self._take(self.ended, played)
        if isinstance(result, ServerError):
            raise result
        return result


@dataclass
class OpenEnvTask(Task):
    """Rows are reset seeds (``seed``) with the opening's text as their ``question``; see the module's docstring."""

    server: OpenEnvServer | None = None


def _episode_reward(server: OpenEnvServer):
    def env_reward(completion: str, row: Mapping[str, Any]) -> float:
        """The episode's return: the model's ``turns`` are in the row where the turn environment scores an episode
        (:class:`torchrl_grpo.episodes.openenv_turns.OpenEnvTurns`), else the completion is the only one."""
        return server.episode_return(int(row["seed"]), tuple(row.get("turns") or (completion,)))
    return env_reward


@dataclass(frozen=True)
class OpenEnvSettings:
    """The ``env`` keys of an OpenEnv environment."""

    url: str | None = setting(None, "the server's address, e.g. http://localhost:8000")
    action_field: str = setting("message", "the action's field that carries the model's turn")
    observation_field: str = setting("prompt", "the observation's field the model reads")
    reset: dict | None = setting(None, "keyword arguments of every reset, beside its seed")
    first_seed: int = setting(0, "the prompts are the openings of seeds first_seed to first_seed + size - 1")
    size: int = setting(64, "how many seeds' openings are the prompts (from first_seed)")
    timeout_s: float = setting(30, "seconds per connection, reset and step")
    system_prompt: str | None = setting(None, "the system prompt; null = none")


@register_task("openenv", settings=OpenEnvSettings)
def build_openenv_task(s: OpenEnvSettings) -> Task:
    """The OpenEnv task."""
    import importlib.util

    if importlib.util.find_spec("openenv") is None:
        raise ConfigError("env.dataset=openenv: the OpenEnv client (openenv-core) is not installed; "
                          "pip install -e \".[openenv]\" (beside vLLM 0.33, whose pillow pin its web UI's gradio "
                          "refuses: pip install --no-deps openenv-core==0.3.0 && pip install fastmcp websockets)")
    if s.url is None or not s.url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ConfigError(f"env.url={s.url!r}: give the OpenEnv server's address, e.g. http://localhost:8000")
    for key in ("action_field", "observation_field"):
        if not getattr(s, key):
            raise ConfigError(f"env.{key}='': give the field's name")
    for key, value, least in (("size", s.size, 1), ("first_seed", s.first_seed, 0)):
        if value < least:
            raise ConfigError(f"env.{key}={value!r}: must be an integer >= {least}")
    if s.timeout_s <= 0:
        raise ConfigError(f"env.timeout_s={s.timeout_s!r}: must be a number of seconds > 0")
    server = OpenEnvServer(s.url, s.action_field, s.observation_field, float(s.timeout_s), dict(s.reset or {}))
    seeds = list(range(s.first_seed, s.first_seed + s.size))
    try:
        openings = [server.opening(seed) for seed in seeds]
    except ServerError as err:
        raise ConfigError(f"env.url={s.url}: {err}; start the server, or point env.url at it") from None
    rows = datasets.Dataset.from_dict({"seed": seeds, "question": openings, "answer": [""] * s.size})
    return OpenEnvTask(name=f"openenv:{s.url}", rows=rows, system_prompt=s.system_prompt or None,
                       rewards=[Reward(REWARD, _episode_reward(server))], success=REWARD, server=server)
