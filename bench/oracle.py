"""Fixed-seed runs whose metrics a refactor must leave unchanged. Not a test: run before and after a change.

    .venv/bin/python bench/oracle.py capture outputs/oracle-before          # every case (about 10 min on 2 cores)
    .venv/bin/python bench/oracle.py capture outputs/oracle-after tiny_length async
    .venv/bin/python bench/oracle.py compare outputs/oracle-before outputs/oracle-after

``capture`` runs each case's entry script in a subprocess as a user would and keeps its ``metrics.csv`` (and
``samples.jsonl`` where the run writes one) under ``DIR/<case>/``. ``compare`` holds two captures against each
other column by column and row by row, timing columns aside (``*time*``, ``*_per_s``, memory), and prints
``identical`` or each cell that differs; exit code 1 when any case differs or is missing.
"""
import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "env=gsm_symbolic", "env.size=64", "env.num_envs=2", "env.repeats=4", "train.optim_batch_size=4",
        "inference_model.max_tokens=8", "logging.progress_bar=false", "optimizer.lr=1e-3", "train.seed=3"]

# case -> (script, overrides); "killed_resumed" is run in two parts (see capture_killed)
CASES = {
    "tiny_length": ("grpo.py", [*TINY, "env=length_reward", "train.total_dialog_turns=48"]),
    # not train.sync_iter=false: two runs of one seed part after a few steps (docs/see-it-learn.md)
    "full_feature": ("grpo.py", [
        *TINY, "train.total_dialog_turns=48", "train.kl_to_ref_coeff=0.05", "train.kl_coef_in_loss=false",
        "loss=dapo", "loss.old_log_probs=trainer", "loss.tis_cap=2.0", "train.epochs=2",
        "train.gradient_accumulation_steps=1", "train.optim_batch_size=2",
        "logging.eval_frequency=3", "eval.num_prompts=4", "logging.samples_frequency=1"]),
    "async_ref": ("grpo-async.py", [*TINY, "train.total_dialog_turns=40", "train.kl_to_ref_coeff=0.05",
                                    "logging.samples_frequency=1"]),
    "killed_resumed": ("grpo.py", [*TINY, "train.total_dialog_turns=48", "logging.checkpoint_frequency=1"]),
    "data_parallel": ("grpo.py", [*TINY, "train.total_dialog_turns=32", "train_model.num_devices=2",
                                  "train.strategy=fsdp"]),
    "multi_turn_tool": ("grpo.py", [*TINY, "env=gsm_symbolic_python", "env.size=64", "env.num_envs=2",
                                    "train.total_dialog_turns=32", "inference_model.max_tokens=12",
                                    "logging.samples_frequency=1"]),
    "multi_turn_retry": ("grpo.py", [*TINY, "env=arithmetic_retry", "train.total_dialog_turns=32",
                                     "logging.samples_frequency=1"]),
    "arithmetic_10": ("grpo.py", ["--config-name", "grpo_arithmetic", "train.total_dialog_turns=160",
                                  "logging.eval_frequency=5", "logging.progress_bar=false"]),
}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
KEPT = ("metrics.csv", "samples.jsonl")


def run(script: str, args: list[str], run_dir: Path, log: Path) -> None:
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, str(ROOT / script), *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                              env=ENV, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{script} exited {done.returncode}: see {log}")


def capture_killed(script: str, args: list[str], run_dir: Path, log: Path) -> None:
    """Killed (SIGKILL, its process group) once its second checkpoint is on disk, then resumed to its end."""
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / script), *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                                env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline and not (run_dir / "checkpoints/step_000002").exists():
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    run(script, [*args, "train.resume=auto"], run_dir, log)


def capture(dest: Path, names: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names or CASES:
        script, args = CASES[name]
        run_dir, log = dest / "runs" / name, dest / f"{name}.log"
        shutil.rmtree(run_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
        start = time.time()
        (capture_killed if name == "killed_resumed" else run)(script, args, run_dir, log)
        (dest / name).mkdir(exist_ok=True)
        for file in KEPT:
            if (run_dir / file).exists():
                shutil.copy(run_dir / file, dest / name / file)
        print(f"{name}: {time.time() - start:.0f} s", flush=True)


def timing(column: str) -> bool:
    return "time" in column or column.endswith("_per_s") or "rss" in column or "memory" in column or column == "mfu"


def rows(path: Path) -> list[dict]:
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return [{k: v for k, v in row.items() if not timing(k)} for row in csv.DictReader(f)]
    return [{k: v for k, v in json.loads(line).items() if not timing(k)} for line in path.read_text().splitlines()]


def compare(before: Path, after: Path) -> int:
    differ = 0
    for name in CASES:
        if not (before / name).is_dir():
            continue
        problems = []
        for file in KEPT:
            a, b = before / name / file, after / name / file
            if not a.exists():
                continue
            if not b.exists():
                problems.append(f"{file} missing")
                continue
            ra, rb = rows(a), rows(b)
            if len(ra) != len(rb):
                problems.append(f"{file}: {len(ra)} rows before, {len(rb)} after")
            for i, (x, y) in enumerate(zip(ra, rb)):
                for key in sorted(set(x) | set(y)):
                    if x.get(key) != y.get(key):
                        problems.append(f"{file} row {i + 1} {key}: {x.get(key)} -> {y.get(key)}")
        differ += bool(problems)
        print(f"{name}: " + ("identical" if not problems else f"{len(problems)} differences"))
        for line in problems[:20]:
            print(f"  {line}")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    cap = sub.add_parser("capture")
    cap.add_argument("dest", type=Path)
    cap.add_argument("cases", nargs="*", help=f"some of: {' '.join(CASES)} (default: all)")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.verb == "capture":
        unknown = [name for name in args.cases if name not in CASES]
        if unknown:
            parser.error(f"unknown case {unknown[0]}: use some of {', '.join(CASES)}")
        capture(args.dest.resolve(), args.cases)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
