"""scripts/slurm_grpo_async.sh run on this machine with stand-ins for ``srun`` (runs the command here) and
``scontrol show hostnames`` (two nodes): the Ray head starts beside the trainer, a Ray worker joins through
``srun``, ``grpo-async.py`` trains on that cluster with ``ray.address=auto``, and nothing of Ray is left."""
import os
import subprocess
from pathlib import Path

from helpers import ROOT, SMALL, failure_excerpt, free_port, metric_rows, needs_ray_and_vllm, ray_processes

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
    port = free_port()  # never the default 6379 of a Ray someone runs here
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "SLURM_JOB_NODELIST": ",".join(nodes),
            "SLURM_SUBMIT_DIR": str(ROOT), "RAY_PORT": str(port), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}



def test_one_node_is_refused_with_one_line(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT)], env=fake_slurm(tmp_path, ["nodeA"]), capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: 1 node(s): the trainer keeps the first 1 (TRAINER_NODES), the actors need at least one more node "
        "(sbatch --nodes=2 or more)"]


@needs_ray_and_vllm
def test_the_slurm_script_trains_on_the_cluster_it_starts(tmp_path):
    run_dir = tmp_path / "run"
    # logging.verbose: Ray's own "Connecting to existing Ray cluster" line is shown
    out = subprocess.run(["bash", str(SCRIPT), *SMALL, "train.total_dialog_turns=24", "logging.verbose=true",
                          f"hydra.run.dir={run_dir}"],
                         env=fake_slurm(tmp_path, ["nodeA", "nodeB"]), capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, failure_excerpt(out)
    assert "2 nodes; 1 rollout actor(s), 0 GPU each; 1 trainer rank(s) on 1 node(s)" in out.stdout
    assert "summary:" in out.stdout
    assert "Connecting to existing Ray cluster" in out.stdout + out.stderr  # ray.address=auto joined it
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == [1, 2, 3]
    assert not ray_processes()


@needs_ray_and_vllm
def test_the_slurm_script_starts_trainer_ranks_on_two_nodes(tmp_path):
    """TRAINER_NODES=2: torchrun on the first two nodes (the second through srun), rank 0 beside the Ray head
    drives the actor on the third node; the two ranks train data-parallel."""
    run_dir = tmp_path / "run"
    env = {**fake_slurm(tmp_path, ["nodeA", "nodeB", "nodeC"]), "TRAINER_NODES": "2", "TRAINER_PORT": str(free_port())}
    out = subprocess.run(["bash", str(SCRIPT), *SMALL, "train.total_dialog_turns=16", f"hydra.run.dir={run_dir}"],
                         env=env, capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, failure_excerpt(out)
    assert "2 nodes; 1 rollout actor(s), 0 GPU each; 2 trainer rank(s) on 2 node(s)" in out.stdout
    assert ("data-parallel training: 2 ranks (FSDP2 over gloo, started by torchrun), this process is rank 0"
            in out.stdout)
    rows = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in rows] == [1, 2] and all(float(r["loss"]) == float(r["loss"]) for r in rows)
    assert not ray_processes()
