"""docs/agentic.png: the runs of bench/agentic.sh side by side, one line per seed: tool calls per episode and
reward per training step, then the held-out accuracy and tool calls per held-out episode at each evaluation.
Usage: python bench/agentic_figure.py OUT.png RUN_DIR [RUN_DIR ...]"""
import sys
from pathlib import Path

from torchrl_grpo.telemetry.plots import Panel, job_names, read_metrics, save_figure

PANELS = [
    Panel("training: tool calls", "mean per episode", ("turns/tool_calls",)),
    Panel("training: reward (the right number)", "mean over episodes", ("reward",)),
    Panel("held-out: accuracy (greedy)", "fraction of questions", ("eval/accuracy",), per_step=False),
    Panel("held-out: tool calls (greedy)", "mean per episode", ("eval/turns/tool_calls",), per_step=False),
]


def main(out: str, runs: list[str]) -> None:
    runs = [Path(r) for r in runs]
    names, series = job_names(runs), [read_metrics(r) for r in runs]
    drawn = [(p, [(name, s.get(p.columns[0], ([], []))) for name, s in zip(names, series)]) for p in PANELS]
    print(save_figure(Path(out), "SmolLM2-135M-Instruct learning to call a Python tool on a CPU", drawn, names))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
