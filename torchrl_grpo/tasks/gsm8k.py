"""GSM8K (and its offline stand-in, reasoning-gym's ``gsm_symbolic``): loading, answer parsing and rewards.

Rewards (each in [0, 1], logged apart):

* ``accuracy``: the last number of the completion equals the gold answer (after normalisation), whatever
  the format;
* ``answer_format``: the completion holds ``#### <number>`` somewhere;
* ``think_format`` (only with ``env.reasoning=true``): exactly one ``<think>...</think>`` block with some
  text in it, and a ``#### <number>`` answer after ``</think>``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks.base import Reward, Task
from torchrl_grpo.tasks.registry import register_task, setting
from torchrl_grpo.tasks.sources import load_rows

HUB_DATASET = "openai/gsm8k"
GSM8K_NAMES = (HUB_DATASET, "gsm8k")
GSM_SYMBOLIC = "gsm_symbolic"
HUB_SPLITS = ("train", "test")

SYSTEM_PROMPT = "Do not explain. Reply with only the final answer in the form: #### <number>"
REASONING_SYSTEM_PROMPT = (
    "First think through the problem step by step inside <think></think> tags. "
    "After </think>, reply with only the final answer in the form: #### <number>"
)
DEFAULT_WEIGHTS = {"accuracy": 1.0, "answer_format": 0.5, "think_format": 0.5}

# A number: optional sign (not when glued to a word/number, so "10-20" is 10 and 20, not 10 and -20),
# optional "$", then either digits grouped by thousands commas ("1,234,567" but not "1,23" nor "3, 4"), or
# plain digits, with an optional decimal part; or a bare decimal part (".5"). A "." not followed by a digit
# ends the number, so the full stop of "is 42." is not part of it.
_NUMBER = (
    r"(?:(?<![\w.])[-\u2212])?\$?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)\.\d+)"
)
NUMBER_RE = re.compile(_NUMBER)
ANSWER_RE = re.compile(r"####[ \t]*(" + _NUMBER + r")")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def normalize_number(text: str) -> str:
    """Canonical string of one number: ``"1,234"``-> ``"1234"``, ``"$5"``-> ``"5"``, ``"3.50"``-> ``"3.5"``,
    ``"7.0"``-> ``"7"``, ``".5"``-> ``"0.5"``, ``"-0"``-> ``"0"``. Equal values give equal strings."""
    s = text.strip().replace("\u2212", "-").replace(",", "").replace("$", "")
    negative = s.startswith("-")
    s = s.lstrip("+-")
    whole, _, frac = s.partition(".")
    if not (whole + frac).isdigit():
        raise ValueError(f"not a number: {text!r}")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = whole + ("." + frac if frac else "")
    return "-" + out if negative and out != "0" else out


def extract_last_number(text: str) -> str | None:
    """The last number in ``text``, normalised (see :func:`normalize_number`); None when there is none."""
    last = None
    for last in NUMBER_RE.finditer(text):
        pass
    return None if last is None else normalize_number(last.group(0))


def gold_answer(answer_field: str) -> str:
    """The normalised number after the last ``####`` of a GSM8K answer; a field without ``####`` (a bare
    answer such as ``"42"``) gives its last number. Raises ValueError when there is no number."""
    text = str(answer_field)
    head, sep, tail = text.rpartition("####")
    if sep:
        m = re.match(r"\s*(" + _NUMBER + ")", tail)
        if m:
            return normalize_number(m.group(1))
        found = extract_last_number(tail)
    else:
        found = extract_last_number(text)
    if found is None:
        raise ValueError(f"no number in the answer {text[-80:]!r}")
    return found


# ----------------------------------------------------------------------------------------------- rewards
def accuracy(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 iff the completion's last number equals the row's gold answer, whatever the format."""
    pred = extract_last_number(completion)
    return float(pred is not None and pred == gold_answer(row["answer"]))


def answer_format(completion: str, row: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the completion contains ``####`` followed (optional spaces) by a number."""
    return float(ANSWER_RE.search(completion) is not None)


def think_format(completion: str, row: Mapping[str, Any] | None = None) -> float:
    """1.0 iff the completion has exactly one ``<think>...</think>`` block, with text in it, and a
    ``#### <number>`` answer after ``</think>``."""
    if completion.count(_THINK_OPEN) != 1 or completion.count(_THINK_CLOSE) != 1:
        return 0.0
    start = completion.index(_THINK_OPEN) + len(_THINK_OPEN)
    end = completion.find(_THINK_CLOSE, start)
    if end < 0 or not completion[start:end].strip():
        return 0.0
    return float(ANSWER_RE.search(completion, end + len(_THINK_CLOSE)) is not None)


# ----------------------------------------------------------------------------------------------- loading
def _prepare(raw: datasets.Dataset, where: str) -> datasets.Dataset:
    """Check the columns and replace ``answer`` by the normalised gold number."""
    missing = [c for c in ("question", "answer") if c not in raw.column_names]
    if missing:
        raise ConfigError(f"{where}: rows lack the column(s) {missing}; GSM8K rows need 'question' and 'answer'")
    golds = []
    for i, ans in enumerate(raw["answer"]):
        try:
            golds.append(gold_answer(ans))
        except ValueError:
            raise ConfigError(f"{where}: row {i} has no number in its answer ({str(ans)[-60:]!r})") from None
    return raw.remove_columns("answer").add_column("answer", golds)


def load_gsm8k(dataset: str = HUB_DATASET, data_path: str | Path | None = None,
               split: str = "train") -> datasets.Dataset:
    """GSM8K rows ``{"question", "answer"}`` with ``answer`` the normalised gold number.

    ``data_path``: a folder holding ``train.jsonl``/``test.jsonl`` (or the hub layout ``main/train-*.parquet``)
    or a single .jsonl/.parquet file (then ``split`` is not used). Without it, ``dataset`` is loaded from the
    Hugging Face hub (config ``main``); an unreachable/offline hub raises ConfigError.
    """
    raw, where = load_rows(
        dataset, data_path, split,
        folder_patterns=[("json", f"{split}.jsonl"), ("json", f"{split}.json"), ("parquet", f"main/{split}-*.parquet"),
                         ("parquet", f"{split}-*.parquet"), ("parquet", f"{split}.parquet")],
        expected=f"a folder holding {split}.jsonl (or the hub layout main/{split}-*.parquet; env.split={split}) "
                 f"or one .jsonl/.parquet file",
        hub_splits=HUB_SPLITS, hub_config="main",
        offline_hint=f"set env.data_path=<folder with {split}.jsonl, or a .jsonl/.parquet file> "
                     f"or use env=gsm_symbolic, which works offline",
    )
    return _prepare(raw, where)


def load_gsm_symbolic(size: int = 2000, seed: int = 0) -> datasets.Dataset:
    """``size`` GSM-style rows generated offline by reasoning-gym's ``gsm_symbolic`` (about 25 us a row)."""
    import reasoning_gym

    gen = reasoning_gym.create_dataset(GSM_SYMBOLIC, size=size, seed=seed)
    questions, answers = [], []
    for i in range(size):
        item = gen[i]
        questions.append(item["question"])
        answers.append(gold_answer(item["answer"]))
    return datasets.Dataset.from_dict({"question": questions, "answer": answers})


# ------------------------------------------------------------------------------------------------- task
@dataclass(frozen=True)
class GSM8KSettings:
    """The ``env`` keys of GSM8K and gsm_symbolic."""

    dataset: str = setting(HUB_DATASET, "openai/gsm8k (gsm8k) | gsm_symbolic (generated offline)")
    data_path: str | Path | None = setting(None, "GSM8K from a local folder or file instead of the hub")
    split: str = setting("train", "GSM8K's train | test")
    reasoning: bool = setting(False, "ask for <think>...</think> before the answer, and reward it")
    system_prompt: str | None = setting(None, "the system prompt; null = the task's own, '' = none")
    size: int = setting(2000, "gsm_symbolic's problems generated")
    seed: int = setting(0, "gsm_symbolic's generation seed")


def gsm8k_rewards(reasoning: bool) -> list[Reward]:
    rewards = [
        Reward("accuracy", accuracy, DEFAULT_WEIGHTS["accuracy"]),
        Reward("answer_format", answer_format, DEFAULT_WEIGHTS["answer_format"]),
    ]
    if reasoning:
        rewards.append(Reward("think_format", think_format, DEFAULT_WEIGHTS["think_format"]))
    return rewards


@register_task(*GSM8K_NAMES, GSM_SYMBOLIC, settings=GSM8KSettings)
def build_gsm8k_task(s: GSM8KSettings) -> Task:
    """The GSM8K task; see :func:`torchrl_grpo.tasks.build_task`."""
    if s.dataset == GSM_SYMBOLIC:
        if s.size <= 0:
            raise ConfigError(f"env.size={s.size!r}: must be a positive integer")
        rows = load_gsm_symbolic(size=s.size, seed=s.seed)
        name = GSM_SYMBOLIC
    else:
        rows = load_gsm8k(HUB_DATASET, s.data_path, s.split)
        name = "gsm8k"
    system_prompt = s.system_prompt
    if system_prompt is None:
        system_prompt = REASONING_SYSTEM_PROMPT if s.reasoning else SYSTEM_PROMPT
    return Task(name=name, rows=rows, system_prompt=system_prompt or None, rewards=gsm8k_rewards(s.reasoning),
                success="accuracy")
