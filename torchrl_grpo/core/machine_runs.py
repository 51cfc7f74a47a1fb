"""The training runs on this machine, so that a run on the CPU can say at start that another one shares its cores.

Two runs on the CPU cores of one machine stall each other far beyond sharing them evenly: the README's first command
ran 100-172 s a step in each of two copies on 2 cores, against 3.5 s alone (each run's vLLM engine and trainer spin
OpenMP threads on every core). Each run (grpo.py, grpo-async.py, each job of a parallel ``--multirun``) leaves a
file named after its process id in :data:`REGISTRY` while it runs; a run that starts reads the others' (a file whose
process is gone, or whose id another process took since, is dropped) and warns in one line.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchrl_grpo.core.files import write_replacing

REGISTRY = Path(os.environ.get("TORCHRL_GRPO_RUNS") or (
    "/dev/shm/torchrl_grpo_runs" if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir()) / "torchrl_grpo_runs"))


@dataclass(frozen=True)
class MachineRun:
    pid: int
    run_dir: str
    started: str  # the process's start time in clock ticks since boot (/proc/<pid>/stat): tells a reused id apart


def process_start(pid: int) -> str | None:
    """``pid``'s start time as /proc has it, or None when no such process is running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]  # a zombie has ended; field 22 of stat is the start time


def live_runs(registry: Path = REGISTRY) -> list[MachineRun]:
    """The runs whose files are in ``registry`` and whose processes still run; the others' files are removed."""
    runs = []
    for path in sorted(registry.glob("*.json")) if registry.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            run = MachineRun(**json.loads(path.read_text()))
            if process_start(run.pid) == run.started:
                runs.append(run)
                continue
            path.unlink(missing_ok=True)
    return runs


@contextlib.contextmanager
def registered(run_dir: Path, registry: Path = REGISTRY) -> Iterator[list[MachineRun]]:
    """This process listed as a run in ``run_dir`` while the block runs; yields the other runs found at its start.
    A registry that cannot be written (a read-only /dev/shm) leaves the run unlisted, never stopped."""
    others = [r for r in live_runs(registry) if r.pid != os.getpid()]
    path = registry / f"{os.getpid()}.json"
    try:
        registry.mkdir(parents=True, exist_ok=True, mode=0o1777)
        write_replacing(path, json.dumps({"pid": os.getpid(), "run_dir": str(run_dir),
                                          "started": process_start(os.getpid())}))
    except Exception:  # noqa: BLE001 - the warning is a courtesy: a run goes on without it
        path = None
    try:
        yield others
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def sharing_warning(others: list[MachineRun], cores: int) -> str | None:
    """The start-up line of a CPU run that found ``others`` running on this machine's ``cores`` cores."""
    if not others:
        return None
    listed = ", ".join(f"pid {r.pid} in {r.run_dir}" for r in others[:3]) + (" ..." if len(others) > 3 else "")
    return (f"warning: {len(others)} other training run(s) on this machine ({listed}) share its {cores} CPU core(s): "
            "runs on the same cores stall each other (two copies of the README's first command on 2 cores ran 30-50x "
            "slower each than one alone); run them one after the other, or give each its own cores "
            "(taskset -c 0 python grpo.py ..., taskset -c 1 python grpo.py ...)")
