"""The turn environment of ``env=openenv`` (:mod:`torchrl_grpo.tasks.openenv`): between the model's turns, the
OpenEnv server's reply to the last one, in the episode's own session."""
from __future__ import annotations

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.episodes.turn_envs import Reply, TurnEnv


def _turns(conversation: list[dict]) -> tuple[str, ...]:
    return tuple(m["content"] for m in conversation if m["role"] == "assistant")


class OpenEnvTurns(TurnEnv):
    """Each turn is a step of the episode's session; the observation's text is the ``role`` message that follows,
    and the server's done ends the episode. The reward is the episode's return (``env_reward``)."""

    counters = ("env_errors",)

    def __init__(self, role: str = "user"):
        self.role = str(role)

    @staticmethod
    def _server(task):
        server = getattr(task, "server", None)
        if server is None:
            raise ConfigError("env.turn_env: OpenEnvTurns plays episodes of env.dataset=openenv only")
        return server

    def step(self, task, row, conversation) -> Reply:
        server, turns = self._server(task), _turns(conversation)
        reply = server.turn(int(row["seed"]), turns[:-1], turns[-1])
        if reply is None:
            return Reply(done=True, counts={"env_errors": int(server.failed(int(row["seed"]), turns))})
        return Reply([{"role": self.role, "content": reply}])

    def score(self, task, row, conversation, turns) -> dict[str, float]:
        """The task's rewards of the last turn, with the episode's ``turns`` in the row: ``env_reward`` is then the
        episode's return (:func:`torchrl_grpo.tasks.openenv.env_reward`)."""
        return task.score(conversation[-1]["content"], {**row, "turns": _turns(conversation)})
