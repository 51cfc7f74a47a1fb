"""The turn environment of ``env=verifiers`` (:mod:`torchrl_grpo.tasks.verifiers_tasks`): between the model's
turns, the results of the tool calls it wrote, run by the task's own tool servers."""
from __future__ import annotations

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.episodes.turn_envs import Reply, TurnEnv


class VerifiersTools(TurnEnv):
    """A turn with ``<tool_call>`` blocks gets one ``tool`` message per call; a turn without one is the answer
    and ends the episode. The reward components are the task's scoring of the whole conversation."""

    counters = ("tool_calls", "tool_errors")

    @staticmethod
    def _env(task):
        env = getattr(task, "env", None)
        if env is None or not hasattr(env, "call_tools"):
            raise ConfigError("env.turn_env: VerifiersTools plays episodes of env.dataset=verifiers only")
        return env

    def step(self, task, row, conversation) -> Reply:
        results = self._env(task).call_tools(int(row["vf_index"]), conversation[-1]["content"])
        if not results:
            return Reply(done=True)
        return Reply([{"role": "tool", "content": r.content} for r in results],
                     counts={"tool_calls": len(results), "tool_errors": sum(r.error for r in results)})

    def score(self, task, row, conversation, turns) -> dict[str, float]:
        self._env(task)
        return task.score(conversation[-1]["content"], {**row, "conversation": conversation})
