#!/usr/bin/env bash
# Does training learn on a GPU, in each precision? The learning test's task (reward = share of digit
# characters, tests/training/test_learning.py) run through grpo.py on CUDA with bf16 weights, fp32 weights under
# bf16 autocast, and plain fp32; prints the reward over the first and last 5 of 20 steps for each.
# Usage: bench/gpu_learning_check.sh [extra overrides, e.g. inference_model.backend=transformers]
#   the data-parallel path (FSDP2 over nccl, one rank):
#   bench/gpu_learning_check.sh inference_model.backend=transformers train.strategy=fsdp
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p outputs
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here')"
GSM8K_DATA=${GSM8K_DATA:-../shared/data/gsm8k}
source bench/learning_task.sh
for variant in "bf16:" "fp32_weights_bf16_autocast:train_model.torch_dtype=float32" \
               "fp32:train_model.torch_dtype=float32 train.mixed_precision=false"; do
  name=${variant%%:*}; dir="outputs/bench-gpu-$name"
  # shellcheck disable=SC2086  # the variant's overrides split on spaces on purpose
  "$PYTHON" grpo.py "${LEARN[@]}" train.total_dialog_turns=640 logging.checkpoint_frequency=0 ${variant#*:} "$@" \
    hydra.run.dir="$dir" > "$dir.log" 2>&1
  "$PYTHON" - "$name" "$dir/metrics.csv" <<'PY'
import csv, sys
digits = [float(r["reward/digits"]) for r in csv.DictReader(open(sys.argv[2]))]
print(f"{sys.argv[1]:28s} digit share, first 5 steps {sum(digits[:5]) / 5:.3f}, last 5 {sum(digits[-5:]) / 5:.3f}")
PY
done
