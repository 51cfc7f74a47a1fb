#!/usr/bin/env bash
# docs/agentic.md: `--config-name grpo_python_tool` (SmolLM2-135M-Instruct learning to call the Python tool for
# three-digit products) over several seeds (train.seed and env.seed). Prints, per seed: wall time, and from
# the run's summary the greedy held-out evaluation before -> after (accuracy, reward, tool calls per episode);
# then the figure of docs/agentic.png (bench/agentic_figure.py) as outputs/agentic.png.
# Usage: bench/agentic.sh 0 1 2 [Hydra overrides for the runs]
source "$(dirname "$0")/seeds.sh" "$@"
for seed in "${seeds[@]}"; do
  dir="outputs/bench-agentic-seed$seed"
  run_seed grpo_python_tool "$dir" "$seed"
  echo "seed $seed: $wall s wall |$(grep '^  eval, step 0' "$dir.log" | cut -d: -f2-)"
done
dirs=(); for seed in "${seeds[@]}"; do dirs+=("outputs/bench-agentic-seed$seed"); done
.venv/bin/python bench/agentic_figure.py outputs/agentic.png "${dirs[@]}"  # docs/agentic.png
