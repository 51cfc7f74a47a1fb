#!/usr/bin/env bash
# README "See it learn": `--config-name grpo_arithmetic` over several seeds (train.seed and env.seed). Prints,
# per seed: wall time, the run's own evaluation before / after (pass@1 and pass@8 over 8 samples at
# temperature 1 on the 70 test questions), and greedy accuracy before / after (evaluate.py on the base model
# and on the run's last checkpoint). Usage: bench/see_it_learn.sh 0 1 2 [extra Hydra overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
mkdir -p outputs
seeds=(); extra=()
for arg in "$@"; do if [[ $arg =~ ^[0-9]+$ ]]; then seeds+=("$arg"); else extra+=("$arg"); fi; done
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
greedy() {  # $1: model; prints its greedy accuracy on the test questions
  .venv/bin/python evaluate.py --config-name grpo_arithmetic model.name="$1" eval.samples=1 eval.temperature=0 \
    hydra.run.dir=outputs/bench-learn-eval > outputs/bench-learn-eval.log 2>&1
  tail -1 outputs/bench-learn-eval.log | .venv/bin/python -c "import json,sys; print(f\"{json.load(sys.stdin)['accuracy']:.3f}\")"
}
base=$(greedy smollm2-135m-instruct)
for seed in "${seeds[@]}"; do
  dir="outputs/bench-learn-seed$seed"
  rm -rf "$dir"
  start=$(date +%s)
  .venv/bin/python grpo.py --config-name grpo_arithmetic train.seed="$seed" env.seed="$seed" \
    logging.progress_bar=false "${extra[@]}" hydra.run.dir="$dir" > "$dir.log" 2>&1
  wall=$(( $(date +%s) - start ))
  evals=$(.venv/bin/python - "$dir/metrics.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("eval/accuracy")]
first, last = rows[0], rows[-1]
print(f"pass@1 {float(first['eval/accuracy']):.3f} -> {float(last['eval/accuracy']):.3f}, "
      f"pass@8 {float(first['eval/pass@8']):.3f} -> {float(last['eval/pass@8']):.3f}")
PY
)
  last=$(ls -d "$dir"/checkpoints/step_* | tail -1)
  echo "seed $seed: ${wall} s wall | $evals | greedy $base -> $(greedy "$last")"
done
