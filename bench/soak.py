"""Long runs stay flat: one entry script run for many steps while every process of the run is measured. Not a test.

    .venv/bin/python bench/soak.py sync                  # the tiny model, 2,000 steps, grpo.py
    .venv/bin/python bench/soak.py async ranks           # grpo-async.py; two data-parallel ranks
    .venv/bin/python bench/soak.py smollm2 --steps 300   # the default job (SmolLM2-135M-Instruct)

Each case runs as a user would run it, marked with an environment variable that every process it starts
inherits (engine processes, ranks, Ray's daemons and actors), so that all of them are found in ``/proc``. Every
``--every`` steps (read from the run's ``metrics.csv``; not at the last step, which the run's end follows) it
records, over those processes: the resident set (MiB), open files, threads, the count of processes, and what
``/dev/shm`` holds (MiB). At the end it prints, for each quantity and case, the slope after warm-up (the first
fifth of the samples left out) per 1,000 steps by least squares, with the spread of the samples around that
line: a slope within the spread is flat. The resident set is also split: ``anon_mib``, the processes' own
memory (heaps, tensors), and ``rss_shmem_mib``, pages of shared memory they touched (a driver's pushes into Ray's
object store: bounded by the store and plateauing, not a leak of the process).
"""
import argparse
import csv
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "env=gsm_symbolic", "env.size=64", "env.num_envs=2", "env.repeats=4", "train.optim_batch_size=4",
        "inference_model.max_tokens=8", "logging.progress_bar=false", "logging.checkpoint_frequency=500",
        "logging.keep_checkpoints=1", "logging.samples_frequency=100"]
CASES = {  # case -> (script, overrides without the length)
    "sync": ("grpo.py", TINY),
    "async": ("grpo-async.py", TINY),
    "ranks": ("grpo.py", [*TINY, "train_model.num_devices=2", "train.strategy=fsdp"]),
    "smollm2": ("grpo.py", ["env=gsm_symbolic", "logging.progress_bar=false", "logging.checkpoint_frequency=100",
                            "logging.keep_checkpoints=1", "logging.samples_frequency=100"]),
}
DEFAULT_STEPS = {"sync": 2000, "async": 2000, "ranks": 2000, "smollm2": 300}
MARKER = "TORCHRL_GRPO_SOAK"
QUANTITIES = ("rss_mib", "anon_mib", "rss_shmem_mib", "open_files", "threads", "processes", "shm_mib")


def completions_per_step(overrides: list[str]) -> int:
    value = {k: int(v) for k, v in (o.split("=", 1) for o in overrides if o.startswith(("env.num_envs=",
                                                                                        "env.repeats=")))}
    return value.get("env.num_envs", 2) * value.get("env.repeats", 8)


def processes_of(tag: str) -> list[psutil.Process]:
    """The live processes whose environment holds ``MARKER=tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"{MARKER}={tag}".encode() in f.read():
                    found.append(psutil.Process(int(pid)))
        except (OSError, psutil.Error):
            pass
    return found


def shm_mib() -> float:
    if not os.path.isdir("/dev/shm"):
        return 0.0
    total = 0
    for root, _, files in os.walk("/dev/shm"):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total / 2**20


def resident_parts(pid: int) -> tuple[float, float]:
    """(anonymous, shared-memory) parts of a process's resident set, MiB: the shared part is pages of mapped
    shared memory it touched (Ray's object store, which a driver writes each push into), not its own heap."""
    parts = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                parts[line.split(":")[0]] = int(line.split()[1]) / 1024
    return parts.get("RssAnon", 0.0), parts.get("RssShmem", 0.0)


def label(proc: psutil.Process) -> str:
    """A process's name as a reader knows it: Ray's title (ray::RolloutActor), else its script or command."""
    command = proc.cmdline()
    scripts = [Path(a).name for a in command if a.endswith(".py")]
    if command and command[0].startswith("ray::"):  # ray::RolloutActor.collect while it collects
        return f"{command[0].split('.')[0].split()[0]}:{proc.pid}"
    return f"{(scripts or [proc.name()])[0]}:{proc.pid}"


def sample(tag: str) -> tuple[dict, dict]:
    """The run's totals, and each process's resident set (MiB) by :func:`label`."""
    rss, anon, shmem, files, threads, alive, each = 0, 0.0, 0.0, 0, 0, 0, {}
    for proc in processes_of(tag):
        try:
            with proc.oneshot():
                mine = proc.memory_info().rss
                files += proc.num_fds()
                threads += proc.num_threads()
                mine_anon, mine_shmem = resident_parts(proc.pid)
                each[label(proc)] = mine / 2**20
                each[label(proc) + " anon"] = mine_anon
                rss, anon, shmem, alive = rss + mine, anon + mine_anon, shmem + mine_shmem, alive + 1
        except (psutil.Error, OSError):
            pass
    totals = {"rss_mib": rss / 2**20, "anon_mib": anon, "rss_shmem_mib": shmem, "open_files": files,
              "threads": threads, "processes": alive, "shm_mib": shm_mib()}
    return totals, each


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return 0
    with open(path) as f:
        return max((int(float(r["step"])) for r in csv.DictReader(f) if r.get("step")), default=0)


def slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(slope per 1,000 steps, spread of the points around the line) after warm-up."""
    kept = points[len(points) // 5:]
    if len(kept) < 3:
        return float("nan"), float("nan")
    n, xs, ys = len(kept), [p[0] for p in kept], [p[1] for p in kept]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs) or 1.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    spread = (sum((y - (my + b * (x - mx))) ** 2 for x, y in zip(xs, ys)) / (n - 2)) ** 0.5
    return 1000 * b, spread


def soak(case: str, steps: int, every: int, out: Path) -> list[tuple[int, dict, dict]]:
    script, overrides = CASES[case]
    run_dir, tag = out / case, uuid.uuid4().hex
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    args = [*overrides, f"train.total_dialog_turns={steps * completions_per_step(overrides)}",
            f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", MARKER: tag}
    samples, due = [], every
    with open(run_dir / "soak.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if due < steps and steps_done(run_dir) >= due:  # the last step's sample would time the run's end
                totals, each = sample(tag)
                samples.append((due, totals, each))
                print(f"{case} step {due}: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()), flush=True)
                due += every
            time.sleep(1.0)
    if proc.returncode != 0:
        raise SystemExit(f"{case}: {script} exited {proc.returncode}; see {run_dir / 'soak.log'}")
    left = processes_of(tag)
    if left:
        print(f"{case}: {len(left)} process(es) left after the run: {[p.pid for p in left]}", flush=True)
    return samples


def report(case: str, samples: list[tuple[int, dict, dict]]) -> None:
    print(f"\n{case}: per 1,000 steps after warm-up (slope +- spread of the samples around the line)")
    for quantity in QUANTITIES:
        points = [(step, totals[quantity]) for step, totals, _ in samples]
        b, spread = slope(points)
        first, last = points[0][1] if points else float("nan"), points[-1][1] if points else float("nan")
        print(f"  {quantity:<11} first {first:9.1f}  last {last:9.1f}  slope {b:+9.2f}  spread {spread:7.2f}")
    print("  resident set (and its anonymous part) by process, MiB per 1,000 steps; those alive throughout:")
    alive = set.intersection(*(set(each) for _, _, each in samples)) if samples else set()
    for name in sorted(alive, key=lambda n: -slope([(step, each[n]) for step, _, each in samples])[0]):
        b, spread = slope([(step, each[name]) for step, _, each in samples])
        print(f"    {name:<32} last {samples[-1][2][name]:8.1f}  slope {b:+8.2f}  spread {spread:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=list(CASES))
    parser.add_argument("--steps", type=int, default=None, help="steps per case (default: 2,000; smollm2: 300)")
    parser.add_argument("--every", type=int, default=100, help="steps between samples")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "soak")
    opts = parser.parse_args()
    results = {case: soak(case, opts.steps or DEFAULT_STEPS[case], opts.every, opts.out) for case in opts.cases}
    for case, samples in results.items():
        report(case, samples)


if __name__ == "__main__":
    main()
