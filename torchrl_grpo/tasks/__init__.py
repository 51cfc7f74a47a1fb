"""Tasks: datasets and their reward functions."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchrl_grpo.errors import ConfigError
from torchrl_grpo.tasks.base import Reward, RewardFn, Task
from torchrl_grpo.tasks.gsm8k import build_gsm8k_task
from torchrl_grpo.tasks.ifeval import build_ifeval_task

# env.dataset -> builder(env_cfg) -> Task. New tasks add themselves with register_task.
TASK_BUILDERS: dict[str, Callable[[Any], Task]] = {
    "openai/gsm8k": build_gsm8k_task,
    "gsm8k": build_gsm8k_task,
    "gsm_symbolic": build_gsm8k_task,
    "google/IFEval": build_ifeval_task,
    "ifeval": build_ifeval_task,
}
DEFAULT_DATASET = "openai/gsm8k"


def register_task(dataset: str, builder: Callable[[Any], Task]) -> None:
    """Make ``env.dataset=<dataset>`` build its Task with ``builder(env_cfg)``."""
    TASK_BUILDERS[dataset] = builder


def build_task(env_cfg: Any) -> Task:
    """The Task named by ``env_cfg.dataset`` (an omegaconf DictConfig or a plain dict; default openai/gsm8k)."""
    dataset = env_cfg.get("dataset") if env_cfg is not None else None
    dataset = DEFAULT_DATASET if dataset is None else dataset
    builder = TASK_BUILDERS.get(dataset) if isinstance(dataset, str) else None
    if builder is None:
        raise ConfigError(f"env.dataset={dataset!r}: choose one of {', '.join(TASK_BUILDERS)}")
    return builder(env_cfg)


__all__ = ["Reward", "RewardFn", "Task", "TASK_BUILDERS", "build_task", "register_task"]
