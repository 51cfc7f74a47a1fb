"""grpo.py with SIGTERM sent to itself at a chosen point of a chosen step, as a scheduler's preemption lands:
``python trainer_faults.py POINT STEP <grpo.py arguments>``. POINT is ``optimizer_step`` (the gradient computed, the
optimizer step not yet taken: the call that clips the gradient, once per update) or ``checkpoint_write`` (the
checkpoint's files written under their temporary name, not yet fsynced and renamed into place). The production code
carries no test flag: the points are patched here, before grpo.py runs."""
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def signal_at(owner, name: str, nth: int) -> None:
    """``owner.name`` sends SIGTERM to this process at its ``nth`` call, then does what it does."""
    real, calls = getattr(owner, name), [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    setattr(owner, name, patched)


def main() -> None:
    point, step = sys.argv[1], int(sys.argv[2])
    if point == "optimizer_step":
        import torch

        signal_at(torch.nn.utils, "clip_grad_norm_", step)  # one update per step in the test's runs
    elif point == "checkpoint_write":
        from torchrl_grpo.core import checkpoint

        signal_at(checkpoint, "_fsync_tree", step)  # a checkpoint after every step in the test's runs
    else:
        raise SystemExit(f"unknown point {point!r}")
    sys.argv = [str(ROOT / "grpo.py"), *sys.argv[3:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
