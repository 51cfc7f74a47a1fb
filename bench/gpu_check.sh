#!/usr/bin/env bash
# The GPU path in one command, on one GPU with torch and transformers (no vLLM needed: the transformers engine).
#  1. every torchrl_grpo module imports (those that need vLLM are listed apart where it is missing);
#  2. train.strategy=fsdp over nccl on one rank, bf16 weights: the learning check of bench/gpu_learning_check.sh
#     (reward = share of digit characters, 20 steps), then the same run stopped at step 10 and resumed from its
#     checkpoint, its steps 11-20 against the straight run's;
#  3. bench/train_throughput.py: the trainer's tokens/s, TFLOP/s and MFU on random Qwen3-0.6B- and
#     Qwen2.5-1.5B-shaped models, rows of 2k and 16k tokens.
# Writes one results file, $RESULTS (default outputs/gpu-check/results.md), and each part's log beside it.
# About 6 minutes on an H200.
#   bench/gpu_check.sh                                   # GSM8K rows from ../shared/data/gsm8k
#   GSM8K_DATA=path/to/gsm8k PYTHON=python3 bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUTDIR=${OUTDIR:-outputs/gpu-check}
RESULTS=${RESULTS:-$OUTDIR/results.md}
GSM8K_DATA=${GSM8K_DATA:-../shared/data/gsm8k}
mkdir -p "$OUTDIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here')" || exit 2
[ -d "$GSM8K_DATA" ] || { echo "GSM8K_DATA=$GSM8K_DATA: no such folder (GSM8K rows as jsonl)" >&2; exit 2; }
status=0
"$PYTHON" - > "$RESULTS" <<'PY'
import datetime, subprocess, torch, transformers
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
print(f"# GPU check, {datetime.date.today()}, {torch.cuda.get_device_name(0)}, commit {commit}\n")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}\n")
PY

echo "## 1. imports" >> "$RESULTS"
"$PYTHON" bench/import_all.py >> "$RESULTS" 2> "$OUTDIR/imports.log" || status=1

echo -e "\n## 2. train.strategy=fsdp, nccl, one rank, bf16: learning, checkpoint and resume" >> "$RESULTS"
source bench/learning_task.sh
run_grpo() {  # run_grpo DIR LOG OVERRIDES...: grpo.py into DIR, its output in LOG
  local dir=$1 log=$2; shift 2
  timeout 240 "$PYTHON" grpo.py "${LEARN[@]}" inference_model.backend=transformers train.strategy=fsdp \
    train_model.num_devices=1 "$@" hydra.run.dir="$dir" >> "$log" 2>&1
}
straight=$OUTDIR/fsdp-straight resumed=$OUTDIR/fsdp-resumed
rm -rf "$straight" "$resumed"
run_grpo "$straight" "$OUTDIR/fsdp-straight.log" train.total_dialog_turns=640 logging.checkpoint_frequency=0 \
  || { status=1; echo "- the straight run failed: see fsdp-straight.log" >> "$RESULTS"; }
run_grpo "$resumed" "$OUTDIR/fsdp-resumed.log" train.total_dialog_turns=320 logging.checkpoint_frequency=10 \
  && run_grpo "$resumed" "$OUTDIR/fsdp-resumed.log" train.total_dialog_turns=640 logging.checkpoint_frequency=10 train.resume=auto \
  || { status=1; echo "- the stopped-and-resumed run failed: see fsdp-resumed.log" >> "$RESULTS"; }
"$PYTHON" - "$straight/metrics.csv" "$resumed/metrics.csv" >> "$RESULTS" <<'PY' || status=1
import csv, os, sys
def rows(path):
    return {int(r["step"]): r for r in csv.DictReader(open(path))} if os.path.exists(path) else {}
straight, resumed = rows(sys.argv[1]), rows(sys.argv[2])
if len(straight) < 20:
    sys.exit(print(f"- the straight run logged {len(straight)} of 20 steps") or 1)
digits = [float(straight[s]["reward/digits"]) for s in sorted(straight)]
first, last = sum(digits[:5]) / 5, sum(digits[-5:]) / 5
print(f"- learning: digit share {first:.3f} over the first 5 steps, {last:.3f} over the last 5: "
      f"{'learns' if last > first + 0.1 else 'DOES NOT LEARN'}")
for key in ("train_tokens_per_s", "mfu", "memory/train/peak_gib"):
    values = [float(straight[s][key]) for s in sorted(straight) if straight[s].get(key)]
    print(f"- {key}: {values[-1]:.4g} at the last step" if values else f"- {key}: not logged")
later = [s for s in sorted(straight) if s > 10]
if not all(s in resumed for s in later):
    sys.exit(print(f"- resume: the resumed run logged steps {sorted(resumed)}, not 11-20") or 1)
gaps = {key: max(abs(float(straight[s][key]) - float(resumed[s][key])) for s in later)
        for key in ("reward", "loss", "grad_norm")}
print(f"- resume from step 10: steps 11-20 against the straight run, largest gaps "
      + ", ".join(f"{k} {v:.3g}" for k, v in gaps.items())
      + (" (bit-identical)" if not any(gaps.values()) else " (CUDA kernels are not bitwise deterministic)"))
sys.exit(0 if last > first + 0.1 else 1)
PY

echo -e "\n## 3. the trainer's throughput (bench/train_throughput.py, the grpo_gsm8k recipe)" >> "$RESULTS"
timeout 420 "$PYTHON" bench/train_throughput.py --shape qwen3-0.6b qwen2.5-1.5b --tokens 2048 16384 \
  --json "$OUTDIR/throughput.json" > "$OUTDIR/throughput.log" 2>&1 || status=1
{ echo '```'; sed -n '/^shape /,$p' "$OUTDIR/throughput.log"; echo '```'; } >> "$RESULTS"
cat "$RESULTS"
exit $status
