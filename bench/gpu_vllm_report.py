"""The result lines of bench/gpu_vllm_check.sh, read from a run's metrics.csv (Markdown on stdout; exit 1 when a
check fails). Not a test.

    python bench/gpu_vllm_report.py learning RUN_DIR   # 20 steps of the digit-share task, resumed at step 10
    python bench/gpu_vllm_report.py speed RUN_DIR      # the loop's speed, steps after the first
"""
import csv
import statistics
import sys
from pathlib import Path


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.csv"
    return [r for r in csv.DictReader(path.open())] if path.exists() else []


def values(table: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in table if r.get(key) not in (None, "", "nan")]


def gaps(table: list[dict]) -> str:
    sync, sampled = values(table, "weight_sync_gap"), values(table, "engine_trainer_logp_gap_max")
    line = (f"weight sync gap after {len(sync)} pushes: mean {statistics.mean(sync):.4f}, max {max(sync):.4f}"
            if sync else "weight sync gap: not logged")
    return line + (f"; sampling vs trainer log-prob gap, largest token: {max(sampled):.3f}" if sampled else "")


def learning(table: list[dict]) -> bool:
    steps = sorted(int(r["step"]) for r in table)
    if steps[-10:] != list(range(11, 21)):
        print(f"- resume: steps logged {steps}, not 11-20 after the step-10 checkpoint")
        return False
    digits = values(table, "reward/digits")
    first, last = statistics.mean(digits[:5]), statistics.mean(digits[-5:])
    learns = last > first + 0.1
    print(f"- learning: digit share {first:.3f} over the first 5 steps, {last:.3f} over the last 5: "
          f"{'learns' if learns else 'DOES NOT LEARN'}; steps 11-20 resumed from the step-10 checkpoint")
    print(f"- {gaps(table)}")
    memory = {key: max(values(table, key), default=float('nan'))
              for key in ("memory/train/peak_gib", "memory/ref/allocated_gib", "memory/inference/used_gib")}
    print("- GPU memory (GiB, largest): " + ", ".join(f"{k.split('/')[1]} {v:.2f}" for k, v in memory.items()))
    return learns


def speed(table: list[dict]) -> bool:
    timed = table[1:] or table
    if not timed:
        print("- no step logged")
        return False

    def median(key):
        found = values(timed, key)
        return statistics.median(found) if found else float("nan")

    step, gen, train = median("step_time"), median("generation_time"), median("train_time")
    print(f"- {len(table)} steps; medians of steps 2-{len(table)}: step {step:.1f} s, generation {gen:.1f} s "
          f"({median('generation_tokens_per_s'):.0f} tokens/s), training {train:.1f} s "
          f"({median('train_tokens_per_s'):.0f} tokens/s, MFU {100 * median('mfu'):.1f}%), "
          f"outside both {100 * (1 - (gen + train) / step):.0f}% of the step "
          f"(push {median('weight_push_time'):.2f} s, sync check {median('weight_check_time'):.2f} s)")
    print(f"- completion length {median('completion_length'):.0f}; {gaps(table)}")
    print(f"- GPU memory (GiB, largest): train peak {max(values(table, 'memory/train/peak_gib'), default=0):.1f}, "
          f"inference {max(values(table, 'memory/inference/used_gib'), default=0):.1f}")
    return True


def main() -> int:
    check, run_dir = sys.argv[1], Path(sys.argv[2])
    table = rows(run_dir)
    if not table:
        print(f"- {run_dir}/metrics.csv: missing or empty")
        return 1
    return 0 if {"learning": learning, "speed": speed}[check](table) else 1


if __name__ == "__main__":
    sys.exit(main())
