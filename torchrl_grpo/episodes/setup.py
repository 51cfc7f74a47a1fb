"""A task and how its episodes go: how many engine turns an episode has (``env.max_steps``), what answers
between them (``env.turn_env``) and the user's TorchRL transforms (``env.transforms``)."""
from __future__ import annotations

from typing import Any

from torchrl_grpo.episodes.task_env import build_transforms
from torchrl_grpo.episodes.turn_envs import Turns, build_turn_env
from torchrl_grpo.tasks import Task, build_task


def build_episode_task(env_cfg: Any) -> tuple[Task, Turns]:
    """The task of ``env_cfg`` (:func:`torchrl_grpo.tasks.build_task`: its data and rewards) and its episodes'
    :class:`Turns`, each checked here (a bad transform or turn environment fails in one line, before anything
    heavy starts)."""
    task = build_task(env_cfg)
    transforms = tuple(env_cfg.get("transforms") or ())
    build_transforms(transforms)
    turn_env = build_turn_env(env_cfg, bool(transforms))
    return task, Turns(int(env_cfg.get("max_steps") or 1), turn_env, transforms)
