"""What optimizer steps without signal cost: a run's time per step, its training time, and the share of its
updates that had no signal (every advantage 0: `still_updates`, or `grad_norm` 0 where a commit predates it).
Run it at two commits to see the gain of not taking them.

    .venv/bin/python bench/still_steps.py                       # the comparison workload, 20 steps
    .venv/bin/python bench/still_steps.py inference_model.max_tokens=128
"""
import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from step_breakdown import GSM8K_DATA, run  # noqa: E402  (the comparison workload's run)


def summary(rows: list[dict]) -> dict[str, float]:
    """Means over every step but the first (the engine's warm-up)."""
    rows = rows[1:]
    still = [r["still_updates"] if "still_updates" in r else float(r["grad_norm"] == 0) for r in rows]
    return {"steps": len(rows), "still updates per step": statistics.mean(still),
            "train_time s": statistics.mean(r["train_time"] for r in rows),
            "step_time s": statistics.mean(r["step_time"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-still-steps")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the run")
    opts = parser.parse_args()
    rows = run([f"env.data_path={GSM8K_DATA}", *opts.overrides], opts.steps, opts.out)
    for key, value in summary(rows).items():
        print(f"{key:28s} {value:.3f}")


if __name__ == "__main__":
    main()
