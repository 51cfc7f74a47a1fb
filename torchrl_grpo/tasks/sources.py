"""Where a task's rows come from: a local file or folder (``env.data_path``) or the Hugging Face hub
(``env.dataset``), with one-line errors that name the key. GSM8K and IFEval differ only in the file names
they look for, the hub config and splits, and the hint given when the hub cannot be reached."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import datasets

from torchrl_grpo.core.errors import ConfigError, one_line


def _local_files(path: Path, folder_patterns: Sequence[tuple[str, str]], expected: str) -> tuple[str, list[str]]:
    """(datasets builder, files): ``path`` itself if it is a .jsonl/.json/.parquet/.csv file, else the files of the
    first ``(builder, glob)`` of ``folder_patterns`` that matches in the folder."""
    shown = f"env.data_path={path}"
    if not path.exists():
        raise ConfigError(f"{shown}: no such file or folder ({path.resolve()}); point it at {expected}")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            return "json", [str(path)]
        if suffix in (".parquet", ".csv"):
            return suffix[1:], [str(path)]
        raise ConfigError(f"{shown}: unsupported file type {suffix!r}; use a .jsonl, .parquet or .csv file, or a "
                          "folder")
    for builder, pattern in folder_patterns:
        files = sorted(str(p) for p in path.glob(pattern))
        if files:
            return builder, files
    looked_for = ", ".join(pattern for _, pattern in folder_patterns)
    raise ConfigError(f"{shown}: none of {looked_for} in that folder; point it at {expected}")


def _check_first_lines(where: str, files: list[str]) -> None:
    """An empty file, or a .jsonl whose first line is not a JSON object, named in one line (``datasets`` would
    say only "an error occurred while generating the dataset")."""
    for file in files:
        path = Path(file)
        if path.stat().st_size == 0:
            raise ConfigError(f"{where}: {path} is empty; point it at a file with one row a line")
        if path.suffix.lower() != ".jsonl":
            continue
        try:
            with open(path, encoding="utf-8") as f:
                first = next((line for line in f if line.strip()), "")
            row = json.loads(first) if first else None
        except (UnicodeDecodeError, ValueError) as err:
            raise ConfigError(f"{where}: {path} is not JSON lines ({one_line(err)}); give one JSON object a "
                              "line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: {path} holds no JSON object a line; give one JSON object a line")


def load_rows(dataset: str, data_path: str | Path | None, split: str, *, folder_patterns: Sequence[tuple[str, str]],
              expected: str, hub_splits: Sequence[str], hub_config: str | None = None,
              offline_hint: str) -> tuple[datasets.Dataset, str]:
    """The raw rows and where they came from (``env.data_path=...`` or ``env.dataset=...``, for messages).

    ``data_path`` (a file, or a folder searched with ``folder_patterns``) wins over the hub id ``dataset``;
    ``expected`` says what data_path should point at; ``offline_hint`` what to do when the hub fails.
    """
    if data_path is not None and str(data_path) != "":
        where = f"env.data_path={data_path}"
        builder, files = _local_files(Path(data_path).expanduser(), folder_patterns, expected)
        _check_first_lines(where, files)
        try:
            return datasets.load_dataset(builder, data_files=files, split="train"), where
        except Exception as err:  # malformed JSON, unreadable parquet: the file is at fault, say which
            raise ConfigError(f"{where}: cannot read it ({one_line(err)})") from err
    if split not in hub_splits:
        raise ConfigError(f"env.split={split!r}: {dataset} has the split(s) {', '.join(hub_splits)}")
    try:
        return datasets.load_dataset(dataset, hub_config, split=split), f"env.dataset={dataset}"
    except Exception as err:  # offline, unreachable, unknown id: all mean "this source cannot be used here"
        raise ConfigError(
            f"env.dataset={dataset}: cannot load it from the Hugging Face hub ({one_line(err)}); {offline_hint}"
        ) from err
