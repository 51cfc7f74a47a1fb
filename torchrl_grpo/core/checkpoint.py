"""Atomic checkpoints and resume.

A checkpoint is a directory ``step_<N>/`` holding the policy in HF format (``save_pretrained``: full
weights, or only the adapter for LoRA), an actor-critic run's value model in ``critic/``, the tokenizer, and
``trainer_state.pt`` (optimizer, step, RNG states, data position, config), which holds tensors and plain containers
only: it is read with ``torch.load(weights_only=True)``, and a state file that needs more (any other pickled object, as
those of checkpoints written before this rule held numpy's RNG key array) counts as damaged. It is written under a
temporary name and renamed into place, so a run killed at any moment leaves either the complete checkpoint
or none: every ``step_*`` directory is complete by construction.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from torchrl_grpo.core.errors import ConfigError, one_line
from torchrl_grpo.core.files import not_written, remove_tree, tree_bytes

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.pt"
OPTIMIZER_SHARDS = "optimizer_shards"  # a data-parallel run's optimizer state, each rank its shards
CRITIC_DIR = "critic"  # an actor-critic run's value model (HF format), and its optimizer shards data-parallel


class Key:
    """The keys of ``trainer_state.pt``, written and read through these names only."""

    STEP = "step"  # the last finished step
    OPTIMIZER = "optimizer"  # the policy's optimizer state (None data-parallel: its shards are files)
    WORLD_SIZE = "world_size"  # data-parallel ranks that wrote it (absent: one process)
    SCHEDULER = "scheduler"  # the learning-rate schedule
    SHUFFLE_RNG = "shuffle_rng"  # the micro-batch shuffle's generator
    CRITIC_OPTIMIZER = "critic_optimizer"
    CRITIC_SCHEDULER = "critic_scheduler"
    SAMPLER = "sampler"  # the data position (a prompt sampler's, or the async loop's progress)
    RNG = "rng"  # the global python, numpy and torch RNG states
    ENGINE_RNG = "engine_rng"  # the engine's sampling state (None: nothing samples exactly)
    CONFIG = "config"  # the run's config, secrets masked


def rng_state() -> dict:
    """The global RNGs' states in types ``torch.load(weights_only=True)`` reads back: numpy's key array as a
    list of ints (an ndarray would need the pickle of arbitrary objects)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (name, keys.tolist(), pos, has_gauss, gauss)}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save(directory: Path, step: int, model, tokenizer, state: dict, keep: int = 2, weights_bytes: int = 0) -> Path:
    """Write checkpoint ``step`` atomically into ``directory`` and keep only the newest ``keep``. ``model`` is
    anything with HF's ``save_pretrained`` (a run's trainer state: it gathers a sharded policy). A write that fails
    (a full disk, a read-only or vanished folder) leaves no partial checkpoint and every earlier one intact, and raises
    a one-line RunError naming the folder, the space left and about how much a checkpoint takes (the newest
    one's size, else ``weights_bytes`` and the tensors of ``state``)."""
    final = directory / f"step_{step:06d}"
    tmp = directory / f".tmp_step_{step:06d}_{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
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
    except Exception as err:
        if not _is_write_error(err):
            raise
        written = tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # never a partial checkpoint (resume skips .tmp_ folders anyway)
        earlier = list_checkpoints(directory)  # the same model and optimizer: about the newest one's size
        needed = tree_bytes(earlier[-1]) if earlier else max(written, weights_bytes + _tensor_bytes(state))
        raise not_written(final, err, needed) from None
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        # out of the step_* names first: a kill during the delete leaves a .tmp_ folder resume skips
        remove_tree(old, f".tmp_{old.name}_removed_{os.getpid()}")
    return final


def _tensor_bytes(obj) -> int:
    """The bytes of the tensors in ``obj`` (nested dicts, lists and tuples: an optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _is_write_error(err: Exception) -> bool:
    """An OSError, or what a library makes of one: torch's file writer raises a RuntimeError ("file write
    failed", "unexpected pos"), safetensors a SafetensorError wrapping the OS's IoError."""
    text = str(err).lower()
    return isinstance(err, OSError) or any(k in text for k in (
        "write failed", "unexpected pos", "ioerror", "no space", "file too large", "read-only", "errno"))


def find_resume_point(resume, run_checkpoints: Path) -> Path | None:
    """The checkpoint to resume from. ``auto`` takes the newest of this run's checkpoint directory that loads
    (none: a fresh start), and so does a run or checkpoints directory given as the path, skipping damaged
    ones with a warning that names them; a path to one checkpoint that does not load is a one-line error."""
    if resume in (None, False, ""):
        return None
    if resume == "auto":
        return _newest_loadable(run_checkpoints)
    path = Path(str(resume)).expanduser()
    if (path / STATE_FILE).exists():
        reason = damage(path)
        if reason:
            raise ConfigError(f"train.resume={resume}: that checkpoint does not load ({reason}); give another one, or "
                              "the run directory to take its newest checkpoint that loads")
        return path
    for candidate in (path, path / "checkpoints"):
        if list_checkpoints(candidate):
            found = _newest_loadable(candidate)
            if found is None:
                raise ConfigError(f"train.resume={resume}: none of its checkpoints loads (see the warnings above)")
            return found
    raise ConfigError(f"train.resume={resume}: no checkpoint there (expected a step_* directory holding "
                      f"{STATE_FILE}, or a run directory with checkpoints/)")


def _newest_loadable(directory: Path) -> Path | None:
    for candidate in reversed(list_checkpoints(directory)):
        reason = damage(candidate)
        if reason is None:
            return candidate
        print(f"warning: skipping checkpoint {candidate}: it does not load ({reason})", file=sys.stderr, flush=True)
    return None


def damage(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` would not load, in a few words; None when its state, weights and configs read back.
    Cheap: the state file's archive and the weights' headers and sizes are read, not their tensors (the
    optimizer state alone is twice the model: the resume reads it once, later)."""
    try:
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        return f"{STATE_FILE}: {one_line(err)}"
    if state.get(Key.WORLD_SIZE, 1) > 1 and not (checkpoint / OPTIMIZER_SHARDS / ".metadata").is_file():
        return f"{OPTIMIZER_SHARDS}/.metadata is missing"
    broken = weights_damage(checkpoint)
    if broken:
        return broken
    for name in ("config.json", "adapter_config.json"):
        if (checkpoint / name).exists():
            try:
                json.loads((checkpoint / name).read_text())
            except (ValueError, OSError) as err:
                return f"{name}: {one_line(err)}"
    return None


def weights_damage(directory: Path) -> str | None:
    """Why the ``*.safetensors`` weights of ``directory`` would not load (none, a header or size that does not
    read back), in a few words; None when they do. Reads headers and sizes, not the tensors."""
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors weights"
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    f.get_slice(name)
        except Exception as err:
            return f"{file.name}: {one_line(err)}"
    return None


def load_state(checkpoint: Path) -> dict:
    """The state file, read as tensors and plain containers only (``weights_only``: a file cannot run code)."""
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)


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
