"""reasoning-gym tasks (``env=reasoning_gym``): one or several of its procedural datasets, scored by their own
``score_answer``, generated offline.

``env.tasks`` lists dataset names (``[syllogism, maze]``) or entries ``{name: maze, size: 200, <any of the
dataset's config keys>}``; each task gets ``env.size`` rows (or its own ``size``) generated with ``env.seed``,
and the rows of all tasks are pooled, interleaved task by task (the prompt sampler shuffles them for training;
evaluation takes the first ``eval.num_prompts``, which then cover every task). Rows are ``{question, answer, task,
index}``: ``task``/``index`` find the generated entry again, which the task's scorer needs (some scorers read
its metadata), so rows written out (``evaluate.py``'s responses) are scored against the very entry.

Rewards (logged apart, and per task as ``task/<name>/<component>``):

* ``accuracy``: the dataset's ``score_answer`` on the text of the last ``<answer>...</answer>`` block (0 when
  there is none); most scorers give 1 or 0, a few give partial credit;
* ``answer_format``: 1 when the completion has an ``<answer>...</answer>`` block.

Held-out evaluation (RL-for-Real's ``multi_tasks`` setup: train on several tasks, test on those plus one more)
is ``env.eval.tasks``: the evaluation split is built from the same keys with ``env.eval`` merged over them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import datasets

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks.base import Reward, Task
from torchrl_grpo.tasks.registry import register_task, setting

DATASET = "reasoning_gym"
DEFAULT_WEIGHTS = {"accuracy": 1.0, "answer_format": 0.5}


def _entry_spec(entry: Any, i: int, size: int) -> tuple[str, dict]:
    """(name, create_dataset kwargs without seed) of one ``env.tasks`` entry."""
    key = f"env.tasks[{i}]"
    if isinstance(entry, str):
        return entry, {"size": size}
    if not hasattr(entry, "items") or not isinstance(entry.get("name"), str):
        raise ConfigError(f"{key}={entry!r}: give a reasoning-gym dataset name, or {{name: <dataset>, size: N, ...}}")
    kwargs = {k: v for k, v in entry.items() if k != "name"}
    kwargs.setdefault("size", size)
    return entry["name"], kwargs


@dataclass(frozen=True)
class Generated:
    """One reasoning-gym dataset's generated entries (``question``, ``answer``, ``metadata``) and its scorer."""

    entries: list[dict]
    score_answer: Callable[[str | None, dict], float]


def generate(specs: list, size: Any, seed: Any) -> dict[str, Generated]:
    """Task name -> its generated entries and scorer; ``size`` (``env.size``, rows per task unless an entry
    gives its own) and ``seed`` (``env.seed``) checked first."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"env.size={size!r}: must be a positive integer (rows per task)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"env.seed={seed!r}: must be an integer")
    out: dict[str, Generated] = {}
    for i, entry in enumerate(specs):
        name, kwargs = _entry_spec(entry, i, size)
        if name not in DATASETS:
            close = [n for n in sorted(DATASETS) if name[:4] in n][:5]
            raise ConfigError(f"env.tasks[{i}]={name!r}: not a reasoning-gym dataset"
                              + (f" (close: {', '.join(close)})" if close else "")
                              + "; reasoning_gym.factory.DATASETS lists them all")
        if name in out:
            raise ConfigError(f"env.tasks[{i}]={name!r}: listed twice; give it once (with a larger size)")
        try:
            gen = reasoning_gym.create_dataset(name, seed=seed, **kwargs)
        except (TypeError, ValueError, AssertionError) as err:
            raise ConfigError(f"env.tasks[{i}] ({name}): reasoning-gym refused its config ({err})") from None
        out[name] = Generated([gen[j] for j in range(len(gen))], gen.score_answer)
    return out


def interleaved(generated: dict[str, Generated]) -> Iterator[tuple[str, int, dict]]:
    """``(task, index, entry)`` round-robin over the tasks, so that any first N rows (evaluation's
    ``eval.num_prompts``) cover every task."""
    longest = max(len(g.entries) for g in generated.values())
    for j in range(longest):
        for name, g in generated.items():
            if j < len(g.entries):
                yield name, j, g.entries[j]


def answer_text(completion: str) -> str | None:
    """The text of the completion's last ``<answer>...</answer>`` block (reasoning-gym's convention)."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion)


def answer_format(completion: str, row: Mapping[str, Any] | None = None) -> float:
    return float(answer_text(completion) is not None)


def make_accuracy(generated: dict[str, Generated]) -> Callable[[str, Mapping[str, Any]], float]:
    """``accuracy(completion, row)``: the scorer of ``row["task"]`` against the generated entry of the row."""

    def accuracy(completion: str, row: Mapping[str, Any]) -> float:
        task, index = row.get("task"), row.get("index")
        if task not in generated or not isinstance(index, int) or not 0 <= index < len(generated[task].entries):
            raise ConfigError(f"row {str(row.get('question'))[:60]!r}: task={task!r} index={index!r} is not one of "
                              "this run's reasoning-gym rows; score it with the env.tasks, env.size and env.seed "
                              "that generated it")
        entry = generated[task].entries[index]
        if entry["question"] != row.get("question"):
            raise ConfigError(f"row {task}[{index}]: its question differs from the one reasoning-gym generates here; "
                              "score it with the env.tasks, env.size and env.seed that generated it")
        return float(generated[task].score_answer(answer_text(completion), entry))

    return accuracy


@dataclass(frozen=True)
class ReasoningGymSettings:
    """The ``env`` keys of the reasoning-gym task."""

    tasks: list | None = setting(None, "reasoning-gym datasets, by name or {name: maze, size: 100, ...}")
    size: int = setting(200, "rows generated per task (unless an entry gives its own)")
    seed: int = setting(0, "the generation seed")
    system_prompt: str | None = setting(None, "the system prompt; null = reasoning-gym's default, '' = none")


@register_task(DATASET, settings=ReasoningGymSettings)
def build_reasoning_gym_task(s: ReasoningGymSettings) -> Task:
    """The reasoning-gym task."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    specs = list(s.tasks or [])
    if not specs:
        raise ConfigError("env.tasks is empty: list reasoning-gym datasets, e.g. env.tasks='[syllogism,maze]'")
    generated = generate(specs, s.size, s.seed)
    pooled = list(interleaved(generated))
    rows = datasets.Dataset.from_dict({
        "question": [e["question"] for _, _, e in pooled],
        "answer": [str(e["answer"]) for _, _, e in pooled],
        "task": [name for name, _, _ in pooled],
        "index": [j for _, j, _ in pooled],
    })
    system_prompt = SYSTEM_PROMPTS["default"] if s.system_prompt is None else s.system_prompt
    rewards = [Reward("accuracy", make_accuracy(generated), DEFAULT_WEIGHTS["accuracy"]),
               Reward("answer_format", answer_format, DEFAULT_WEIGHTS["answer_format"])]
    return Task(name="reasoning_gym:" + "+".join(generated), rows=rows, system_prompt=system_prompt or None,
                rewards=rewards, success="accuracy")
