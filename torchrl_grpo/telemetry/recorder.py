"""Metrics out of the trainer: a CSV in the run directory (always), sample completions in a JSONL file,
console lines with a progress bar and ETA, wandb when asked (offline mode when no API key is set), TensorBoard and
MLflow when asked (trackers.py), and the run's figures at its end (plots.py)."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from torchrl_grpo.config.settings import LoggingSettings
from torchrl_grpo.core.files import append_whole, write_replacing
from torchrl_grpo.core.secrets import masker
from torchrl_grpo.telemetry.plots import write_run_plots
from torchrl_grpo.telemetry.trackers import start_trackers

# (metric, or the first present of several; its label): shown when the step has it
CONSOLE_KEYS = (
    ("reward", "reward"),
    ("kl_to_ref", "kl_ref"),
    ("clip_fraction", "clip"),
    ("entropy", "ent"),
    ("completion_length", "len"),
    ("turns/engine_turns", "turns"),  # multi-turn episodes only
    ("turns/tool_calls", "calls"),
    ("grad_norm", "gnorm"),
    ("step_time", "s/step"),
    ("train_tokens_per_s", "tok/s"),
    (("memory/train/peak_gib", "memory/peak_rss_gib"), "mem"),  # GiB: the train GPUs' peak, else the process's
)

EVAL_CONSOLE_KEYS = (("accuracy", "accuracy"), ("reward", "reward"), ("turns/tool_calls", "calls"))  # (metric, label)


class MetricsCSV:
    """One row per step; the header grows when a new metric appears (the file is rewritten then). A row is
    written whole or not at all (:mod:`torchrl_grpo.core.files`). The rows live in the file only: held in memory,
    a long run's grew with every step (``bench/soak.py``)."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        self.header: list[str] = []
        if path.exists() and resume_step is not None:
            # rows logged after the checkpoint we resume from will be produced again
            kept = [r for r in self.rows() if int(float(r["step"])) <= resume_step]
            write_replacing(path, self._text(kept, header=True))
        elif path.exists():
            path.unlink()

    def rows(self) -> list[dict]:
        """The rows written so far, read back from the file (values as text); sets the header to the file's."""
        if not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            self.header = list(reader.fieldnames or [])
            return list(reader)

    def write(self, row: dict) -> None:
        new = [k for k in row if k not in self.header]
        if new or not self.path.exists():
            rows = [*self.rows(), row]
            self.header += [k for k in row if k not in self.header]
            write_replacing(self.path, self._text(rows, header=True))
            return
        append_whole(self.path, self._text([row], header=False))

    def _text(self, rows: list[dict], header: bool) -> str:
        out = io.StringIO(newline="")
        writer = csv.DictWriter(out, self.header, restval="")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()


class SamplesJSONL:
    """Completions, one JSON object per line (``samples.jsonl``): the step, the prompt, what the model actually
    wrote, its total reward, advantage and each reward component (``reward/<name>``; null where a reward did not
    apply), to read beside the curves. On resume the lines of steps after the checkpoint are dropped (they are
    produced again)."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        if path.exists() and resume_step is not None:
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            write_replacing(path, "".join(line + "\n" for line in kept))
        elif path.exists():
            path.unlink()

    def write(self, step: int, samples: list[dict]) -> None:
        append_whole(self.path, "".join(json.dumps({"step": step, **{k: _json_value(v) for k, v in sample.items()}},
                                                   ensure_ascii=False) + "\n" for sample in samples))


def _json_value(value):
    """NaN (a reward that did not apply) as null: JSON has no NaN."""
    return None if isinstance(value, float) and math.isnan(value) else value


class Telemetry:
    def __init__(self, settings: LoggingSettings, config: dict, run_dir: Path, total_steps: int, start_step: int,
                 resumed: bool):
        """``config``: the run's resolved config, which wandb records."""
        self.csv = MetricsCSV(run_dir / "metrics.csv", resume_step=start_step if resumed else None)
        self.samples = SamplesJSONL(run_dir / "samples.jsonl", resume_step=start_step if resumed else None)
        self.samples_frequency = settings.samples_frequency
        self.log_frequency = settings.log_frequency
        self.show_completions = settings.show_completions
        # a bar redraws with carriage returns: only on a terminal (a file, CI or `| tee` gets the step lines)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="GRPO", unit="step", dynamic_ncols=True,
                        disable=not (settings.progress_bar and sys.stderr.isatty()), file=sys.stderr)
        self.wandb = _start_wandb(settings, config, run_dir) if settings.wandb else None
        self.trackers = start_trackers(settings, config, run_dir, start_step if resumed else None)

    def record(self, step: int, metrics: dict) -> dict:
        """Write ``metrics`` as the row of ``step`` (CSV, wandb) and print its evaluation line, if any; the
        trainer's evaluation before the first step is recorded as step 0."""
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.csv.write(row)
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        for tracker in self.trackers:
            tracker.log(step, row)
        shown = [(label, row.get(f"eval/{key}")) for key, label in EVAL_CONSOLE_KEYS]
        if any(isinstance(value, float) for _, value in shown):
            self.print(f"eval at step {step}: " + " | ".join(
                f"{label} {value:.4g}" for label, value in shown if isinstance(value, float)))
        return row

    def log(self, step: int, metrics: dict, samples: list[dict]) -> None:
        """One training step: its row, the progress bar, a console line every ``logging.log_frequency`` steps,
        its ``samples`` (:func:`torchrl_grpo.run.loop.scored_samples`) in samples.jsonl (and wandb's table) every
        ``logging.samples_frequency``."""
        row = self.record(step, metrics)
        if self.samples_frequency and step % self.samples_frequency == 0:
            samples = [masker().tree(sample) for sample in samples]  # a prompt or completion may hold a secret
            self.samples.write(step, samples)
            if self.wandb is not None and samples:
                import wandb

                columns = ["step", *samples[0]]
                self.wandb.log({"samples": wandb.Table(columns=columns, data=[[step, *s.values()] for s in samples])},
                               step=step)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{row.get('reward', float('nan')):.3f}")
        if step % self.log_frequency == 0:
            shown = [(short, _first_number(row, (keys,) if isinstance(keys, str) else keys))
                     for keys, short in CONSOLE_KEYS]
            parts = [f"step {step}"] + [f"{short} {value:.4g}" for short, value in shown if value is not None]
            self.print(" | ".join(parts))
            for sample in samples[: self.show_completions]:
                self.print(f"    sample (reward {sample['reward']:.2f}): {sample['completion'].strip()[:200]!r}")

    def print(self, line: str) -> None:
        self.bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        for tracker in self.trackers:
            tracker.close()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close()
        if exc_type is not None:  # a run stopped by a fault still leaves the figures of its steps
            self.write_plots()

    def write_plots(self) -> None:
        """The run's figures in ``<run dir>/plots/`` and one line saying where; never raises."""
        write_run_plots(self.csv.path.parent, say=self.print)

    def summary(self, reward_names: list[str], total_steps: int) -> dict[str, Trend]:
        """Print and return the end-of-run summary: the reward and each component (and a critic's explained
        variance) over the first step, the first and the last steps; the first vs the last evaluation, when
        there were several; the throughput and the peak memory (:func:`hardware_line`). Then the run's figures."""
        window = max(1, min(5, total_steps // 4))
        rows = self.csv.rows()
        trends = summarize(rows, ["reward"] + [f"reward/{n}" for n in reward_names] + ["explained_variance"], window)
        width = max([len(key) for key in trends] + [8])
        self.print(f"{'summary:':<{width + 2}} {'first step':>12} "
                   f"{f'first {window} mean':>14} {f'last {window} mean':>14}")
        for key, trend in trends.items():
            self.print(f"  {key:<{width}} {trend.first_step:>12.3f} {trend.first_mean:>14.3f} {trend.last_mean:>14.3f}")
        evaluated = [r for r in rows if r.get("eval/accuracy") not in (None, "")]
        if len(evaluated) > 1:  # before vs after training, on the held-out evaluation split
            first, last = evaluated[0], evaluated[-1]
            self.print(f"  eval, step {int(first['step'])} -> step {int(last['step'])}: " + " | ".join(
                f"{label} {float(first[f'eval/{key}']):.3f} -> {float(last[f'eval/{key}']):.3f}"
                for key, label in EVAL_CONSOLE_KEYS if first.get(f"eval/{key}") not in (None, "")))
        if line := hardware_line(rows):
            self.print(line)
        self.write_plots()
        return trends


def _first_number(row: dict, keys: tuple[str, ...]) -> float | None:
    return next((row[key] for key in keys if isinstance(row.get(key), float)), None)


# the summary's speed (means over the steps: column, format, scale) and peak memory (maxima: column, label)
SPEED = (("train_tokens_per_s", "train {:.4g} tokens/s", 1), ("train_flops_per_s", "{:.4g} TFLOP/s", 1e-12),
         ("mfu", "MFU {:.1%}", 1), ("generation_tokens_per_s", "generation {:.4g} tokens/s", 1))
PEAK_MEMORY = (("memory/train/peak_gib", "train"), ("memory/ref/peak_gib", "ref"),
               ("memory/inference/used_gib", "inference"), ("memory/peak_rss_gib", "process RSS"))


def hardware_line(rows: list[dict]) -> str | None:
    """The summary's line on speed and memory: the mean training tokens/s, TFLOP/s and MFU, the mean generation
    tokens/s, and the peak GiB of each role's GPUs and of this process's resident set, each when logged; None when
    none is."""
    speed = [form.format(sum(v) / len(v) * scale) for key, form, scale in SPEED if (v := logged(rows, key))]
    memory = [f"{label} {max(v):.2f}" for key, label in PEAK_MEMORY if (v := logged(rows, key))]
    parts = ([", ".join(speed)] if speed else []) + ([f"peak memory GiB: {', '.join(memory)}"] if memory else [])
    return f"  hardware: {' | '.join(parts)}" if parts else None


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _start_wandb(settings: LoggingSettings, config: dict, run_dir: Path):
    import wandb

    mode = settings.wandb_mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(
        project=settings.wandb_project,
        name=settings.run_name or f"{settings.exp_name}-{run_dir.name}",
        dir=str(run_dir),
        mode=mode,
        config=config,
    )


@dataclass(frozen=True)
class Trend:
    """How one metric moved over a run: its first step, and its mean over the first and last steps."""

    first_step: float
    first_mean: float
    last_mean: float


def summarize(rows: list[dict], keys: list[str], window: int) -> dict[str, Trend]:
    """The end-of-run summary: a :class:`Trend` per key, means over ``window`` steps."""
    out = {}
    for key in keys:
        if values := logged(rows, key):
            head, tail = values[:window], values[-window:]
            out[key] = Trend(values[0], sum(head) / len(head), sum(tail) / len(tail))
    return out


def metrics_rows(run_dir: Path) -> list[dict]:
    """A run's metrics.csv rows as written (text cells); none before its first step."""
    path = Path(run_dir) / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def logged(rows: list[dict], key: str) -> list[float]:
    """The values of column ``key`` in metrics.csv rows, empty cells and NaN (a step that did not log it, a reward
    that did not apply) left out."""
    return [float(r[key]) for r in rows if r.get(key) not in (None, "") and not math.isnan(float(r[key]))]
