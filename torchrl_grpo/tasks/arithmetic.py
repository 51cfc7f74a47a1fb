"""Easy arithmetic (``env=arithmetic``): reasoning-gym's generated problems with a numeric answer, checked as
GSM8K is (the last number of the completion, whatever the format, see :mod:`torchrl_grpo.tasks.gsm8k`).

Why it exists: it is the task where SmolLM2-135M-Instruct starts above the floor, so a CPU run shows its
accuracy rise and not only its answer format (docs/see-it-learn.md). Measured here on 200 held-out
problems: single-digit products 0.64 greedy / 0.21 sampled at temperature 1; single-digit sums and
differences 0.39 / 0.14; GSM8K-style word problems (``gsm_symbolic``) 0.00 / 0.004.

``env.tasks`` lists reasoning-gym dataset names or ``{name: products, max_digits: 1, ...}`` entries (as
``env=reasoning_gym`` does; any dataset whose answer is a number), pooled task by task; rewards are
``accuracy`` and ``answer_format`` (``#### <number>``), logged per task too.

Held out for real: single-digit problems are few (100 products, 199 sums and differences), so another
generation seed alone would evaluate on problems the policy trained on. Each distinct question belongs to one
split by a hash of its text (``env.split``: ``train``, or ``test`` for a quarter of them), and each split
holds each of its questions once.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import datasets

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks.base import Task
from torchrl_grpo.tasks.gsm8k import SYSTEM_PROMPT, gold_answer, gsm8k_rewards
from torchrl_grpo.tasks.reasoning_gym_tasks import generate, interleaved
from torchrl_grpo.tasks.registry import register_task, setting

SPLITS = ("train", "test")
TEST_SHARE = 4  # one question in 4 is a test question


def split_of(question: str) -> str:
    """The split a question belongs to, the same on every machine and run (a CRC of its text)."""
    return "test" if zlib.crc32(question.encode()) % TEST_SHARE == 0 else "train"


@dataclass(frozen=True)
class ArithmeticSettings:
    """The ``env`` keys of the arithmetic task."""

    tasks: list | None = setting(None, "reasoning-gym datasets with a numeric answer, by name or {name, its "
                                 "config keys}")
    size: int = setting(1000, "problems generated per task")
    seed: int = setting(0, "the generation seed")
    split: str = setting("train", "train | test (a question's split is fixed by its text)")
    system_prompt: str | None = setting(None, "the system prompt; null = GSM8K's, '' = none")


@register_task("arithmetic", settings=ArithmeticSettings)
def build_arithmetic_task(s: ArithmeticSettings) -> Task:
    """The arithmetic task."""
    specs = list(s.tasks or [])
    if not specs:
        raise ConfigError("env.tasks is empty: list reasoning-gym datasets with a numeric answer, e.g. "
                          "env.tasks='[{name: products, min_digits: 1, max_digits: 1}]'")
    if s.split not in SPLITS:
        raise ConfigError(f"env.split={s.split!r}: choose train or test")
    generated = generate(specs, s.size, s.seed)
    questions, answers, names, seen = [], [], [], set()
    for name, _, entry in interleaved(generated):
        question = entry["question"]
        if split_of(question) != s.split or question in seen:
            continue
        seen.add(question)
        try:
            answers.append(gold_answer(str(entry["answer"])))
        except ValueError:
            raise ConfigError(f"env.tasks: {name} answers {entry['answer']!r}, not a number; "
                              "list it under env=reasoning_gym instead") from None
        questions.append(question)
        names.append(name)
    if not questions:
        raise ConfigError(f"env.size={s.size}: no {s.split} question among the generated ones; raise env.size")
    rows = datasets.Dataset.from_dict({"question": questions, "answer": answers, "task": names})
    system_prompt = SYSTEM_PROMPT if s.system_prompt is None else s.system_prompt
    return Task(name="arithmetic:" + "+".join(generated), rows=rows, system_prompt=system_prompt or None,
                rewards=gsm8k_rewards(False), success="accuracy")
