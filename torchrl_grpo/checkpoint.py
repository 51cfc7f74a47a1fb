"""Atomic checkpoints and resume.

A checkpoint is a directory ``step_<N>/`` holding the policy in HF format (``save_pretrained``: full
weights, or only the adapter for LoRA), the tokenizer, and ``trainer_state.pt`` (optimizer, step, RNG
states, data position, config). It is written under a temporary name and renamed into place, so a
run killed at any moment leaves either the complete checkpoint or none: every ``step_*`` directory is
complete by construction.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from torchrl_grpo.errors import ConfigError

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.pt"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save(directory: Path, step: int, model, tokenizer, state: dict, keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically into ``directory`` and keep only the newest ``keep``."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{step:06d}"
    tmp = directory / f".tmp_step_{step:06d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_resume_point(resume, run_checkpoints: Path) -> Path | None:
    """The checkpoint to resume from: ``auto`` takes the newest in this run's checkpoint directory (none:
    a fresh start); a path may be a checkpoint or a run/checkpoints directory holding some."""
    if resume in (None, False, ""):
        return None
    if resume == "auto":
        found = list_checkpoints(run_checkpoints)
        return found[-1] if found else None
    path = Path(str(resume)).expanduser()
    if (path / STATE_FILE).is_file():
        return path
    for candidate in (path, path / "checkpoints"):
        found = list_checkpoints(candidate)
        if found:
            return found[-1]
    raise ConfigError(f"train.resume={resume}: no checkpoint there (expected a step_* directory holding {STATE_FILE}, or a run directory with checkpoints/)")


def load_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
