"""MATH (Hendrycks et al., competition problems; ``env=math``): loading and the answer check.

Rows: ``question`` (the problem), ``answer`` (the gold final answer: the dataset's ``answer`` column where it
has one, as MATH-500 does, else the last ``\\boxed{...}`` of its ``solution``) and ``task`` (the subject, so
that metrics are also logged per subject as ``task/<subject>/<component>``).

Rewards (each in [0, 1], logged apart):

* ``accuracy``: the last ``\\boxed{...}`` of the completion is the gold answer, by math-verify
  (:mod:`torchrl_grpo.tasks.symbolic`: symbolic equivalence, ``\\sqrt{8}`` = ``2\\sqrt{2}``, sets, intervals,
  units); where math-verify parses either side to nothing, by the fallback: equal after :func:`normalize_answer`
  (which removes what does not change a value: spacing commands, ``\\left``/``\\right``, ``\\dfrac`` for
  ``\\frac``, degrees, dollars, percent signs, a trailing unit in ``\\text{ ...}``, a leading ``x =``), or both
  plain numbers of the same value (``0.5``, ``\\frac{1}{2}``, ``1/2``, ``1{,}000``);
* ``answer_format``: the completion has a ``\\boxed{...}``;
* ``math_verify`` (weight 0, logged): 1 where math-verify decided the accuracy, 0 where the fallback did, not
  applicable (null) without an answer: its mean is the share math-verify decided.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import datasets

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks.base import Reward, Task
from torchrl_grpo.tasks.registry import register_task, setting
from torchrl_grpo.tasks.sources import load_rows
from torchrl_grpo.tasks.symbolic import math_verify_equal, require_math_verify

HUB_DATASET = "DigitalLearningGmbH/MATH-lighteval"  # the 12,500 problems, train/test, with subject and level
HUB_SPLITS = ("train", "test")
MATH_500 = "HuggingFaceH4/MATH-500"  # its test subset
SYSTEM_PROMPT = "Solve the problem step by step. Put the final answer in \\boxed{}."
DEFAULT_WEIGHTS = {"accuracy": 1.0, "answer_format": 0.2, "math_verify": 0.0}

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_SPACING = re.compile(r"\\[,!;: ]|\\quad|\\qquad")
_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{\s[^{}]*\}$")  # a trailing "\text{ cm}": a unit, not the value
_TEXT = re.compile(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}")
_LHS = re.compile(r"^[a-zA-Z]\w*=")  # "x=5" -> "5"
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3})((?:,\d{3})+)(?![\d])")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")  # \frac12
_FRAC_HALF = re.compile(r"\\frac\{([^{}]*)\}(\d)")  # \frac{1}2
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")  # \sqrt2
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces balanced; ``\\boxed 5``
    gives ``5``; None when there is none or its braces never close."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    at = starts[-1]
    if at >= len(text):
        return None
    if text[at] != "{":
        bare = re.match(r"[^\s$]+", text[at:])
        return bare.group(0) if bare else None
    depth = 0
    for i in range(at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[at + 1: i]
    return None


def normalize_answer(answer: str) -> str:
    """A canonical string of a final answer (see the module docstring for what is removed)."""
    s = answer.strip()
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING.sub("", s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("{,}", ",").rstrip().rstrip(".")
    s = _UNIT.sub("", s)
    s = _TEXT.sub(r"\1", s)
    s = "".join(s.split())
    s = s.rstrip(".")
    s = _LHS.sub("", s) if s.count("=") == 1 else s
    s = _THOUSANDS.sub(lambda m: m.group(1) + m.group(2).replace(",", ""), s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    return s


def numeric_value(normalized: str) -> Fraction | None:
    """The exact value of a plain number: ``-3``, ``0.25``, ``\\frac{1}{4}``, ``-\\frac{1}{4}``, ``1/4``; None for
    anything else."""
    sign, body = (-1, normalized[1:]) if normalized.startswith("-") else (1, normalized)
    frac = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", body) or re.fullmatch(r"(-?\d+)/(-?\d+)", body)
    try:
        if frac:
            return sign * Fraction(int(frac.group(1)), int(frac.group(2)))
        if _NUMBER.fullmatch(body):
            return sign * Fraction(body)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def equivalent(predicted: str, gold: str) -> bool:
    """The two answers are the same after :func:`normalize_answer`, or the same number."""
    a, b = normalize_answer(predicted), normalize_answer(gold)
    if a == b:
        return True
    x, y = numeric_value(a), numeric_value(b)
    return x is not None and x == y


# ----------------------------------------------------------------------------------------------- rewards
def accuracy(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 iff the completion's last ``\\boxed{}`` is the row's gold answer (math-verify, else the fallback)."""
    predicted = last_boxed(completion)
    if predicted is None:
        return 0.0
    verdict = math_verify_equal(predicted, str(row["answer"]))
    return float(equivalent(predicted, str(row["answer"])) if verdict is None else verdict)


def decided_by_math_verify(completion: str, row: Mapping[str, Any]) -> float | None:
    """1.0 where math-verify decided the accuracy, 0.0 where the fallback did, None without an answer."""
    predicted = last_boxed(completion)
    if predicted is None:
        return None
    return float(math_verify_equal(predicted, str(row["answer"])) is not None)


def answer_format(completion: str, row: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the completion has a ``\\boxed{...}`` whose braces close."""
    return float(last_boxed(completion) is not None)


# ----------------------------------------------------------------------------------------------- loading
def _prepare(raw: datasets.Dataset, where: str) -> datasets.Dataset:
    """Rows ``{question, answer, task, level}`` from MATH's columns (``problem``; ``answer`` or ``solution``;
    ``type`` or ``subject``; ``level``)."""
    columns = set(raw.column_names)
    if "problem" not in columns or not columns & {"answer", "solution"}:
        raise ConfigError(f"{where}: MATH rows need a 'problem' column and an 'answer' or 'solution' column "
                          f"(these have {sorted(columns)})")
    answers = []
    for i, row in enumerate(raw):
        gold = row.get("answer") if "answer" in columns else last_boxed(str(row["solution"]))
        if gold is None or not str(gold).strip():
            raise ConfigError(f"{where}: row {i} has no final answer (no \\boxed{{}} in its solution)")
        answers.append(str(gold))
    subject = "type" if "type" in columns else "subject" if "subject" in columns else None
    return datasets.Dataset.from_dict({
        "question": list(raw["problem"]),
        "answer": answers,
        "task": list(raw[subject]) if subject else ["math"] * len(raw),
        "level": [str(v) for v in raw["level"]] if "level" in columns else [""] * len(raw),
    })


def load_math(dataset: str = HUB_DATASET, data_path: str | None = None, split: str = "train") -> datasets.Dataset:
    """MATH rows from ``data_path`` (a folder with ``<split>.jsonl`` or the hub's parquet layout, or one
    .jsonl/.parquet file) or from the hub (``dataset``, default the full MATH)."""
    raw, where = load_rows(
        dataset, data_path, split,
        folder_patterns=[("json", f"{split}.jsonl"), ("json", f"{split}.json"), ("parquet", f"data/{split}-*.parquet"),
                         ("parquet", f"{split}-*.parquet"), ("parquet", f"{split}.parquet")],
        expected=f"a folder holding {split}.jsonl (env.split={split}) or one .jsonl/.parquet file with 'problem' "
                 "and 'solution' (or 'answer') columns",
        hub_splits=HUB_SPLITS if dataset == HUB_DATASET else (split,),
        offline_hint=f"set env.data_path=<folder with {split}.jsonl, or a .jsonl/.parquet file>",
    )
    return _prepare(raw, where)


@dataclass(frozen=True)
class MathSettings:
    """The ``env`` keys of the MATH task."""

    dataset: str = setting(HUB_DATASET, "math (= the hub's MATH-lighteval) | a hub id of MATH's rows")
    data_path: str | Path | None = setting(None, "a local folder or file instead of the hub")
    split: str = setting("train", "train | test")
    system_prompt: str | None = setting(None, "the system prompt; null = one asking for \\boxed{}, '' = none")


@register_task("math", HUB_DATASET, MATH_500, settings=MathSettings)
def build_math_task(s: MathSettings) -> Task:
    """The MATH task."""
    require_math_verify(f"env.dataset={s.dataset}")
    rows = load_math(HUB_DATASET if s.dataset == "math" else s.dataset, s.data_path, s.split)
    system_prompt = SYSTEM_PROMPT if s.system_prompt is None else s.system_prompt
    rewards = [Reward("accuracy", accuracy, DEFAULT_WEIGHTS["accuracy"]),
               Reward("answer_format", answer_format, DEFAULT_WEIGHTS["answer_format"]),
               Reward("math_verify", decided_by_math_verify, DEFAULT_WEIGHTS["math_verify"])]
    return Task(name="math", rows=rows, system_prompt=system_prompt or None, rewards=rewards, success="accuracy")
