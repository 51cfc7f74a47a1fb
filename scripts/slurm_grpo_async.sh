#!/bin/bash
# Async GRPO on a SLURM allocation: a Ray head on the first node, a Ray worker on each node that does not train,
# then grpo-async.py joins that cluster (ray.address=auto). The first TRAINER_NODES nodes keep their GPUs for the
# trainer (the Ray head offers none), so the rollout actors, one GPU each, land on the other nodes.
#
#   sbatch --nodes=3 --gpus-per-node=8 scripts/slurm_grpo_async.sh env=gsm_symbolic model=qwen2.5-1.5b-instruct
#   # 16 data-parallel trainer ranks (FSDP2) on the first 2 nodes, actors on the other 2:
#   TRAINER_NODES=2 TRAINER_RANKS_PER_NODE=8 sbatch --nodes=4 --gpus-per-node=8 scripts/slurm_grpo_async.sh \
#       train.strategy=fsdp model=qwen2.5-3b
#
# Arguments are Hydra overrides for grpo-async.py. Environment: TRAINER_NODES (default 1) and
# TRAINER_RANKS_PER_NODE (default 1): more than one rank in all starts them with torchrun (rank 0, on the first
# node, drives the actors; the others follow it); TRAINER_PORT (default 29500) their rendezvous port on the first
# node; ACTORS_PER_NODE (default: the node's GPUs, or 1 without GPUs), RAY_PORT (default 6379), PYTHON (default
# .venv/bin/python of this repository). The repository, its .venv and the run directory must be on a filesystem
# every node sees (the actors import torchrl_grpo from it; every trainer rank writes its optimizer shards).
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
TRAINER_NODES="${TRAINER_NODES:-1}"
TRAINER_RANKS_PER_NODE="${TRAINER_RANKS_PER_NODE:-1}"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#NODES[@]} <= TRAINER_NODES )); then
    echo "error: ${#NODES[@]} node(s): the trainer keeps the first $TRAINER_NODES (TRAINER_NODES), the actors need at least one more node (sbatch --nodes=$(( TRAINER_NODES + 1 )) or more)" >&2
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
for node in "${NODES[@]:TRAINER_NODES}"; do
    srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS" -w "$node" \
        "$RAY" start --address="$RAY_ADDRESS" --num-cpus="$CPUS" --num-gpus="$GPUS" --disable-usage-stats --block &
done
# wait for every node, so that no actor is scheduled before its GPUs exist
"$PYTHON" - "$(( ${#NODES[@]} - TRAINER_NODES + 1 ))" <<'EOF'
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

ACTORS=$(( (${#NODES[@]} - TRAINER_NODES) * ACTORS_PER_NODE ))
ACTOR_GPUS=$(( GPUS > 0 ? 1 : 0 ))
RANKS=$(( TRAINER_NODES * TRAINER_RANKS_PER_NODE ))
echo "Ray cluster at $RAY_ADDRESS: $(( ${#NODES[@]} - TRAINER_NODES + 1 )) nodes; $ACTORS rollout actor(s), $ACTOR_GPUS GPU each; $RANKS trainer rank(s) on $TRAINER_NODES node(s)"
ARGS=(grpo-async.py ray.address=auto ray.num_actors="$ACTORS" ray.actor_num_gpus="$ACTOR_GPUS" "$@")
if (( RANKS == 1 )); then
    "$PYTHON" -u "${ARGS[@]}"
    exit
fi
# torchrun on each trainer node with a static rendezvous on the first: node rank 0 here, so global rank 0 (which
# drives the actors) runs beside the Ray head; the ranks on the other trainer nodes follow it
TORCHRUN=("$PYTHON" -u -m torch.distributed.run --nnodes="$TRAINER_NODES" --nproc-per-node="$TRAINER_RANKS_PER_NODE"
          --master-addr="$HEAD_IP" --master-port="${TRAINER_PORT:-29500}")
for (( i = 1; i < TRAINER_NODES; i++ )); do
    srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS" -w "${NODES[$i]}" "${TORCHRUN[@]}" --node-rank="$i" "${ARGS[@]}" &
done
"${TORCHRUN[@]}" --node-rank=0 "${ARGS[@]}"
