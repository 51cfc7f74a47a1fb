"""The entry points' memory settings (torchrl_grpo/core/allocator.py): a command re-executed once, in the same process,
with tcmalloc preloaded; glibc's malloc kept when asked for; a bad GRPO_ALLOCATOR refused in one line; oneDNN's
kernel caches bounded, so bf16 matmuls of ever new shapes do not grow the process."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import ROOT
from torchrl_grpo.core.allocator import KERNEL_CACHE_CAPACITIES, find_tcmalloc

# prints its pid and arguments each time it starts, then what the process runs with
PROGRAM = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from torchrl_grpo.core import allocator
    print("start", os.getpid(), sys.argv[1:], flush=True)
    if {broken!r}:
        allocator.find_tcmalloc = lambda: "/nonexistent/libtcmalloc_minimal.so.4"
    allocator.apply_memory_settings()
    print("allocator:", allocator.describe_allocator(), flush=True)
""")


def run_program(tmp_path, allocator=None, broken=False):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.format(root=str(ROOT), broken=broken))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GRPO_ALLOCATOR_REEXECUTED")}
    if allocator is not None:
        env["GRPO_ALLOCATOR"] = allocator
    return subprocess.run([sys.executable, "-u", str(script), "a=1", "--flag"], env=env, capture_output=True,
                          text=True, timeout=60)


def starts(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("start ")]


@pytest.mark.skipif(find_tcmalloc() is None and not os.environ.get("CI"), reason="no tcmalloc (./setup.sh fetches it)")
def test_a_command_runs_again_in_its_own_process_with_tcmalloc(tmp_path):
    """Under CI setup.sh has fetched tcmalloc, so its absence fails here."""
    done = run_program(tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = starts(done.stdout)  # started twice: before and after the re-execution, same pid, same args
    assert first == second and first.endswith("['a=1', '--flag']")
    assert "allocator: tcmalloc" in done.stdout
    assert "large alloc" not in done.stderr


def test_glibc_when_asked(tmp_path):
    done = run_program(tmp_path, allocator="glibc")
    assert done.returncode == 0, done.stderr
    assert len(starts(done.stdout)) == 1
    assert "allocator: glibc malloc (GRPO_ALLOCATOR=glibc)" in done.stdout


def test_a_library_that_does_not_load_is_tried_once(tmp_path):
    """The loader skips a preload it cannot open; the command then goes on with glibc instead of looping."""
    done = run_program(tmp_path, broken=True)
    assert done.returncode == 0, done.stderr
    assert len(starts(done.stdout)) == 2
    assert "allocator: glibc malloc" in done.stdout


def test_a_bad_value_is_one_line_and_exit_2(tmp_path):
    done = run_program(tmp_path, allocator="jemalloc")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: GRPO_ALLOCATOR=jemalloc: use auto (tcmalloc where found) or glibc"


# bf16 forward/backward through a linear layer for 80 new shapes; prints how much malloc'd memory that kept
CACHES_PROGRAM = textwrap.dedent("""
    import ctypes, os, sys
    sys.path.insert(0, {root!r})
    from torchrl_grpo.core import allocator
    allocator.apply_memory_settings()
    import torch

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    layer = torch.nn.Linear(1024, 1024)
    before = in_use()
    for rows in range(8, 88):
        x = torch.randn(rows, 1024, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
    capacities = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"]
    print(*capacities, (in_use() - before) / 2 ** 20)
""")


def kept_by_new_shapes(tmp_path, **env) -> tuple[str, str, float]:
    script = tmp_path / "caches.py"
    script.write_text(CACHES_PROGRAM.format(root=str(ROOT)))
    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, str(script)], env={**base, "GRPO_ALLOCATOR": "glibc", **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    onednn, ideep, mib = done.stdout.split()
    return onednn, ideep, float(mib)


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_bf16_supported()),
                    reason="bf16 matmuls run in oneDNN only on a CPU with AVX-512 BF16 (or AMX)")
def test_kernel_caches_are_bounded_and_a_users_capacity_is_kept(tmp_path):
    """Each new shape leaves ~1.7 MiB in the caches here (buffers sized like the 1024x1024 weight): 80 shapes
    kept 137 MiB with PyTorch's capacities of 1024 (a user's setting is kept) and 28 MiB with ours."""
    *capacities, unbounded = kept_by_new_shapes(tmp_path, ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024",
                                                LRU_CACHE_CAPACITY="1024")
    assert capacities == ["1024", "1024"] and unbounded > 100
    *capacities, bounded = kept_by_new_shapes(tmp_path)
    assert capacities == [KERNEL_CACHE_CAPACITIES["ONEDNN_PRIMITIVE_CACHE_CAPACITY"],
                          KERNEL_CACHE_CAPACITIES["LRU_CACHE_CAPACITY"]]
    assert bounded < unbounded / 3
