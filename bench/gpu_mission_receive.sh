#!/usr/bin/env bash
# On the GPU machine: keep part NN of bench/gpu_mission_pack.sh's payload (sent as .gpu/missionNN) in /tmp/mission_parts,
# checked against its sha256; once all are there, join them, check the whole, and install the wheels with
# `pip install --no-index --no-deps --target /tmp/site` (where ../shared/gpu-offline/install.sh put vLLM) and the
# arithmetic rows in /tmp/site/arith, the Qwen2 tokenizer in /tmp/site/qwen2-tokenizer. Prints what is still missing.
#   bash bench/gpu_mission_receive.sh 01
set -euo pipefail
cd "$(dirname "$0")/.."
k=${1:?usage: gpu_mission_receive.sh NN}
STORE=/tmp/mission_parts SITE=${SITE:-/tmp/site}
mkdir -p "$STORE" "$SITE"
(cd ".gpu/mission$k" && sha256sum -c --quiet "SHA256SUMS.part$k") || { echo "part $k: checksum mismatch" >&2; exit 1; }
cp ".gpu/mission$k/mission.tar.part$k" "$STORE/"
n=$(cat .gpu/bin/NPARTS.mission)
missing=$(for i in $(seq -w 1 "$n"); do [ -f "$STORE/mission.tar.part$(printf %02d "$((10#$i))")" ] || echo -n "$i "; done)
if [ -n "$missing" ]; then echo "part $k kept; still missing: $missing"; exit 0; fi
if [ -f "$SITE/.mission-installed" ]; then echo "installed already"; exit 0; fi
cat "$STORE"/mission.tar.part* > "$STORE/mission.tar"
(cd "$STORE" && sha256sum -c --quiet "$OLDPWD/.gpu/bin/SHA256SUMS.mission") || { echo "payload: checksum mismatch" >&2; exit 1; }
tar -C "$STORE" -xf "$STORE/mission.tar"
(cd "$STORE/wheels" && sha256sum -c --quiet SHA256SUMS.wheels)
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$STORE"/wheels/*.whl
rm -rf "$SITE/arith" "$SITE/qwen2-tokenizer" && cp -r "$STORE/arith" "$STORE/qwen2-tokenizer" "$SITE/"
touch "$SITE/.mission-installed"
echo "installed $(ls "$STORE"/wheels/*.whl | wc -l) wheels into $SITE; arithmetic rows in $SITE/arith, the Qwen2 tokenizer in $SITE/qwen2-tokenizer"
