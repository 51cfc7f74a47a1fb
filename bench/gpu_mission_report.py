"""The result lines of bench/gpu_mission_check.sh, read from each run's metrics.csv (Markdown on stdout). Not a test.

    python bench/gpu_mission_report.py LABEL RUN_DIR [--resumed]
"""
import csv
import statistics
import sys
from pathlib import Path


def table(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


def values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "", "nan")]


def median(rows: list[dict], key: str) -> str:
    found = values(rows, key)
    return f"{statistics.median(found):.3g}" if found else "-"


def report(label: str, run_dir: Path) -> str:
    rows = table(run_dir)
    if not rows:
        return f"- {label}: no step logged (see its log)"
    evals = [r for r in rows if r.get("eval/accuracy") not in (None, "")]
    curve = " / ".join(f"{float(r['eval/accuracy']):.3f}@{r['step']}" for r in evals) or "not evaluated"
    formats = [k for k in rows[0] if k.startswith("eval/") and "format" in k]
    fmt = f"; held-out {formats[0].removeprefix('eval/')} at the last evaluation " \
          f"{float(evals[-1][formats[0]]):.2f}" if formats and evals and evals[-1].get(formats[0]) else ""
    train_format = values(rows, "reward/answer_format")
    trained = (f"; training answer format, first / last 10 steps: {statistics.mean(train_format[:10]):.2f} / "
               f"{statistics.mean(train_format[-10:]):.2f}") if train_format else ""
    timed = rows[1:] or rows
    sync = values(rows, "weight_sync_gap")
    gap = f"; weight sync gap over {len(sync)} pushes: max {max(sync):.4f}" if sync else ""
    stale = values(rows, "staleness_max")
    staleness = f"; staleness max {max(stale):g}" if stale else ""
    return (f"- {label}: {len(rows)} steps (last {rows[-1]['step']}); held-out greedy accuracy {curve}{fmt}{trained}; "
            f"medians after the first step: step {median(timed, 'step_time')} s, weight push "
            f"{median(timed, 'weight_push_time')} s{gap}{staleness}")


if __name__ == "__main__":
    print(report(sys.argv[1], Path(sys.argv[2])))
