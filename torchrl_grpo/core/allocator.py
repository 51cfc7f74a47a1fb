"""A training process's memory settings, made before torch starts: tcmalloc as its allocator where it is found,
and bounded oneDNN kernel caches.

glibc keeps the freed activations of one micro-batch in pieces that the next micro-batches do not reuse, so its
heap grows while a gigabyte of it lies free. On the comparison workload (docs/benchmarks.md) tcmalloc makes a step
about 25% faster and its peak resident set about 0.4 GiB lower (``bench/step_breakdown.py`` with each). PyTorch's
and vLLM's CPU guides advise it too. A running process cannot change its malloc, so each entry point calls
:func:`apply_memory_settings` before anything else. It re-executes the very command (same process id, arguments
and interpreter options) with tcmalloc in ``LD_PRELOAD``; the processes it starts (the engine's own process, Ray
workers, data-parallel ranks) inherit it. ``./setup.sh`` puts Debian's build in the venv; a system install
(``apt install libtcmalloc-minimal4``, ``dnf install gperftools-libs``) is found too.

``GRPO_ALLOCATOR=glibc`` keeps glibc's malloc; a malloc already in ``LD_PRELOAD`` (jemalloc, ...) is left alone.

On the CPU, bf16 matmuls run in oneDNN, which caches what it builds for each input shape in two caches of 1024
entries: oneDNN's primitive cache and ideep's (PyTorch's oneDNN wrapper). A micro-batch's length is a new shape
almost every step, and an entry holds buffers that grow with the weights' size: with SmolLM2-135M a run's
resident set grew by ~24 MiB a step (0.23 GiB in 10 steps), and would have for hundreds of steps before the
caches filled. :data:`KERNEL_CACHE_CAPACITIES` keeps them a few shapes deep (a micro-batch's forward, recompute and
backward still hit them); a value the user set is kept. Both are read when first used, so setting them in
``os.environ`` before the first matmul is enough, and the processes this one starts inherit them.
"""
from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

LIBRARY = "libtcmalloc_minimal.so.4"
SETUP_COPY = Path(sys.prefix) / "lib" / "tcmalloc" / LIBRARY  # where ./setup.sh puts it
CHOICES = ("auto", "glibc")
_REEXECUTED = "GRPO_ALLOCATOR_REEXECUTED"  # set in the re-executed process: never re-execute twice
KERNEL_CACHE_CAPACITIES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "16"}  # oneDNN's, ideep's


def apply_memory_settings() -> None:
    """Bound the kernel caches, then run this command with tcmalloc (:func:`run_with_tcmalloc`)."""
    for name, capacity in KERNEL_CACHE_CAPACITIES.items():
        os.environ.setdefault(name, capacity)
    run_with_tcmalloc()


def find_tcmalloc() -> str | None:
    """The setup's copy of tcmalloc, else the system's (by soname, which the loader resolves), else None."""
    if SETUP_COPY.is_file():
        return str(SETUP_COPY)
    return ctypes.util.find_library("tcmalloc_minimal")


def run_with_tcmalloc() -> None:
    """Re-execute this command with tcmalloc preloaded, unless it is loaded, was tried, is not found, or
    ``GRPO_ALLOCATOR=glibc``. A value other than auto or glibc exits with one line and code 2."""
    choice = os.environ.get("GRPO_ALLOCATOR", "auto")
    if choice not in CHOICES:
        print(f"error: GRPO_ALLOCATOR={choice}: use auto (tcmalloc where found) or glibc", file=sys.stderr)
        raise SystemExit(2)
    preload = os.environ.get("LD_PRELOAD", "")
    if choice == "glibc" or sys.platform != "linux" or "malloc" in preload or os.environ.get(_REEXECUTED):
        return
    library = find_tcmalloc()
    if library is None:
        return
    env = dict(os.environ, LD_PRELOAD=" ".join(filter(None, [library, preload])), **{_REEXECUTED: "1"})
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(2 ** 40))  # no stderr line per allocation > 1 GiB
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def allocator_in_use() -> str:
    """The malloc this process runs with, read from the libraries mapped into it."""
    if sys.platform != "linux":
        return "the system's malloc"
    mapped = Path("/proc/self/maps").read_text()
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if f"lib{name}" in mapped:
            return name
    return "glibc malloc"


def describe_allocator() -> str:
    """The console's ``allocator:`` line: which malloc, and how to get tcmalloc when it is not the one."""
    name = allocator_in_use()
    if name != "glibc malloc":
        return name
    if os.environ.get("GRPO_ALLOCATOR") == "glibc":
        return "glibc malloc (GRPO_ALLOCATOR=glibc)"
    if find_tcmalloc() is not None:
        return "glibc malloc (tcmalloc is preloaded by grpo.py, grpo-async.py and evaluate.py; not by this program)"
    return ("glibc malloc: tcmalloc not found (./setup.sh fetches it on Debian, or `apt install "
            "libtcmalloc-minimal4`): on the CPU a step is ~25% slower and peaks ~0.4 GiB higher (docs/benchmarks.md)")
