"""Figures of a run, and of several runs side by side.

A run: its ``metrics.csv`` (telemetry.py) -> a few multi-panel PNGs in ``<run dir>/plots/`` (reward and its
components; completion length, KL, entropy, clip fraction, gradient norm; tokens/s, FLOP/s, MFU and memory per
role; evaluation accuracy and pass@k; a multi-turn run's turns and tool calls per episode), each per-step
series drawn raw (faint) and smoothed (an EMA). Written at the end of every run (:func:`write_run_plots`,
which never raises) and on demand by ``plot.py``.

Several runs (a Hydra sweep directory ``multirun/<date>/<time>/`` with its job folders, or run folders
named one by one): their curves overlaid, one line per job named by its overrides, and a table ranking
the jobs (``sweep.md``): by their last evaluation accuracy when every job was evaluated, else by their
mean reward over the last steps.
"""
from __future__ import annotations

import csv
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from torchrl_grpo.core.errors import ConfigError, one_line

STEP_LABEL = "training step"
SMOOTHED = "faint: each step; solid: exponential moving average"
SPARSE = "one point per evaluation"


@dataclass(frozen=True)
class Panel:
    """One axes: what it shows (title), its y axis (what and unit), the metrics.csv columns drawn on it."""

    title: str
    ylabel: str
    columns: tuple[str, ...]
    per_step: bool = True  # False: a few evaluation points, drawn as markers and not smoothed
    overlay: tuple[str, ...] | None = None  # the columns a sweep overlays, one panel each (None: all)


Series = dict[str, tuple[list[float], list[float]]]  # column -> (steps, values), finite cells only


def read_metrics(run_dir: Path) -> Series:
    """The run's metrics.csv as one (steps, values) pair per column; empty and non-finite cells left out."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        raise ConfigError(f"{path} not found: give a run directory of grpo.py (it holds metrics.csv) "
                          "or a sweep directory (multirun/<date>/<time>)")
    series: Series = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = _number(row.get("step"))
            if step is None:
                continue
            for column, cell in row.items():
                value = _number(cell)
                if column != "step" and value is not None:
                    steps, values = series.setdefault(column, ([], []))
                    steps.append(step)
                    values.append(value)
    return series


def _number(cell) -> float | None:
    try:
        value = float(cell)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def figures(columns) -> dict[str, list[Panel]]:
    """The figures of a run (file stem -> panels), given the columns it logged."""
    columns = list(columns)
    components = [c for c in columns if c.startswith("reward/")]
    pass_at = sorted((c for c in columns if c.startswith("eval/pass@")), key=lambda c: int(c.split("@")[1]))
    # an evaluation over several tasks (reasoning-gym) writes eval/<task>/accuracy; eval/reward/<component> is not one
    task_accuracy = [c for c in columns if c.startswith("eval/") and c.endswith("/accuracy") and c.count("/") == 2
                     and not c.startswith("eval/reward/")]
    # multi-turn episodes (episodes/play.py turn_metrics): engine turns and the environment's counts, per episode
    per_episode = [c for c in columns if c.startswith("turns/") and c != "turns/inserted_tokens"
                   and not c.startswith("turns/ended_")]
    ended = [c for c in columns if c.startswith("turns/ended_")]
    return {
        "reward": [Panel("total reward (weighted sum)", "reward, mean over completions", ("reward",))] + [
            Panel(f"reward component: {c.removeprefix('reward/')}", "reward, mean over completions", (c,))
            for c in components],
        "policy": [
            Panel("completion length", "tokens", ("completion_length", "completion_length_max")),
            Panel("KL divergence", "nats per token", ("kl_to_ref", "kl_to_inference")),
            Panel("policy entropy", "nats per token", ("entropy",)),
            Panel("clipped by the ratio clip", "fraction of tokens",
                  ("clip_fraction", "clip_fraction_low", "clip_fraction_high"), overlay=("clip_fraction",)),
            Panel("gradient norm", "L2 norm, before clipping", ("grad_norm",)),
        ],
        "critic": [  # an actor-critic run's value model (loss=ppo)
            Panel("explained variance of the returns", "1 - Var(R - V) / Var(R), before the update",
                  ("explained_variance",)),
            Panel("value loss", "clipped squared error / 2", ("value_loss",)),
            Panel("values and returns", "mean over completion tokens", ("value_mean", "return_mean"),
                  overlay=("value_mean",)),
            Panel("value loss clipped", "fraction of tokens", ("value_clip_fraction",)),
            Panel("critic gradient norm", "L2 norm, before clipping", ("critic_grad_norm",)),
        ],
        "throughput": [  # telemetry/hardware.py and the trainer's model FLOPs
            Panel("tokens per second", "tokens/s", ("train_tokens_per_s", "generation_tokens_per_s")),
            Panel("training model FLOP/s", "FLOP/s", ("train_flops_per_s",)),
            Panel("model FLOPs utilization", "fraction of the GPUs' bf16 peak", ("mfu",)),
            Panel("GPU memory per role", "GiB: a step's peak (the engine's GPUs: in use)",
                  ("memory/train/peak_gib", "memory/ref/peak_gib", "memory/inference/used_gib")),
            Panel("trainer process memory", "GiB resident", ("memory/rss_gib", "memory/peak_rss_gib")),
        ],
        "eval": [
            Panel("evaluation: accuracy and pass@k", "fraction of prompts", ("eval/accuracy", *pass_at), False,
                  overlay=("eval/accuracy", *pass_at[1:])),  # pass@1 is the accuracy of one sample
            Panel("evaluation: reward", "reward, mean over responses", ("eval/reward",), False),
            Panel("evaluation: accuracy per task", "fraction of prompts", tuple(task_accuracy), False),
            Panel("evaluation: per episode", "mean per episode", tuple(f"eval/{c}" for c in per_episode), False),
        ],
        "turns": [
            Panel("per episode: engine turns, the environment's counts", "mean per episode", tuple(per_episode)),
            Panel("how episodes ended", "fraction of episodes", tuple(ended)),
            Panel("tokens the environment inserted", "tokens, mean per episode", ("turns/inserted_tokens",)),
        ],
    }


def ema(values: list[float]) -> list[float]:
    """Exponential moving average over about a tenth of the run (at least 3 steps), bias-corrected so that
    the first points are not pulled towards zero."""
    decay = 1 - 2 / (max(3, len(values) // 10) + 1)
    out, mean, weight = [], 0.0, 0.0
    for value in values:
        mean, weight = decay * mean + (1 - decay) * value, decay * weight + (1 - decay)
        out.append(mean / weight)
    return out


def _draw(ax, steps, values, per_step: bool, color, label: str | None) -> None:
    if not per_step or len(values) < 5:
        ax.plot(steps, values, marker="o", markersize=4, color=color, label=label)
        return
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8, marker=".", markersize=3)
    ax.plot(steps, ema(values), color=color, linewidth=2, label=label)


def save_figure(path: Path, title: str, panels: list[tuple[Panel, list[tuple[str, tuple[list, list]]]]],
          legend_below: list[str] | None = None) -> Path:
    """One PNG: a grid of panels, each with its (label, (steps, values)) lines; one legend below the grid
    when the lines are the same jobs on every panel, else a legend per panel that has several columns."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # here: a missing matplotlib fails the figures only
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(5.2 * cols, 3.6 * rows + (0.4 + 0.25 * len(legend_below) if legend_below else 0.6)),
                 layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"{title}\n{SMOOTHED if any(p.per_step for p, _ in panels) else SPARSE}", fontsize=11)
    colors = [f"C{i % 10}" for i in range(max(len(lines) for _, lines in panels))]
    for i, (panel, lines) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for color, (label, (steps, values)) in zip(colors, lines):
            _draw(ax, steps, values, panel.per_step, color, None if legend_below else label)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(panel.columns) > 1 and not legend_below:
            ax.legend(fontsize=8)
    if legend_below:
        handles = [Line2D([], [], color=c, linewidth=2) for c in colors[:len(legend_below)]]
        fig.legend(handles, legend_below, loc="outside lower center", fontsize=9, ncols=1)
    fig.savefig(path, dpi=90)
    return path


def plot_run(run_dir: Path) -> list[Path]:
    """Write the run's figures to ``<run dir>/plots/``; a figure none of whose columns has a value is left out."""
    run_dir = Path(run_dir)
    series = read_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for stem, panels in figures(series).items():
        drawn = [(p, [(c, series[c]) for c in p.columns if c in series]) for p in panels]
        drawn = [(p, lines) for p, lines in drawn if lines]
        if drawn:
            written.append(save_figure(out_dir / f"{stem}.png", f"{run_dir.name}: {stem}", drawn))
    return written


def write_run_plots(run_dir: Path, say=print) -> None:
    """The end-of-run figures and one line saying where; a failure is one warning line, never an exception."""
    try:
        written = plot_run(run_dir)
        say(f"plots: {Path(run_dir) / 'plots'} ({len(written)} figures)")
    except Exception as err:  # a finished run must not fail for its figures
        print(f"warning: plots not written: {one_line(err)}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ sweeps
@dataclass
class Job:
    name: str
    run_dir: Path
    series: Series


def find_runs(paths) -> list[Path]:
    """Run directories: each path that holds metrics.csv, else its sub-folders that do (a sweep's jobs, in
    numeric order); a path with neither is a ConfigError."""
    runs = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise ConfigError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}: give a run "
                              "directory of grpo.py or a sweep directory")
        if (path / "metrics.csv").is_file():
            runs.append(path)
            continue
        jobs = sorted((p for p in path.iterdir() if (p / "metrics.csv").is_file()),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
        if not jobs:
            raise ConfigError(f"{path} has no metrics.csv, nor job folders with one: give a run directory of "
                              "grpo.py or a sweep directory (multirun/<date>/<time>)")
        runs += jobs
    return runs


def job_names(runs: list[Path]) -> list[str]:
    """Each job named by the overrides that set it apart (``.hydra/overrides.yaml``), e.g. ``optimizer.lr=1e-4``;
    by its folder where those do not tell the jobs apart."""
    import yaml

    overrides = []
    for run in runs:
        path = run / ".hydra" / "overrides.yaml"
        overrides.append([str(o) for o in (yaml.safe_load(path.read_text()) or [])] if path.is_file() else [])
    shared = set.intersection(*map(set, overrides)) if overrides else set()
    names = [" ".join(o for o in own if o not in shared) for own in overrides]
    if all(names) and len(set(names)) == len(names):
        return names
    base = Path(os.path.commonpath([r.resolve() for r in runs])) if len(runs) > 1 else runs[0].resolve().parent
    return [str(r.resolve().relative_to(base)) + (f" {n}" if n else "") for r, n in zip(runs, names)]


def last_window(steps: int) -> int:
    """How many final steps a job's reward is averaged over for the ranking: a tenth of them, at least 5."""
    return min(steps, max(5, math.ceil(steps / 10)))


REWARD_METRIC = "mean reward, last 10% of steps (at least 5)"
EVAL_METRIC = "last eval/accuracy"


def scores(job: Job) -> dict[str, float | None]:
    """What a job is ranked by: its last evaluation accuracy and its mean reward over the last steps."""
    rewards = job.series.get("reward", ([], []))[1]
    accuracy = job.series.get("eval/accuracy", ([], []))[1]
    return {EVAL_METRIC: accuracy[-1] if accuracy else None,
            REWARD_METRIC: sum(rewards[-last_window(len(rewards)):]) / last_window(len(rewards)) if rewards else None}


def rank(jobs: list[Job]) -> tuple[list[str], list[tuple[Job, dict]]]:
    """The jobs, best first, with their scores, and the metrics that ranked them in order: the last evaluation
    accuracy when every job has one (ties broken by the reward), else the mean reward of the last steps. A
    job with neither comes last."""
    scored = [(job, scores(job)) for job in jobs]
    evaluated = bool(jobs) and all(s[EVAL_METRIC] is not None for _, s in scored)
    metrics = [EVAL_METRIC, REWARD_METRIC] if evaluated else [REWARD_METRIC]
    ranked = sorted(scored, key=lambda js: [(js[1][m] is None, -(js[1][m] or 0.0)) for m in metrics])
    return metrics, ranked


def sweep_table(metrics: list[str], ranked: list[tuple[Job, dict]], out_dir: Path) -> str:
    """The ranking as a markdown table (what sweep.md holds); the ranking metric's column comes first."""
    columns = metrics + [m for m in (EVAL_METRIC, REWARD_METRIC) if m not in metrics]
    lines = [f"Jobs ranked by {' then by '.join(metrics)}, best first.", "",
             "| rank | job | " + " | ".join(columns) + " | steps | run directory |",
             "|---" * (len(columns) + 4) + "|"]
    for i, (job, score) in enumerate(ranked, 1):
        steps = len(job.series.get("reward", ([], []))[0])
        lines.append(f"| {i} | {job.name} | " + " | ".join(_cell(score[c]) for c in columns) +
                     f" | {steps} | {os.path.relpath(job.run_dir, out_dir)} |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def plot_sweep(runs: list[Path], out_dir: Path) -> tuple[str, list[Path]]:
    """Overlay the runs' curves (``<out dir>/plots/sweep_*.png``, one panel per metric, one line per job)
    and rank them (``<out dir>/sweep.md``); returns the table and the figures."""
    jobs = [Job(name, run, read_metrics(run)) for name, run in zip(job_names(runs), runs)]
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(c for job in jobs for c in job.series))
    written = []
    for stem, panels in figures(columns).items():
        per_column = [Panel(p.title if len(p.columns) == 1 else f"{p.title}: {c}", p.ylabel, (c,), p.per_step)
                      for p in panels for c in (p.columns if p.overlay is None else p.overlay)]
        drawn = [(p, [(j.name, j.series.get(p.columns[0], ([], []))) for j in jobs]) for p in per_column]
        drawn = [(p, lines) for p, lines in drawn if any(values for _, (_, values) in lines)]
        if drawn:
            title = f"{out_dir.resolve().name}: {len(jobs)} runs, {stem}"
            written.append(save_figure(out_dir / "plots" / f"sweep_{stem}.png", title, drawn, [j.name for j in jobs]))
    table = sweep_table(*rank(jobs), out_dir)
    (out_dir / "sweep.md").write_text(table)
    return table, written


def main(paths: list[str], out: str | None = None) -> None:
    """``plot.py``: one run directory -> its figures; several, or a sweep directory -> overlays and the ranking."""
    runs = find_runs(paths)
    if len(paths) == 1 and runs == [Path(paths[0])]:
        written = plot_run(runs[0])
        print(f"plots: {runs[0] / 'plots'} ({len(written)} figures)")
        return
    out_dir = Path(out) if out else Path(paths[0]) if len(paths) == 1 else Path(
        os.path.commonpath([p.resolve() for p in map(Path, paths)]))
    table, written = plot_sweep(runs, out_dir)
    print(table, end="")
    print(f"plots: {out_dir / 'plots'} ({len(written)} figures); table: {out_dir / 'sweep.md'}")
