"""The entry points' allocator (torchrl_grpo/allocator.py): a command re-executed once, in the same process,
with tcmalloc preloaded; glibc's malloc kept when asked for; a bad GRPO_ALLOCATOR refused in one line."""
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT
from torchrl_grpo.allocator import find_tcmalloc

# prints its pid and arguments each time it starts, then what the process runs with
PROGRAM = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from torchrl_grpo import allocator
    print("start", os.getpid(), sys.argv[1:], flush=True)
    if {broken!r}:
        allocator.find_tcmalloc = lambda: "/nonexistent/libtcmalloc_minimal.so.4"
    allocator.run_with_tcmalloc()
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
