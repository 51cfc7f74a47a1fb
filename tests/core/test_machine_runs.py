"""The machine's training runs (core/machine_runs.py): a run sees the others that are running, not those that ended
or whose process id another process took since, leaves its own file only while it runs, and says so in one line."""
import json
import os
import subprocess
import sys

from torchrl_grpo.core.machine_runs import live_runs, process_start, registered, sharing_warning


def listing(registry, pid, run_dir, started):
    registry.mkdir(exist_ok=True)
    (registry / f"{pid}.json").write_text(json.dumps({"pid": pid, "run_dir": run_dir, "started": started}))


def test_a_run_sees_the_live_runs_and_drops_the_ended_ones(tmp_path):
    registry = tmp_path / "runs"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        listing(registry, other.pid, "outputs/other", process_start(other.pid))
        listing(registry, ended.pid, "outputs/ended", "123")
        listing(registry, os.getppid(), "outputs/reused", "1")  # a live process, but not the one that was listed
        with registered(tmp_path / "mine", registry) as others:
            assert [(r.pid, r.run_dir) for r in others] == [(other.pid, "outputs/other")]
            assert sorted(p.name for p in registry.iterdir()) == sorted([f"{other.pid}.json", f"{os.getpid()}.json"])
            assert {r.pid for r in live_runs(registry)} == {other.pid, os.getpid()}
        assert [p.name for p in registry.iterdir()] == [f"{other.pid}.json"]  # its own file went with it
        line = sharing_warning(others, 2)
        assert line.startswith(f"warning: 1 other training run(s) on this machine (pid {other.pid} in outputs/other) "
                               "share its 2 CPU core(s): ") and "taskset -c 0" in line and "\n" not in line
        assert sharing_warning([], 2) is None
    finally:
        other.kill()
        other.wait()
    assert live_runs(registry) == []


def test_a_registry_that_cannot_be_written_leaves_the_run_unlisted(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with registered(tmp_path / "mine", blocked / "runs") as others:
        assert others == []
