# Sourced by the benches that run over seeds (`source bench/seeds.sh "$@"`): in the repository's root, offline,
# with outputs/ made; the arguments split into `seeds` (the numbers; 0 1 2 if none) and `extra` (the rest:
# Hydra overrides for the runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1
mkdir -p outputs
seeds=(); extra=()
for arg in "$@"; do if [[ $arg =~ ^[0-9]+$ ]]; then seeds+=("$arg"); else extra+=("$arg"); fi; done
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
