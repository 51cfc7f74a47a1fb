#!/usr/bin/env bash
# The README's offline default job over several seeds: prints each run's summary (format and accuracy
# reward, mean of the first vs the last steps) and its wall time. Usage: bench/default_job_seeds.sh 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
mkdir -p outputs
for seed in "${@:-0 1 2}"; do
  dir="outputs/bench-default-seed$seed"
  start=$(date +%s)
  .venv/bin/python grpo.py env=gsm_symbolic train.seed="$seed" env.seed="$seed" logging.progress_bar=false \
    hydra.run.dir="$dir" > "$dir.log" 2>&1
  echo "seed $seed: $(( $(date +%s) - start )) s wall"
  sed -n '/^summary:/,$p' "$dir.log"
done
