#!/usr/bin/env bash
# The trainer at long rows on one GPU (bench/train_throughput.py, no engine), in the order that matters most if the
# time runs out: Qwen3-0.6B at 16k tokens a row with chunked log-probs and with the whole micro-batch's logits at once
# (--chunk-mib 1048576, as before chunking); Qwen2.5-1.5B at 16k chunked; Qwen3-0.6B's rows of random lengths at 2k
# padded and packed (train.micro_batch_tokens); Qwen3-0.6B at 2k; Qwen2.5-1.5B at 16k whole and at 2k. Each row
# has the memory plan's figure for the trainer beside the measured peaks. One JSON line per row in
# $OUTDIR/rows.jsonl, each run's log beside it. About 5 minutes on an H200.
#   PYTHON=python3 OUTDIR=/tmp/out bench/gpu_long_rows.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUTDIR=${OUTDIR:-outputs/gpu-long-rows}
mkdir -p "$OUTDIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here')" || exit 2
status=0 n=0
bench() {  # bench ARGS...: one train_throughput.py run, its rows appended to rows.jsonl
  n=$((n + 1))
  timeout -k 10 "${LIMIT:-150}" "$PYTHON" bench/train_throughput.py --steps 2 "$@" > "$OUTDIR/run$n.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || { status=1; echo "run $n ($*): exit $rc, see run$n.log" >&2; tail -4 "$OUTDIR/run$n.log" >&2; }
  grep '^{' "$OUTDIR/run$n.log" >> "$OUTDIR/rows.jsonl"
}
bench --shape qwen3-0.6b --tokens 16384
bench --shape qwen3-0.6b --tokens 16384 --chunk-mib 1048576
bench --shape qwen2.5-1.5b --tokens 16384
bench --shape qwen3-0.6b --tokens 2048 --ragged
bench --shape qwen3-0.6b --tokens 2048 --ragged train.micro_batch_tokens=16384
bench --shape qwen3-0.6b --tokens 2048
bench --shape qwen2.5-1.5b --tokens 16384 --chunk-mib 1048576
bench --shape qwen2.5-1.5b --tokens 2048
"$PYTHON" - "$OUTDIR/rows.jsonl" <<'PY'
import json, sys
print(f"{'shape':13s} {'tokens':>6s} {'chunk MiB':>9s} {'ragged':>6s} {'packed':>6s} {'tokens/s':>9s} {'MFU':>6s} "
      f"{'peak GiB':>8s} {'reserved':>8s} {'planned':>7s}")
for r in map(json.loads, open(sys.argv[1])):
    if "error" in r:
        print(f"{r['shape']:13s} {r['tokens_per_row']:6d} {r['error'][:80]}")
        continue
    packed = any(o.startswith("train.micro_batch_tokens=") for o in r["overrides"])
    print(f"{r['shape']:13s} {r['tokens_per_row']:6d} {r['chunk_mib']:9d} {str(r['ragged']):>6s} {str(packed):>6s} "
          f"{r['train_tokens_per_s']:9.0f} {100 * (r['mfu'] or 0):5.1f}% {r['peak_memory_gib'] or 0:8.2f} "
          f"{r['peak_reserved_gib'] or 0:8.2f} {r['planned_gib']:7.2f}")
PY
exit $status
