"""Sync vs async throughput on one small config: runs ``grpo.py`` (on-policy), ``grpo.py train.sync_iter=false``
(next batch generated while this one trains), ``grpo-async.py`` (Ray actors, a batch per collect) and
``grpo-async.py ray.streaming=true`` (groups streamed across in-flight pushes) with the same overrides, and prints
over the steps after the warm-up: trained completions/s and completion tokens/s, with each mode's ratio to sync;
the reward's rise per minute of training (a least-squares slope over the trainer's loop time); and the engine's
idle share (1 - its generation time over the loop's: for async modes the actors' own time generating the batches
trained on, all of a streaming actor's decoding). Throughput is the trainer's: completions it trained on per second
of its loop (``step_time`` summed, waits for data included), so start-up and the final checkpoint are left out; the
end-to-end wall is printed too.

    .venv/bin/python bench/sync_vs_async.py                          # SmolLM2-135M, gsm_symbolic, 10 steps
    .venv/bin/python bench/sync_vs_async.py --steps 6 model=tiny     # extra arguments are Hydra overrides
    .venv/bin/python bench/sync_vs_async.py --modes async "async streaming" --steps 12 \
        inference_model.max_tokens=160 env.num_envs=4 env.repeats=4 train.optim_batch_size=4   # long-tailed lengths
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "sync": ("grpo.py", []),
    "sync_iter=false": ("grpo.py", ["train.sync_iter=false"]),
    "async": ("grpo-async.py", []),
    "async streaming": ("grpo-async.py", ["ray.streaming=true"]),
}


def run_mode(name: str, script: str, extra: list[str], overrides: list[str], steps: int, out_dir: Path) -> dict:
    run_dir = out_dir / name.replace("=", "-").replace(" ", "-")
    args = [sys.executable, str(ROOT / script), "env=gsm_symbolic", "logging.progress_bar=false",
            "logging.checkpoint_frequency=0", *overrides, *extra, f"hydra.run.dir={run_dir}"]
    probe = subprocess.run([*args, "--cfg", "job", "--resolve"], capture_output=True, text=True, cwd=ROOT)
    per_step = completions_per_step(probe.stdout)
    args.insert(-1, f"train.total_dialog_turns={steps * per_step}")
    started = time.perf_counter()
    log = out_dir / f"{run_dir.name}.log"
    with open(log, "w") as f:
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        sys.exit(f"error: {name} failed (exit {done.returncode}); see {log}")
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {"rows": rows, "per_step": per_step, "wall_s": time.perf_counter() - started}


def completions_per_step(job_yaml: str) -> int:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(job_yaml)
    return int(cfg.train.dialog_turns_per_batch or cfg.env.num_envs * cfg.env.repeats)


def throughput(result: dict, warmup: int) -> dict:
    """Completions/s, tokens/s, the reward's rise per minute and the engine's idle share over the steps after
    ``warmup`` (the first includes engine warm-up)."""
    rows = [r for r in result["rows"] if int(float(r["step"])) > warmup]
    seconds = sum(float(r["step_time"]) for r in rows)
    completions = result["per_step"] * len(rows)
    tokens = sum(float(r["completion_length"]) * result["per_step"] for r in rows)
    generating = sum(float(r["generation_time"]) for r in rows)
    return {"steps": len(rows), "seconds": round(seconds, 1), "completions_per_s": round(completions / seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "reward_mean": round(sum(float(r["reward"]) for r in rows)
                                                                             / len(rows), 3),
            "reward_per_min": round(reward_slope(rows), 4), "engine_idle": round(max(0.0, 1 - generating / seconds), 2),
            "wall_s": round(result["wall_s"], 1)}


def reward_slope(rows: list[dict]) -> float:
    """The least-squares slope of each step's mean reward against the minutes of the trainer's loop at its end."""
    minutes, elapsed = [], 0.0
    for r in rows:
        elapsed += float(r["step_time"]) / 60
        minutes.append(elapsed)
    rewards = [float(r["reward"]) for r in rows]
    mx, my = sum(minutes) / len(minutes), sum(rewards) / len(rewards)
    spread = sum((x - mx) ** 2 for x in minutes)
    return sum((x - mx) * (y - my) for x, y in zip(minutes, rewards)) / spread if spread else 0.0


def options(doc: str, steps: int, out: str, add=lambda parser: None) -> argparse.Namespace:
    """The run benches' command line: --steps, --warmup, --out (made), Hydra overrides, and what ``add`` adds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / out)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    add(parser)
    opts = parser.parse_args()
    if opts.steps <= opts.warmup:
        sys.exit(f"error: --steps={opts.steps} leaves no step after --warmup={opts.warmup}: raise --steps")
    opts.out.mkdir(parents=True, exist_ok=True)
    return opts


def main():
    opts = options(__doc__, 10, "bench-sync-vs-async", add=lambda parser: parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the modes to run (default: all)"))
    figures = {}
    for name in opts.modes:
        script, extra = MODES[name]
        figures[name] = throughput(run_mode(name, script, extra, opts.overrides, opts.steps, opts.out), opts.warmup)
        print(f"{name:>16}: " + ", ".join(f"{k} {v}" for k, v in figures[name].items()), flush=True)
    base = figures[next(iter(figures))]["completions_per_s"]
    for name, fig in figures.items():
        fig["ratio_to_first"] = round(fig["completions_per_s"] / base, 2)
    print(f"| mode | completions/s | tokens/s | vs {next(iter(figures))} | reward/min | engine idle | wall s |\n"
          "|---|---|---|---|---|---|---|")
    for name, fig in figures.items():
        print(f"| {name} | {fig['completions_per_s']} | {fig['tokens_per_s']} | {fig['ratio_to_first']}x | "
              f"{fig['reward_per_min']} | {fig['engine_idle']:.0%} | {fig['wall_s']} |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
