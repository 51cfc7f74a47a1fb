"""grpo-async.py joining a running two-node Ray cluster (``ray.address=<head>``), the way a multi-node job
runs: a head and a second node simulated on this machine by ``ray.cluster_utils.Cluster``, one CPU each, so
that two one-CPU rollout actors can only be placed one per node."""
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "env=gsm_symbolic", "env.size=64", "env.num_envs=2", "env.repeats=4",
         "train.optim_batch_size=4", "train.gradient_accumulation_steps=2", "inference_model.max_tokens=8",
         "logging.progress_bar=false", "optimizer.lr=1e-3"]


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def ray_processes() -> str:
    """Ray's daemons still alive on this machine; they go within a moment of a shutdown."""
    out = ""
    for _ in range(40):
        out = subprocess.run(["pgrep", "-fa", "raylet|gcs_server"], capture_output=True, text=True).stdout
        if not out.strip():
            return ""
        time.sleep(0.5)
    return out


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.skipif(not (_importable("ray") and _importable("vllm")), reason="ray or vllm is not importable here")
def test_async_run_on_a_two_node_cluster_uses_both_nodes(tmp_path):
    from ray.cluster_utils import Cluster

    run_dir = tmp_path / "run"
    node = {"num_cpus": 1, "object_store_memory": 200 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    proc = None
    try:
        second = cluster.add_node(**node)
        cluster.wait_for_nodes()
        # a long run, stopped (SIGINT: finish the step, checkpoint) once both actors' batches were trained on: the
        # two engines start side by side on this machine's cores and one may take several steps longer
        args = [*SMALL, f"ray.address={cluster.address}", "ray.num_actors=2", "train.max_staleness=2",
                "train.total_dialog_turns=8000", "logging.checkpoint_frequency=0", f"hydra.run.dir={run_dir}"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, str(ROOT / "grpo-async.py"), *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if {r["actor"] for r in rows(run_dir)} >= {"0.0", "1.0"} or len(rows(run_dir)) >= 900:
                break
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "2 rollout actor(s) started" in out and "summary:" in out
        logged = rows(run_dir)
        assert f"stopped after step {len(logged)}" in out
        assert {int(float(r["actor"])) for r in logged} == {0, 1}  # both actors' batches were trained on
        assert all(float(r["staleness"]) <= 2 for r in logged)
        actors = [a for a in cluster.global_state.actor_table(None).values() if a["ActorClassName"] == "RolloutActor"]
        assert len(actors) == 2 and all(a["State"] == "DEAD" for a in actors)  # the trainer killed them at the end
        assert {a["Address"]["NodeID"] for a in actors} == {cluster.head_node.node_id, second.node_id}
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        cluster.shutdown()
    assert not ray_processes()
