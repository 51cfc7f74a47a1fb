"""A vLLM engine whose process dies mid-run (SIGKILL to its engine core, as a CUDA error or the OOM killer would end
it): grpo.py starts a new engine at once, pushes the trainer's current weights, checks them and goes on. One that
stalls (SIGSTOP: a hung GPU, a deadlock) is killed when a call misses its deadline and counts as dead. After
``inference_model.max_engine_restarts`` the run stops with a checkpoint and one line, no traceback, nothing left."""
import csv
import re
import signal
import time

import psutil

from helpers import FLOAT32, SMALL, needs_vllm, start
from parallel.test_data_parallel import live_in_group


def engine_cores(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "VLLM::EngineCore"]


def steps_logged(run_dir) -> int:
    path = run_dir / "metrics.csv"
    return len(path.read_text().splitlines()) - 1 if path.exists() else 0


@needs_vllm
def test_a_dead_engine_is_replaced_then_the_run_stops_with_a_checkpoint_when_restarts_run_out(tmp_path):
    run_dir = tmp_path / "run"
    proc = start([*SMALL, *FLOAT32, "inference_model.engine_process=own", "inference_model.max_engine_restarts=1",
                  "inference_model.generate_timeout_s=12", "inference_model.push_timeout_s=12",
                  "train.total_dialog_turns=96", "train.entropy_coeff=0.01", "logging.checkpoint_frequency=1",
                  f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    kills, deadline = [], time.time() + 400
    try:
        while proc.poll() is None and time.time() < deadline:
            due = 3 if not kills else kills[-1] + 2  # killed at step 3, stopped two steps after the first restart
            if len(kills) < 2 and steps_logged(run_dir) >= due and (cores := engine_cores(proc.pid)):
                for core in cores:
                    core.send_signal(signal.SIGSTOP if kills else signal.SIGKILL)
                kills.append(steps_logged(run_dir))
            time.sleep(0.2)
        out, err = proc.communicate(timeout=max(1, deadline - time.time()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(kills) == 2, (kills, err[-2000:])
    assert err.count("warning: the vLLM engine's process died (vLLM's EngineDeadError); started a new one with the "
                     "trainer's weights (restart 1 of inference_model.max_engine_restarts=1)") == 1, err[-3000:]
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(r"error: the vLLM engine's process answered no (generate|push) within inference_model\."
                    r"(generate|push)_timeout_s=12 s and was killed; inference_model.max_engine_restarts=1 "
                    r"restart\(s\) used up; stopped", last) and "train.resume=auto" in last, last
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= kills[1]
    restarted = [r for r in rows if r.get("engine_restarts")]
    assert restarted and all(float(r["engine_restarts"]) == 1 for r in restarted)
    # the new engine took the trainer's weights: float32 log-probs as the trainer's after every push
    assert all(float(r["weight_sync_gap"]) < 1e-4 for r in rows if r.get("weight_sync_gap"))
    assert (run_dir / "checkpoints" / f"step_{len(rows):06d}").is_dir()  # the stop's checkpoint, of its last step
    assert live_in_group(proc.pid) == []
