#!/usr/bin/env bash
# docs/see-it-learn.md: `--config-name grpo_arithmetic` over several seeds (train.seed and env.seed), then
# the base model and each run's final checkpoint evaluated by sampling as in training (temperature 1, 8
# completions per test question: accuracy = pass@1). Prints, per seed: wall time, the greedy evaluation
# accuracy before / after (from the run), the sampled one before / after.
# Usage: bench/see_it_learn.sh 0 1 2 [Hydra overrides for the runs, e.g. train.mixed_precision=false]
source "$(dirname "$0")/seeds.sh" "$@"
sampled() {  # $1: model; prints the sampled accuracy (pass@1 over 8 completions) on the test questions
  .venv/bin/python evaluate.py --config-name grpo_arithmetic model.name="$1" eval.samples=8 eval.temperature=1.0 \
    hydra.run.dir=outputs/bench-learn-eval > outputs/bench-learn-eval.log 2>&1
  tail -1 outputs/bench-learn-eval.log | .venv/bin/python -c "import json,sys; print(f\"{json.load(sys.stdin)['accuracy']:.3f}\")"
}
base=$(sampled smollm2-135m-instruct)
for seed in "${seeds[@]}"; do
  dir="outputs/bench-learn-seed$seed"
  run_seed grpo_arithmetic "$dir" "$seed"
  greedy=$(grep '^  eval, step 0' "$dir.log" | sed 's/.*accuracy \([0-9.]*\) -> \([0-9.]*\).*/\1 -> \2/')
  last=$(ls -d "$dir"/checkpoints/step_* | tail -1)
  echo "seed $seed: ${wall} s wall | greedy accuracy $greedy | sampled accuracy $base -> $(sampled "$last")"
done
