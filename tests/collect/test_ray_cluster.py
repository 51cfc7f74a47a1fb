"""grpo-async.py joining a running two-node Ray cluster (``ray.address=<head>``), the way a multi-node job
runs: a head and a second node simulated on this machine by ``ray.cluster_utils.Cluster``, one CPU each, so
that two one-CPU rollout actors can only be placed one per node."""
import os
import signal
import subprocess
import sys

from helpers import ROOT, SMALL, metric_rows, needs_ray_and_vllm, ray_processes, start, wait_until


@needs_ray_and_vllm
def test_async_run_on_a_two_node_cluster_uses_both_nodes(tmp_path):
    from ray.cluster_utils import Cluster

    run_dir = tmp_path / "run"
    node = {"num_cpus": 1, "object_store_memory": 200 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    proc = None
    try:
        second = cluster.add_node(**node)
        cluster.wait_for_nodes()
        assert_null_address_starts_a_private_ray(cluster.address)
        # a long run, stopped (SIGINT: finish the step, checkpoint) once both actors' batches were trained on: the
        # two engines start side by side on this machine's cores and one may take several steps longer
        args = [*SMALL, f"ray.address={cluster.address}", "ray.num_actors=2", "train.max_staleness=2",
                "train.total_dialog_turns=8000", "logging.checkpoint_frequency=0", f"hydra.run.dir={run_dir}"]
        proc = start(args, cwd=tmp_path, script="grpo-async.py")
        wait_until(lambda: {r["actor"] for r in metric_rows(run_dir)} >= {"0.0", "1.0"}
                   or len(metric_rows(run_dir)) >= 900, proc, seconds=300, poll=0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "2 rollout actor(s) started" in out and "summary:" in out
        logged = metric_rows(run_dir)
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


def assert_null_address_starts_a_private_ray(running: str) -> None:
    """``ray.address=null`` with a cluster already running here (and ``RAY_ADDRESS`` naming it, as ``ray start``
    leaves it) starts a Ray of its own with the CPUs it asked for: a bare ``ray.init()`` would join the running
    one and refuse ``num_cpus`` (a leftover ``ray start`` failed every async test that way once)."""
    probe = ("import ray; from omegaconf import OmegaConf; "
             "from torchrl_grpo.collect.rollout_actors import ray_init_kwargs; "
             "from torchrl_grpo.config.placement import Placement, place_actors; "
             "from torchrl_grpo.config.settings import ActorSettings; "
             "cfg = OmegaConf.load('config/mode/async.yaml'); "
             "gpus = place_actors(cfg, Placement(['cpu'], ['cpu'], ['cpu'], shared=True), 0); "
             "ray.init(**ray_init_kwargs(ActorSettings.from_config(cfg, gpus))); "
             "print(ray.get_runtime_context().gcs_address, int(ray.cluster_resources()['CPU'])); ray.shutdown()")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**os.environ, "RAY_ADDRESS": running},
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    address, cpus = out.stdout.split()[-2:]
    assert address != running and cpus == "2"  # its own: 1 actor x 1 CPU + the trainer
