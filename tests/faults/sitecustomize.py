"""Preemption at a chosen point of a run, in whichever of its processes reaches that point first (a rank, a Ray
actor, the trainer): the tests put this folder on ``PYTHONPATH``, so that every Python process the run starts
imports it, and set ``TORCHRL_GRPO_FAULT="POINT NTH SIGNAL"`` and ``TORCHRL_GRPO_FAULT_DIR``. The production code
carries no test flag: the points are patched here, as their modules load.

POINT is where the signal lands, at a process's NTH call of it:

* ``generation``: an engine's ``generate`` (the trainer's, a rank's or a rollout actor's), before it samples; a
  streaming actor's decoding steps (``StreamingEngine.advance``);
* ``optimizer_step``: the gradient computed, the update not yet made (the call that clips the gradient);
* ``checkpoint_write``: a checkpoint's files written under their temporary name, not yet fsynced and renamed.

SIGNAL (``SIGTERM`` or ``SIGKILL``) goes, as a scheduler's preemption does, to every process of the run: those
whose environment holds this ``TORCHRL_GRPO_FAULT_DIR`` (engine processes, ranks, Ray's daemons and actors),
the sender last. Only the first process to reach the point sends it; it writes ``fired`` in the folder first.
"""
import importlib.abc
import os
import signal
import sys

FAULT, FAULT_DIR = os.environ.get("TORCHRL_GRPO_FAULT"), os.environ.get("TORCHRL_GRPO_FAULT_DIR")


def processes_with_env(entry: str) -> list[int]:
    """The live processes whose environment holds ``entry`` (``NAME=value``): those of one run, which its
    processes inherit (orphans included). The tests find a run's processes with it too."""
    mark, found = entry.encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def job_processes(fault_dir) -> list[int]:
    """The live processes of the run preempted through ``fault_dir``."""
    return processes_with_env(f"TORCHRL_GRPO_FAULT_DIR={fault_dir}")


def _fire(sig: signal.Signals) -> None:
    try:
        fd = os.open(os.path.join(FAULT_DIR, "fired"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # another process got there first
    os.write(fd, f"{os.getpid()} {' '.join(sys.argv)}\n".encode())
    os.close(fd)
    for pid in job_processes(FAULT_DIR):
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), sig)


def _at_nth_call(owner, name: str, nth: int, sig: signal.Signals) -> None:
    real, calls = getattr(owner, name), [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            _fire(sig)
        return real(*args, **kwargs)

    setattr(owner, name, patched)


def _patches(point: str, nth: int, sig: signal.Signals) -> dict:
    """module name -> what to patch in it once it has loaded."""
    if point == "generation":
        return {"torchrl_grpo.engines.hf": lambda m: _at_nth_call(m.TransformersEngine, "generate", nth, sig),
                "torchrl_grpo.engines.vllm": lambda m: _at_nth_call(m.VLLMEngine, "generate", nth, sig),
                "torchrl_grpo.engines.streaming": lambda m: _at_nth_call(m.StreamingEngine, "advance", nth, sig)}
    if point == "optimizer_step":
        return {"torch.nn.utils": lambda m: _at_nth_call(m, "clip_grad_norm_", nth, sig)}
    if point == "checkpoint_write":
        return {"torchrl_grpo.core.checkpoint": lambda m: _at_nth_call(m, "_fsync_tree", nth, sig)}
    raise SystemExit(f"TORCHRL_GRPO_FAULT: unknown point {point!r}")


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader another finder returns for a patched module."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Patching(spec.loader, self.patches.pop(name))
                return spec
        return None


class _Patching(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


if FAULT and FAULT_DIR:
    _point, _nth, _sig = FAULT.split()
    sys.meta_path.insert(0, _PatchOnLoad(_patches(_point, int(_nth), signal.Signals[_sig])))
