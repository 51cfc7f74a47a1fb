#!/bin/bash
# Async GRPO on a SLURM allocation: a Ray head on the first node, a Ray worker on each other node, then
# grpo-async.py joins that cluster (ray.address=auto). The first node keeps its GPUs for the trainer (the Ray
# head offers none), so the rollout actors, one GPU each, land on the other nodes.
#
#   sbatch --nodes=3 --gpus-per-node=8 scripts/slurm_grpo_async.sh env=gsm_symbolic model=qwen2.5-1.5b-instruct
#
# Arguments are Hydra overrides for grpo-async.py. Environment: ACTORS_PER_NODE (default: the node's GPUs, or 1
# without GPUs), RAY_PORT (default 6379), PYTHON (default .venv/bin/python of this repository). The repository and
# its .venv must be on a filesystem every node sees (the actors import torchrl_grpo from it).
#SBATCH --job-name=grpo-async
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=grpo-async-%j.out

set -euo pipefail

# sbatch runs a copy of this script from a spool folder: find the repository from where it was submitted
ROOT="${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
RAY="$(dirname "$PYTHON")/ray"
PORT="${RAY_PORT:-6379}"
CPUS="${SLURM_CPUS_ON_NODE:-$(nproc)}"
GPUS="${SLURM_GPUS_ON_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}"  # all nodes alike
ACTORS_PER_NODE="${ACTORS_PER_NODE:-$(( GPUS > 0 ? GPUS : 1 ))}"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#NODES[@]} < 2 )); then
    echo "error: ${#NODES[@]} node(s): the trainer keeps the first node, the actors need at least one more (sbatch --nodes=2 or more)" >&2
    exit 2
fi
# this script runs on the first node: the Ray head starts here, beside the trainer
HEAD_IP="$(hostname --ip-address | awk '{print $1}')"  # first address only
export RAY_ADDRESS="$HEAD_IP:$PORT"  # ray.address=auto reads it
# Ray's token authentication, one token for head, workers and trainer (srun passes the environment on); without it
# a head started by `ray start` enables auth with a token in its own ~/.ray that the workers do not send
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')}"
trap '"$RAY" stop --force >/dev/null 2>&1 || true; kill $(jobs -p) 2>/dev/null || true' EXIT  # Ray goes with the job
"$RAY" start --head --node-ip-address="$HEAD_IP" --port="$PORT" --num-cpus="$CPUS" --num-gpus=0 \
    --include-dashboard=false --disable-usage-stats

# --block keeps each worker's `ray start` in the foreground of its srun step, so the step lives as long as Ray
for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS" -w "$node" \
        "$RAY" start --address="$RAY_ADDRESS" --num-cpus="$CPUS" --num-gpus="$GPUS" --disable-usage-stats --block &
done
# wait for every node, so that no actor is scheduled before its GPUs exist
"$PYTHON" - "${#NODES[@]}" <<'EOF'
import sys, time
import ray

ray.init(address="auto", logging_level="ERROR")
deadline = time.time() + 300
while (alive := sum(node["Alive"] for node in ray.nodes())) < int(sys.argv[1]):
    if time.time() > deadline:
        sys.exit(f"error: {alive} of {sys.argv[1]} Ray nodes joined within 300 s")
    time.sleep(2)
ray.shutdown()
EOF

ACTORS=$(( (${#NODES[@]} - 1) * ACTORS_PER_NODE ))
ACTOR_GPUS=$(( GPUS > 0 ? 1 : 0 ))
echo "Ray cluster at $RAY_ADDRESS: ${#NODES[@]} nodes; $ACTORS rollout actor(s), $ACTOR_GPUS GPU each"
"$PYTHON" -u grpo-async.py ray.address=auto ray.num_actors="$ACTORS" ray.actor_num_gpus="$ACTOR_GPUS" "$@"
