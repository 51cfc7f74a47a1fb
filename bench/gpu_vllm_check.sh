#!/usr/bin/env bash
# The project's own loop with vLLM on one GPU (vLLM 0.26 to 0.33 installed beside torch; without network, the GPU
# machine gets vLLM 0.26 as in docs/installation.md#vllm-on-a-gpu-machine-without-network). Parts, one after the other
# (one that fails does not stop the next), within BUDGET_S seconds (default 540; about 8 minutes on an H100):
#  a. grpo.py with train, reference and inference on the one GPU, vLLM in this process, bf16: the learning check of
#     bench/learning_task.sh (reward = share of digit characters, 20 steps), stopped at its step-10 checkpoint and
#     resumed; the weight sync check after every push (the engine-trainer log-prob gap in bf16 on CUDA);
#  b. the GPU default: vLLM's engine in its own process on the same GPU, pushes over the /dev/shm stream (NCCL puts no
#     two ranks on one GPU: weight_transfer=collective must be refused in one line), on a random Qwen3-0.6B-shaped
#     model, 64 prompts x 8 completions x 512 tokens, 2 steps (the digit-share reward: every step trains and pushes):
#     generation and trainer tokens/s, MFU, the share of a step outside both, each role's GPU memory, the sync gap;
#  c. the same engine bare (bench/gpu_vllm_speed.py), with vLLM's CUDA graphs (EAGER=1: also without, 100 s more): its
#     start, llm.generate unseeded and seeded against the loop's generate, the same seeds giving the same tokens.
# Writes $OUTDIR/results.md (default outputs/gpu-vllm-check) and each part's log beside it.
#   bench/gpu_vllm_check.sh
#   PYTHON=python3 GSM8K_DATA=path/to/gsm8k QWEN_TOKENIZER=path/to/qwen2 OUTDIR=/tmp/out bench/gpu_vllm_check.sh
#   ON_CPU=1 bench/gpu_vllm_check.sh    # the same commands on a CPU, parts b and c at a toy size (the script's test)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUTDIR=${OUTDIR:-outputs/gpu-vllm-check}
RESULTS=$OUTDIR/results.md
GSM8K_DATA=${GSM8K_DATA:-../shared/data/gsm8k}
QWEN_TOKENIZER=${QWEN_TOKENIZER:-../shared/data/tokenizers/qwen2}
WORK=${WORK:-/tmp/gpu-vllm-check}
deadline=$((SECONDS + ${BUDGET_S:-540}))
left() { local rest=$((deadline - SECONDS)); echo $(( rest < $1 ? (rest > 5 ? rest : 5) : $1 )); }
mkdir -p "$OUTDIR" "$WORK"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
SIZE=(env.num_envs=64 env.repeats=8 inference_model.max_tokens=512 train.optim_batch_size=16 train.total_dialog_turns=1024)
BARE=(--device cuda:0 --dtype bfloat16)
if [ "${ON_CPU:-0}" = 1 ]; then
  SIZE=(env.num_envs=2 env.repeats=2 inference_model.max_tokens=8 train.optim_batch_size=2 train.total_dialog_turns=12)
  BARE=(--device cpu --dtype float32 --prompts 2 --n 2 --max-tokens 8)
else
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here')" || exit 2
fi
for need in "$GSM8K_DATA" "$QWEN_TOKENIZER"; do [ -d "$need" ] || { echo "$need: no such folder" >&2; exit 2; }; done
status=0
"$PYTHON" - > "$RESULTS" <<'PY' || status=1
import datetime, subprocess, torch, transformers, vllm
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
print(f"# vLLM on a GPU, {datetime.date.today()}, {device}, commit {commit}\n")
print(f"vllm {vllm.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"transformers {transformers.__version__}\n")
PY
report() {  # report PART RUN_DIR...: the runs' metrics.csv as result lines (exit 1 when a check fails)
  "$PYTHON" bench/gpu_vllm_report.py "$@" >> "$RESULTS" || status=1
}

"$PYTHON" bench/import_all.py >> "$RESULTS" 2> "$WORK/imports.log" || status=1
echo -e "\n## a. train, reference and inference on one GPU, vLLM in this process, bf16" >> "$RESULTS"
source bench/learning_task.sh
A=$WORK/a
rm -rf "$A"
run_a() {
  timeout -k 10 "$(left "$1")" "$PYTHON" grpo.py "${LEARN[@]}" inference_model.engine_process=same \
    train.kl_to_ref_coeff=0.001 logging.checkpoint_frequency=10 hydra.run.dir="$A" "${@:2}" >> "$OUTDIR/a.log" 2>&1
}
run_a 170 train.total_dialog_turns=320 && run_a 130 train.total_dialog_turns=640 train.resume=auto \
  || { status=1; echo "- a run failed (exit $?): see a.log" >> "$RESULTS"; }
report learning "$A"

echo -e "\n## b. the engine in its own process on the same GPU, a random Qwen3-0.6B shape, 64 x 8 x 512" >> "$RESULTS"
B=$WORK/b MODEL=$WORK/random-0.6b
rm -rf "$B"
SPEED=(env=gsm8k "env.data_path=$GSM8K_DATA" "${SIZE[@]}" inference_model.engine_process=own logging.progress_bar=false
       logging.checkpoint_frequency=0 "env.rewards=[{_target_:test_learning.digit_share,weight:1.0,name:digits}]")
if [ "${ON_CPU:-0}" != 1 ]; then  # a CPU engine takes the gloo collective
  timeout 60 "$PYTHON" grpo.py model=tiny "${SPEED[@]}" inference_model.weight_transfer=collective \
    hydra.run.dir="$WORK/refused" > "$WORK/refused.log" 2>&1
  echo "- weight_transfer=collective on one GPU: exit $?: \`$(tail -1 "$WORK/refused.log")\`" >> "$RESULTS"
fi
[ -d "$MODEL" ] || timeout -k 10 "$(left 90)" "$PYTHON" bench/gpu_vllm_speed.py model "$MODEL" \
  --tokenizer "$QWEN_TOKENIZER" > "$OUTDIR/b.log" 2>&1
timeout -k 10 "$(left 200)" "$PYTHON" grpo.py "model.name=$MODEL" "${SPEED[@]}" hydra.run.dir="$B" >> "$OUTDIR/b.log" 2>&1 \
  || { status=1; echo "- the run failed (exit $?): see b.log" >> "$RESULTS"; }
report speed "$B"

echo -e "\n## c. the same engine bare, in this process (bench/gpu_vllm_speed.py)" >> "$RESULTS"
for graphs in "" ${EAGER:+--enforce-eager}; do
  timeout -k 10 "$(left 120)" "$PYTHON" bench/gpu_vllm_speed.py bare "$MODEL" "${BARE[@]}" $graphs >> "$OUTDIR/c.log" 2>&1 \
    && echo "- \`$(tail -1 "$OUTDIR/c.log")\`" >> "$RESULTS" \
    || { status=1; echo "- ${graphs:-with CUDA graphs}: failed (exit $?): see c.log" >> "$RESULTS"; }
done
for run in a b; do [ -f "$WORK/$run/metrics.csv" ] && cp "$WORK/$run/metrics.csv" "$OUTDIR/$run-metrics.csv"; done
echo -e "\n$((SECONDS)) s in all" >> "$RESULTS"
cat "$RESULTS"
exit $status
