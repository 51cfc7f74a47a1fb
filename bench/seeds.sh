# Sourced by the benches that run over seeds (`source bench/seeds.sh "$@"`): in the repository's root, offline,
# with outputs/ made; the arguments split into `seeds` (the numbers; 0 1 2 if none) and `extra` (the rest:
# Hydra overrides for the runs); run_seed runs one seed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1
mkdir -p outputs
seeds=(); extra=()
for arg in "$@"; do if [[ $arg =~ ^[0-9]+$ ]]; then seeds+=("$arg"); else extra+=("$arg"); fi; done
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)

run_seed() {  # $1: config name, $2: run directory (its log: $2.log), $3: the seed (train.seed and env.seed); sets wall
  rm -rf "$2"
  local start; start=$(date +%s)
  .venv/bin/python grpo.py --config-name "$1" train.seed="$3" env.seed="$3" logging.progress_bar=false \
    "${extra[@]}" hydra.run.dir="$2" > "$2.log" 2>&1
  wall=$(( $(date +%s) - start ))
}
