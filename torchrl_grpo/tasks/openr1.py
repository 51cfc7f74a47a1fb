"""Open-R1's reward functions (huggingface/open-r1, ``src/open_r1/rewards.py``), by their definitions there, in
TRL's signature: list them under ``env.rewards`` by import path, e.g. ``{_target_: torchrl_grpo.tasks.openr1.
accuracy}``; the ones with parameters are classes (``{_target_: torchrl_grpo.tasks.openr1.CosineScaled,
max_len: 1000}``). ``--config-name grpo_openr1`` is its GRPO recipe (docs/tasks.md maps each setting).

Completions may be text or chat messages (Open-R1 reads ``completion[0]["content"]``). Where we deviate:

* math-verify runs with its timeouts on a main thread (:mod:`torchrl_grpo.tasks.symbolic`); off it, in a helper
  process. Open-R1 calls it wherever the trainer runs, where off the main thread its signal timeouts raise.
* A gold solution math-verify cannot parse makes ``accuracy`` (and the length rewards' correctness) ``None``, "not
  applicable", which leaves it out of the total; Open-R1 gives 1.0 ("to skip this example"), which pays every
  completion of that prompt alike: no advantage either way, but a reward curve that rises on unparsable gold.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from torchrl_grpo.tasks.symbolic import TIMEOUT_S, on_a_main_thread

SYSTEM_PROMPT = ("You are a helpful AI Assistant that provides well-reasoned and detailed responses. You first "
                 "think about the reasoning process as an internal monologue and then provide the user with the "
                 "answer. Respond in the following format: <think>\n...\n</think>\n<answer>\n...\n</answer>")
_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
_STEPS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def _verdict(content: str, solution: str, boxed: str | bool) -> bool | None:
    """Open-R1's check: the gold's first LaTeX answer against the completion's (boxed first, no bare text); None
    where the gold does not parse."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(solution, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()],
                 parsing_timeout=TIMEOUT_S)
    if not gold:
        return None
    normalization = NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True, equations=True,
                                        boxed=boxed, units=True)
    answer = parse(content, extraction_mode="first_match", parsing_timeout=TIMEOUT_S, extraction_config=[
        LatexExtractionConfig(normalization_config=normalization, boxed_match_priority=0,
                              try_extract_without_anchor=False)])
    try:
        return bool(verify(gold, answer, timeout_seconds=TIMEOUT_S))
    except Exception:  # Open-R1: a verify that fails scores 0
        return False


def _correct(completions: Sequence[Any], solution: Sequence[str], boxed: str | bool) -> list[bool | None]:
    return [on_a_main_thread(_verdict, _text(c), str(s), boxed) for c, s in zip(completions, solution)]


def accuracy(completions, solution, **kwargs) -> list[float | None]:
    """1 where the completion's answer is the gold ``solution``'s by math-verify, else 0; None for gold it cannot
    parse (Open-R1: 1.0, see the module docstring)."""
    return [None if ok is None else float(ok) for ok in _correct(completions, solution, boxed="all")]


def format(completions, **kwargs) -> list[float]:  # noqa: A001 (Open-R1's name for it)
    """1 where the whole completion is ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``."""
    return [1.0 if _FORMAT.match(_text(c)) else 0.0 for c in completions]


def tag_count(completions, **kwargs) -> list[float]:
    """0.25 for each of the four tags of :func:`format` present exactly once, with its newlines."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if _text(c).count(tag) == 1) for c in completions]


def reasoning_steps(completions, **kwargs) -> list[float]:
    """``min(1, markers / 3)``, markers being "Step n:", numbered lines, bullets and First/Second/Next/Finally."""
    return [min(1.0, len(_STEPS.findall(_text(c))) / 3) for c in completions]


def length(completions, solution, **kwargs) -> list[float]:
    """Kimi 1.5's length reward over the batch: ``lam = 0.5 - (len - min) / (max - min)`` in characters; ``lam``
    for a right answer, ``min(0, lam)`` for a wrong one; all 0 when every length is the same."""
    lengths = [len(_text(c)) for c in completions]
    low, high = min(lengths), max(lengths)
    if high == low:
        return [0.0] * len(completions)
    right = [ok is None or ok for ok in _correct(completions, solution, boxed=True)]  # unparsable gold: right
    return [lam if ok else min(0.0, lam) for ok, lam in
            zip(right, (0.5 - (n - low) / (high - low) for n in lengths))]


class CosineScaled:
    """Length-scaled correctness: along a cosine from ``max_value_*`` at length 0 to ``min_value_*`` at
    ``max_len`` characters, right answers get [min_value_correct, max_value_correct] (shorter: more), wrong
    ones [min_value_wrong, max_value_wrong] (shorter: more negative)."""

    def __init__(self, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5, min_value_correct: float = 0.5,
                 max_value_correct: float = 1.0, max_len: int = 1000):
        self.wrong, self.right, self.max_len = (max_value_wrong, min_value_wrong), \
            (min_value_correct, max_value_correct), max_len

    def __call__(self, completions, solution, **kwargs) -> list[float | None]:
        out = []
        for c, ok in zip(completions, _correct(completions, solution, boxed=True)):
            if ok is None:
                out.append(None)
                continue
            low, high = self.right if ok else self.wrong
            out.append(low + 0.5 * (high - low) * (1.0 + math.cos(math.pi * len(_text(c)) / self.max_len)))
        return out


class RepetitionPenalty:
    """``max_penalty x (1 - distinct / all)`` over the completion's word ``ngram_size``-grams (lower-cased); 0 for a
    completion shorter than one n-gram."""

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0):
        if max_penalty > 0:
            raise ValueError(f"max_penalty={max_penalty} must not be positive")
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completions, **kwargs) -> list[float]:
        out = []
        for c in completions:
            words = _text(c).lower().split()
            grams = [tuple(words[i:i + self.ngram_size]) for i in range(len(words) - self.ngram_size + 1)]
            out.append((1 - len(set(grams)) / len(grams)) * self.max_penalty if grams else 0.0)
        return out


class SoftOverlong:
    """DAPO's soft overlong punishment on the completion's token count: 0 up to ``max_completion_len -
    soft_punish_cache``, then falling linearly to -1 at ``max_completion_len``, -1 past it."""

    def __init__(self, max_completion_len: int = 1024, soft_punish_cache: int = 256):
        self.max_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, completions, completion_ids, **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= self.max_len - self.cache else
                       (self.max_len - self.cache - n) / self.cache if n <= self.max_len else -1.0)
        return out
