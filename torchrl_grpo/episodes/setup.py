"""A task with its episode settings: how many engine turns an episode has (``env.max_steps``), what answers
between them (``env.turn_env``) and the user's TorchRL transforms (``env.transforms``)."""
from __future__ import annotations

from typing import Any

from torchrl_grpo.episodes.task_env import build_transforms
from torchrl_grpo.episodes.turn_envs import build_turn_env
from torchrl_grpo.tasks import Task, build_task


def build_episode_task(env_cfg: Any) -> Task:
    """The task of ``env_cfg`` (:func:`torchrl_grpo.tasks.build_task`) with its episode settings, each checked
    here (a bad transform or turn environment fails in one line, before anything heavy starts)."""
    task = build_task(env_cfg)
    task.transforms = list(env_cfg.get("transforms") or [])
    build_transforms(task.transforms)
    task.turn_env = build_turn_env(env_cfg, bool(task.transforms))
    task.max_turns = int(env_cfg.get("max_steps") or 1)
    return task
