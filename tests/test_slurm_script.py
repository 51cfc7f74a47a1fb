"""scripts/slurm_grpo_async.sh run on this machine with stand-ins for ``srun`` (runs the command here) and
``scontrol show hostnames`` (two nodes): the Ray head starts beside the trainer, a Ray worker joins through
``srun``, ``grpo-async.py`` trains on that cluster with ``ray.address=auto``, and nothing of Ray is left."""
import os
import socket
import subprocess
from pathlib import Path

from helpers import ROOT, SMALL, metric_rows, needs_ray_and_vllm, ray_processes

SCRIPT = ROOT / "scripts" / "slurm_grpo_async.sh"
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do case "$1" in -w) shift 2;; *) shift;; esac; done
exec "$@"
"""


def fake_slurm(tmp_path: Path, nodes: list[str]) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf '%s\\n' " + " ".join(nodes) + "\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    with socket.socket() as s:  # a free port: never the default 6379 of a Ray someone runs here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "SLURM_JOB_NODELIST": ",".join(nodes),
            "SLURM_SUBMIT_DIR": str(ROOT), "RAY_PORT": str(port), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}


def test_one_node_is_refused_with_one_line(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT)], env=fake_slurm(tmp_path, ["nodeA"]), capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: 1 node(s): the trainer keeps the first node, the actors need at least one more "
        "(sbatch --nodes=2 or more)"]


@needs_ray_and_vllm
def test_the_slurm_script_trains_on_the_cluster_it_starts(tmp_path):
    run_dir = tmp_path / "run"
    # logging.verbose: Ray's own "Connecting to existing Ray cluster" line is shown
    out = subprocess.run(["bash", str(SCRIPT), *SMALL, "train.total_dialog_turns=24", "logging.verbose=true",
                          f"hydra.run.dir={run_dir}"],
                         env=fake_slurm(tmp_path, ["nodeA", "nodeB"]), capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 nodes; 1 rollout actor(s), 0 GPU each" in out.stdout and "summary:" in out.stdout
    assert "Connecting to existing Ray cluster" in out.stdout + out.stderr  # ray.address=auto joined it
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == [1, 2, 3]
    assert not ray_processes()
