"""Tasks: datasets and their reward functions, the task an ``env`` section asks for (:func:`build_task`), the
registry of task builders (``env.dataset``, entry points, ``env._target_``) with their typed settings, reward
models and LLM judges. Imports core."""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torchrl_grpo.core.errors import ConfigError, import_target, one_line

# the built-in tasks: importing each module registers its builder (@register_task)
from torchrl_grpo.tasks import (  # noqa: F401
    arithmetic,
    competition_math,
    gsm8k,
    ifeval,
    openenv,
    prompts,
    reasoning_gym_tasks,
    verifiers_tasks,
)
from torchrl_grpo.tasks.base import Reward, RewardFn, Task, per_task_means
from torchrl_grpo.tasks.judge import judge_entry
from torchrl_grpo.tasks.registry import TASK_BUILDERS, chosen_builder, register_task, setting, task_settings
from torchrl_grpo.tasks.reward_model import reward_model_entry

DEFAULT_DATASET = "openai/gsm8k"
# reward callables handed over as Python objects (the Python API's reward_funcs), by their env.rewards _target_
REGISTERED_REWARDS: dict[str, RewardFn] = {}


def build_task(env_cfg: Any) -> Task:
    """The Task ``env_cfg`` asks for (an omegaconf DictConfig or a plain dict): its builder's (``env.dataset``,
    default openai/gsm8k, or ``env._target_``: :mod:`torchrl_grpo.tasks.registry`) from its settings, with the
    rewards and prompt keys every task shares. Its episodes' turns are
    :func:`torchrl_grpo.episodes.setup.build_episode_task`'s."""
    env_cfg = {} if env_cfg is None else env_cfg
    label, builder = chosen_builder(env_cfg, DEFAULT_DATASET)
    task = builder(task_settings(env_cfg, label, builder.task_settings)).set_weights(env_cfg.get("reward_weights"))
    task = add_custom_rewards(task, env_cfg.get("rewards") or [])
    add_scorers(task, env_cfg)
    if not task.rewards:
        raise ConfigError(f"env.rewards: {label} has no reward of its own; list yours, e.g. "
                          "env.rewards=[{_target_: mypkg.rewards.reward_len}] (docs/tasks.md)")
    task.reward_errors = env_cfg.get("reward_errors") or "raise"
    template_kwargs = env_cfg.get("chat_template_kwargs") or {}
    if not hasattr(template_kwargs, "items"):
        raise ConfigError(f"env.chat_template_kwargs={template_kwargs!r}: give a mapping, e.g. "
                          "'{enable_thinking: false}'")
    task.chat_template_kwargs = dict(template_kwargs)
    task.examples = worked_examples(env_cfg.get("examples"))
    return task


def check_env(env: Mapping[str, Any], shared: Collection[str]) -> None:
    """Every key of ``env`` and of ``env.eval``: one its task's settings declare, of its type, one every task reads,
    or one of ``shared`` (what the rest of the run reads); else a one-line ConfigError naming it. Nothing is
    loaded: the entry points call it before any heavy work."""
    own = {key: value for key, value in env.items() if key != "eval"}
    label, builder = chosen_builder(own, DEFAULT_DATASET)
    task_settings(own, label, builder.task_settings, shared)
    overrides = env.get("eval") or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"env.eval={overrides!r}: give the env keys of the evaluation split, e.g. {{split: test}}")
    if overrides:
        label, builder = chosen_builder({**own, **overrides}, DEFAULT_DATASET)
        task_settings(overrides, label, builder.task_settings, shared, prefix="env.eval")


EXAMPLE_ROLES = ("user", "assistant", "tool")


def worked_examples(spec: Any) -> list[dict[str, str]]:
    """``env.examples`` checked: chat messages ``{role, content}`` shown before every question (few-shot), which
    begin with a user turn and end with an assistant turn, as a conversation before the question would."""
    if not spec:
        return []
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__iter__"):
        raise ConfigError(f"env.examples={spec!r}: give a list of chat messages, e.g. "
                          "'[{role: user, content: \"2+2?\"}, {role: assistant, content: \"#### 4\"}]'")
    examples = []
    for i, message in enumerate(spec):
        role = message.get("role") if hasattr(message, "get") else None
        content = message.get("content") if hasattr(message, "get") else None
        if role not in EXAMPLE_ROLES or not isinstance(content, str) or set(message) != {"role", "content"}:
            raise ConfigError(f"env.examples[{i}]={message!r}: give {{role: user | assistant | tool, content: <text>}}")
        examples.append({"role": role, "content": content})
    if examples[0]["role"] != "user" or examples[-1]["role"] != "assistant":
        raise ConfigError("env.examples: begin with a user turn and end with the assistant's answer, as a "
                          f"conversation before the question would (they run {examples[0]['role']} .. "
                          f"{examples[-1]['role']})")
    return examples


def register_reward(fn: RewardFn) -> dict:
    """An ``env.rewards`` entry for a callable: its import path as ``_target_`` (which this process resolves to
    ``fn`` itself, and other processes import), its name (a lambda's is ``reward_<n>``)."""
    if not callable(fn):
        raise ConfigError(f"reward_funcs: {fn!r} is not callable; give functions")
    name = getattr(fn, "__name__", type(fn).__name__)
    target = f"{getattr(fn, '__module__', None) or '__main__'}.{getattr(fn, '__qualname__', name)}"
    base, n = target, 2
    while REGISTERED_REWARDS.get(target, fn) is not fn:  # two lambdas, or two functions of one name
        target, n = f"{base}_{n}", n + 1
    REGISTERED_REWARDS[target] = fn
    return {"_target_": target, "name": f"reward_{len(REGISTERED_REWARDS)}" if name == "<lambda>" else name}


def add_scorers(task: Task, env_cfg: Any) -> Task:
    """Append the reward model (``env.reward_model``) and the LLM judge (``env.judge``) the config asks for."""
    for key in ("reward_model", "judge"):
        spec = env_cfg.get(key)
        if not spec:
            continue
        spec = dict(spec.items()) if hasattr(spec, "items") else spec
        entry = reward_model_entry(spec) if key == "reward_model" else judge_entry(spec, task.rows.column_names)
        if entry["name"] in task.reward_names:
            raise ConfigError(f"env.{key}.name={entry['name']!r}: the task already has a reward of that name; give "
                              "another name")
        task.add_reward(entry["name"], entry["fn"], entry["weight"])
    return task


def add_custom_rewards(task: Task, entries) -> Task:
    """Append the rewards of ``env.rewards``: each entry names a function, ``fn(completion, row) -> float`` or
    TRL's ``fn(completions, **kwargs) -> list`` (:mod:`torchrl_grpo.tasks.scoring`), by its import path
    (``_target_``; or one :func:`register_reward` made), with a ``weight`` (default 1) and a ``name`` (default: the
    function's), e.g. ``{_target_: my_rewards.length, weight: 0.5}``. A class, or a target given more keys, is
    called with those keys to make the reward (``{_target_: torchrl_grpo.tasks.openr1.CosineScaled, max_len:
    500}``). Each is logged apart."""
    for i, entry in enumerate(entries):
        key = f"env.rewards[{i}]"
        target = entry.get("_target_") if hasattr(entry, "get") else None
        fn = REGISTERED_REWARDS.get(target) if isinstance(target, str) else None
        if fn is None and isinstance(target, str) and (target.startswith("__main__.") or "<" in target):
            raise ConfigError(f"{key}._target_={target}: a function of the script or notebook that started the run "
                              "(train(reward_funcs=...)) cannot be imported by the processes it starts (Ray actors, "
                              "data-parallel ranks); define it in a module on PYTHONPATH")
        fn = fn or import_target(entry, key, "reward function", "mypkg.rewards.length")
        arguments = {k: v for k, v in entry.items() if k not in ("_target_", "weight", "name")}
        if arguments or isinstance(fn, type):  # a factory or class with its arguments: what it makes is the reward
            try:
                fn = fn(**arguments)
            except Exception as err:
                raise ConfigError(f"{key}: {target}({', '.join(arguments)}) raised {one_line(err)}") from None
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{key}.weight={weight!r}: must be a number")
        name = entry.get("name") or target.rsplit(".", 1)[-1]
        if name in task.reward_names:
            raise ConfigError(f"{key}.name={name!r}: the task already has a reward of that name; give another name")
        task.add_reward(name, fn, float(weight))
    return task


__all__ = ["REGISTERED_REWARDS", "Reward", "RewardFn", "Task", "TASK_BUILDERS", "add_custom_rewards", "build_task",
           "check_env", "per_task_means", "register_reward", "register_task", "setting"]
