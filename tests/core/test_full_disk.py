"""A disk that cannot take a write (torchrl_grpo/core/files.py, core/checkpoint.py), made with a file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG, as one on a full disk fails with ENOSPC): the
run stops with one line naming the file, the space left and the space needed; earlier checkpoints stay whole,
none is left half written, metrics and samples never end mid-line, and the run resumes once there is room."""
import csv
import os
import resource
import signal
import subprocess
import sys

from helpers import FLOAT32, ROOT, SCRIPT_ENV, SMALL, metric_rows, needs_vllm, run
from torchrl_grpo.core.checkpoint import damage, list_checkpoints


def file_size_limit(limit: int):
    """A preexec_fn: the child's files cannot grow past ``limit`` bytes."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # stays ignored across exec: writes fail instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_appended_lines_are_whole_or_absent(tmp_path):
    """Lines of 30 bytes appended to a file limited to 100: three fit, the fourth fails and leaves nothing."""
    code = ("import sys\nfrom pathlib import Path\nfrom torchrl_grpo.core.files import NotWritten, append_whole\n"
            "path = Path(sys.argv[1])\n"
            "for i in range(10):\n"
            "    try:\n"
            "        append_whole(path, f'{i:029d}\\n')\n"
            "    except NotWritten as err:\n"
            "        print(err)\n"
            "        break\n")
    path = tmp_path / "lines.txt"
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                          preexec_fn=file_size_limit(100), timeout=60)
    assert done.returncode == 0, done.stderr
    assert path.read_text() == "".join(f"{i:029d}\n" for i in range(3))
    assert done.stdout.startswith(f"{path} could not be written (OSError: [Errno 27] File too large") \
        and "free there)" in done.stdout


@needs_vllm
def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_it_resumes(tmp_path):
    """Step 1 checkpointed, then the run resumed with files limited to 1 MB (the tiny model's weights take 1.8 MB):
    step 2's checkpoint fails, the run stops in one line, step 1's checkpoint is whole and resumes."""
    run_dir = tmp_path / "run"
    args = [*SMALL, *FLOAT32, "logging.checkpoint_frequency=1", f"hydra.run.dir={run_dir}"]
    first = run([*args, "train.total_dialog_turns=8"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    full = subprocess.run([sys.executable, str(ROOT / "grpo.py"), *args, "train.total_dialog_turns=24",
                           "train.resume=auto"], cwd=tmp_path, env={**os.environ, **SCRIPT_ENV}, capture_output=True,
                          text=True, timeout=300, preexec_fn=file_size_limit(1_000_000))
    assert full.returncode == 1, full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    step2 = run_dir / "checkpoints" / "step_000002"
    assert last.startswith(f"error: {step2} could not be written (SafetensorError: "), last
    step1 = run_dir / "checkpoints" / "step_000001"
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(step1) for f in files)
    assert "File too large" in last and f" free there, about {size / 2**20:.1f} MiB needed)" in last  # step 1's size
    assert last.endswith(f"needed); stopped: free some space, then continue with train.resume=auto "
                         f"hydra.run.dir={run_dir}"), last
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_000001"]
    assert damage(step1) is None
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    with open(run_dir / "metrics.csv", newline="") as f:  # every row whole: as many cells as the header
        rows = list(csv.reader(f))
    assert len(rows) >= 2 and all(len(r) == len(rows[0]) for r in rows)
    again = run([*args, "train.total_dialog_turns=24", "train.resume=auto"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {step1} (step 1)" in again.stdout
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == [1, 2, 3]
