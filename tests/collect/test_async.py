"""grpo-async.py as users run it (real subprocess, Hydra, Ray, the tiny model, the vLLM CPU engine in a Ray
actor), its fault path, and the small pure-Python pieces of torchrl_grpo/run/state.py and rollout_actors.py."""
import json
import logging
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from helpers import (
    CONFIG_DIR,
    FLOAT32,
    ROOT,
    SMALL,
    cfg_with,
    failure_excerpt,
    finite,
    metric_rows,
    needs_ray,
    needs_ray_and_vllm,
    preempted,
    ray_processes,
    run_async,
    start,
    wait_until,
)
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.checkpoint import Key, load_state
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.trajectories import PromptSampler


@needs_ray_and_vllm
def test_async_trains_within_the_staleness_bound_then_resumes(tmp_path):
    """The first run also evaluates, in the trainer (the transformers engine over the trained policy): eval/ rows
    at steps 0 (before training), 3 and 4 (the last). The resumed run is stopped with Ctrl-C once it has trained
    two steps: it finishes the step, checkpoints it and leaves no Ray."""
    run_dir = tmp_path / "run"
    args = [*SMALL, *FLOAT32, "train.kl_to_ref_coeff=0.05", "loss.old_log_probs=trainer", f"hydra.run.dir={run_dir}"]
    started = time.time()
    # a per-completion objective on stale batches (GMPO); the resumed run REINFORCE++ with its KL in the reward
    first = run_async([*args, "loss=gmpo", "train.total_dialog_turns=32", "logging.checkpoint_frequency=2",
                       "logging.eval_frequency=3", "eval.num_prompts=3"], cwd=tmp_path)
    print(f"async e2e run: {time.time() - started:.1f} s")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rollout actor(s) started" in first.stdout and "summary:" in first.stdout
    assert "step(s) over gloo" in first.stdout  # inference_model.weight_transfer=auto
    assert "weight sync check: engine and trainer log-probs" in first.stdout
    # the actor's vLLM start-up noise and Ray's own lines go to the actor's log in the run dir, not the console
    assert "doesn't allow to use `torch.set_num_threads`" not in first.stdout + first.stderr
    assert "Warning: NUMA binding" not in first.stdout + first.stderr
    assert "Started a local Ray instance" not in first.stderr
    assert "][vllm.v1.worker.cpu_worker][WARNING] - " in (run_dir / "rollout_actor_0.log").read_text()
    assert not ray_processes()
    table = metric_rows(run_dir)
    assert [r["step"] for r in table] == ["0", "1", "2", "3", "4"]  # step 0: the evaluation before training
    assert [r["step"] for r in table if r.get("eval/accuracy") not in (None, "")] == ["0", "3", "4"]
    assert [float(r["eval/prompts"]) for r in table if r.get("eval/prompts")] == [3, 3, 3]
    logged = table[1:]
    for key in ("staleness", "staleness_max", "policy_version", "trainer_version", "stale_dropped", "batch_wait_time",
                "reward", "loss_objective", "kl_to_ref", "engine_trainer_logp_gap_max", "grad_norm"):
        assert all(finite(r[key]) for r in logged), key
    for r in logged:
        assert 0 <= float(r["staleness"]) <= 1  # train.max_staleness=1 (config/mode/async.yaml)
        assert float(r["staleness"]) == float(r["trainer_version"]) - float(r["policy_version"])
    assert float(logged[0]["staleness"]) == 0  # the first batch comes from the starting weights
    assert max(float(r["policy_version"]) for r in logged) >= 1  # pushed weights reached the actor
    gaps = [float(r["weight_sync_gap"]) for r in logged if r["weight_sync_gap"]]
    assert gaps and all(g < 1e-4 for g in gaps)  # and the actor checked them against the trainer's probe
    saved = run_dir / "checkpoints" / "step_000004"
    assert (saved / "model.safetensors").is_file() and (saved / "trainer_state.pt").is_file()

    # resume with a staleness bound of 0: the batch sampled while a step trained is one version behind and is
    # dropped (counted), so every trained batch is on-policy; and with the KL penalty in the reward, which the
    # trainer adds to the actors' batches as in sync mode. A long run, no checkpoints but the one Ctrl-C makes
    proc = start([*args, "loss=reinforce_pp", "train.total_dialog_turns=4000", "logging.checkpoint_frequency=0",
                  "train.resume=auto", "train.max_staleness=0", "train.kl_coef_in_loss=false"], cwd=tmp_path,
                 script="grpo-async.py")
    wait_until(lambda: len(metric_rows(run_dir)) >= 7, proc, seconds=180)  # the step-0 row and steps 1 to 6
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in out and "step_000004" in out
    logged = metric_rows(run_dir)[1:]
    stopped_at = len(logged)
    assert 6 <= stopped_at < 500 and f"stopped after step {stopped_at}" in out
    assert [int(float(r["step"])) for r in logged] == list(range(1, stopped_at + 1))
    assert (run_dir / "checkpoints" / f"step_{stopped_at:06d}" / "trainer_state.pt").is_file()
    assert all(float(r["staleness"]) == 0 for r in logged[4:])
    assert float(logged[-1]["stale_dropped"]) >= 1
    assert all(finite(r["kl_penalty_in_reward"]) for r in logged[4:]) and not logged[0]["kl_penalty_in_reward"]
    assert not ray_processes()


@needs_ray
def test_preempted_at_each_point_an_async_run_stops_with_a_checkpoint_and_resumes(tmp_path):
    """A scheduler's preemption signals every process of the job: the trainer, Ray's daemons, the rollout actors.
    SIGTERM while an actor generates its third batch, then SIGKILL while the next step's checkpoint is written,
    then (resumed) SIGTERM in the second optimizer step: each SIGTERM ends the run with 0 within the grace and a
    checkpoint of the last step the trainer holds (pushes stop with the signal: Ray ends a driver whose object
    store goes away under a put), the SIGKILL leaves a partial checkpoint that resume skips, and no process of the
    run is left after any of them. Then a second SIGKILL at a random generation, and the run resumed to its end: its
    10 steps used each of the 10 prompts exactly twice (two epochs), none lost or repeated through the five starts.
    The transformers engine in the actor: cheap starts."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    args = [*(a for a in SMALL if not a.startswith("env.size=")), "env.size=10", "inference_model.backend=transformers",
            "train.entropy_coeff=0.01", "train.total_dialog_turns=80", "logging.checkpoint_frequency=1",
            "logging.keep_checkpoints=0", "logging.samples_frequency=1", f"hydra.run.dir={run_dir}",
            "train.resume=auto"]

    def saved():
        return [int(p.name.removeprefix("step_")) for p in sorted(checkpoints.glob("step_*"))]

    done, grace_out = preempted(args, "generation", 3, "SIGTERM", cwd=tmp_path, script="grpo-async.py")
    assert done.returncode == 0 and not grace_out, failure_excerpt(done)
    first = saved()[-1]
    assert f"stopped after step {first}" in done.stdout and 1 <= first <= 3, done.stdout[-2000:]
    assert saved() == list(range(1, first + 1)) == [int(float(r["step"])) for r in metric_rows(run_dir)]
    done, _ = preempted(args, "checkpoint_write", 1, "SIGKILL", cwd=tmp_path, script="grpo-async.py")
    assert done.returncode == -9 and saved()[-1] == first
    assert list(checkpoints.glob(f".tmp_step_{first + 1:06d}_*"))
    done, grace_out = preempted(args, "optimizer_step", 2, "SIGTERM", cwd=tmp_path, script="grpo-async.py")
    assert done.returncode == 0 and not grace_out, failure_excerpt(done)
    assert f"resumed from {checkpoints / f'step_{first:06d}'}" in done.stdout
    assert f"stopped after step {first + 2}" in done.stdout and saved()[-1] == first + 2
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == list(range(1, first + 3))
    assert not ray_processes()
    nth = random.Random().randint(1, 3)  # the generation the second SIGKILL lands in, after the resume
    done, _ = preempted(args, "generation", nth, "SIGKILL", cwd=tmp_path, script="grpo-async.py")
    assert done.returncode == -9, (nth, failure_excerpt(done))
    done = run_async(args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, (nth, failure_excerpt(done))
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == list(range(1, 11))
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == list(range(1, 11))
    uses = Counter(s["prompt"] for s in samples)  # 4 completions a use
    assert len(uses) == 10 and set(uses.values()) == {2 * 4}, (nth, uses)
    assert not ray_processes()


@needs_ray_and_vllm
def test_a_streaming_run_trains_across_pushes_and_resumes_a_kill_with_no_prompt_lost_or_used_twice(tmp_path):
    """ray.streaming=true: the actor keeps its groups in flight across pushes, checked against the trainer's probe
    after each, every trained batch within the staleness bound (a group past it is dropped, its prompt opened
    again). SIGKILL to every process at a random decoding step of the actor, then the run resumed to its end: the
    prompts it trained on and those its last checkpoint holds open (in flight, queued, waiting or dropped) are, to
    the prompt, those its sampler drew: none lost, none used twice within an epoch (groups finish out of order, so
    an epoch's last prompts may train after the next epoch's first)."""
    run_dir = tmp_path / "run"
    args = [*(a for a in SMALL if not a.startswith("env.size=")), "env.size=10", *FLOAT32, "ray.streaming=true",
            "train.entropy_coeff=0.01", "train.total_dialog_turns=80", "logging.checkpoint_frequency=1",
            "logging.keep_checkpoints=0", "logging.samples_frequency=1", f"hydra.run.dir={run_dir}",
            "train.resume=auto"]
    nth = random.Random().randint(2, 9)  # the actor's decoding calls (about one a step): a kill within its first steps
    done, _ = preempted(args, "generation", nth, "SIGKILL", cwd=tmp_path, script="grpo-async.py")
    assert done.returncode == -9, (nth, failure_excerpt(done))
    killed_at = len(metric_rows(run_dir))
    done = run_async(args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, (nth, failure_excerpt(done))
    assert "weight sync check: engine and trainer log-probs" in done.stdout
    rows = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in rows] == list(range(1, 11)), (nth, killed_at)
    assert all(0 <= float(r["staleness"]) <= 1 for r in rows)
    assert sum(float(r["stream/generated_tokens"]) for r in rows) >= 10 * 8 * 8  # a step's groups may have waited
    assert max(float(r["policy_version"]) for r in rows) >= 1  # pushed weights sampled later batches
    gaps = [float(r["weight_sync_gap"]) for r in rows if r["weight_sync_gap"]]
    assert gaps and all(g < 1e-4 for g in gaps)  # scored beside the requests in flight
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == list(range(1, 11))
    task, _ = build_episode_task(resolve_run(cfg_with("model=tiny", "env=gsm_symbolic", "env.size=10")).task)
    index = {task.prompt_text(row): i for i, row in enumerate(task.rows)}
    trained = Counter({index[prompt]: n // 4 for prompt, n in Counter(s["prompt"] for s in samples).items()})
    assert sum(trained.values()) == 20, trained
    [position] = load_state(run_dir / "checkpoints" / "step_000010")[Key.SAMPLER]["actor_samplers"]
    state = position["sampler"]  # what its sampler drew: whole epochs, then the current one's first prompts
    drawn = Counter(PromptSampler(10, state["seed"]).take(state["epoch"] * 10 + state["position"]))
    assert trained + Counter(position["open"]) == drawn, (nth, killed_at, trained, position)
    assert not ray_processes()


@needs_ray_and_vllm
def test_a_dying_actor_is_replaced_with_the_current_weights_until_restarts_run_out(tmp_path):
    run_dir = tmp_path / "run"
    # every incarnation of the actor os._exit(1)s at its 3rd collect. The first delivers steps 1 and 2 and dies
    # while step 2 trains; its replacement must start from the weights pushed after step 2 (version 2: step 3
    # is on-policy, where the base weights would be 2 versions stale and dropped), delivers steps 3 and 4 and
    # dies too; with ray.max_actor_restarts=1 that stops the run with one line and a checkpoint of step 4.
    # an entropy bonus: every step updates (the tiny model's rewards tie), so that weights are pushed after each
    crashed = run_async([*SMALL, "loss=cispo", "train.entropy_coeff=0.01", "train.total_dialog_turns=80",
                         "logging.checkpoint_frequency=0",
                         "ray.max_actor_restarts=1", f"hydra.run.dir={run_dir}",
                         "+ray.init.runtime_env.worker_process_setup_hook=actor_faults.exit_at_third_collect"],
                        cwd=tmp_path, timeout=300, env_extra={"PYTHONPATH": str(Path(__file__).parents[1])})
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    warnings = [line for line in crashed.stderr.splitlines() if line.startswith("warning: rollout actor 0 died")]
    assert (len(warnings) == 1
            and "restarted with policy version 2 (restart 1 of ray.max_actor_restarts=1)" in warnings[0])
    last = [line for line in crashed.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: rollout actor 0 died during collect (") and "\n" not in last
    assert "ray.max_actor_restarts=1 restart(s) used up" in last and "checkpoint of step 4 saved" in last
    assert (run_dir / "checkpoints" / "step_000004" / "trainer_state.pt").is_file()
    logged = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in logged] == [1, 2, 3, 4]
    assert [int(float(r["actor_restarts"])) for r in logged] == [0, 0, 1, 1]
    assert float(logged[2]["policy_version"]) == float(logged[2]["trainer_version"]) == 2
    assert all(float(r["stale_dropped"]) == 0 for r in logged)
    assert not ray_processes()


@needs_ray
def test_a_stalled_actor_stops_the_run_in_one_line_at_the_collect_deadline(tmp_path):
    """The actor stops answering at its third collect, alive (a hung engine): past ray.collect_timeout_s the run
    stops with one line naming the actor and the key, and a checkpoint of the last step; nothing is left running."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    stalled = run_async([*SMALL, "inference_model.backend=transformers", "train.total_dialog_turns=80",
                         "logging.checkpoint_frequency=0", "ray.collect_timeout_s=20", f"hydra.run.dir={run_dir}",
                         "+ray.init.runtime_env.worker_process_setup_hook=actor_faults.stall_at_third_collect"],
                        cwd=tmp_path, timeout=300, env_extra={"PYTHONPATH": str(Path(__file__).parents[1])})
    assert stalled.returncode == 1, stalled.stderr[-3000:]
    last = [line for line in stalled.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: no batch from rollout actor(s) 0 within ray.collect_timeout_s=20 s"), last
    assert "checkpoint of step 2 saved" in last
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == [1, 2]
    assert time.monotonic() - t0 < 200
    assert not ray_processes()


def test_async_state_resumes_sync_and_async_checkpoints():
    from torchrl_grpo.run.state import AsyncProgress

    state = AsyncProgress(2)
    state.load_state_dict({"size": 64, "seed": 0, "epoch": 1, "position": 5})  # a sync checkpoint's sampler
    assert state.actor_samplers == [{"size": 64, "seed": 0, "epoch": 1, "position": 5}, None]
    assert state.policy_version == 0
    saved = {"actor_samplers": [{"position": 1}, {"position": 2}, {"position": 3}], "policy_version": 7,
             "stale_dropped": 2, "staleness_max": 1}
    fewer = AsyncProgress(2)
    fewer.load_state_dict(saved)  # resumed with fewer actors: the extra state is ignored
    assert fewer.actor_samplers == [{"position": 1}, {"position": 2}] and fewer.policy_version == 7
    assert fewer.state_dict()["stale_dropped"] == 2


def actor_settings(cfg):
    """The ``ray`` keys of ``cfg`` (mode/async.yaml alone) for actors on a machine without GPUs."""
    from torchrl_grpo.config.placement import Placement, place_actors
    from torchrl_grpo.config.settings import ActorSettings

    return ActorSettings.from_config(cfg, place_actors(cfg, Placement(["cpu"], ["cpu"], ["cpu"], shared=True), 0))


def test_ray_init_arguments():
    from torchrl_grpo.collect.rollout_actors import ray_init_kwargs

    cfg = OmegaConf.load(CONFIG_DIR / "mode" / "async.yaml")
    local = ray_init_kwargs(actor_settings(cfg))
    assert local["address"] == "local" and local["num_cpus"] == 2  # 1 actor x 1 CPU + the trainer
    assert str(ROOT) in local["runtime_env"]["env_vars"]["PYTHONPATH"].split(os.pathsep)  # torchrl_grpo's parent
    assert local["logging_level"] == logging.ERROR  # Ray's start-up lines off the console (logging.verbose)
    assert local["runtime_env"]["env_vars"]["TORCH_CPP_LOG_LEVEL"] == "ERROR"  # torch's printed C++ warnings too
    cfg.ray.address = "auto"
    cfg.ray.init.num_cpus = 8
    joined = ray_init_kwargs(actor_settings(cfg))
    assert joined["address"] == "auto" and "num_cpus" not in joined and "dashboard_host" not in joined


def test_a_local_ray_has_no_dashboard_and_binds_an_asked_for_one_to_localhost():
    from torchrl_grpo.collect.rollout_actors import ray_init_kwargs

    cfg = OmegaConf.load(CONFIG_DIR / "mode" / "async.yaml")
    local = ray_init_kwargs(actor_settings(cfg))
    assert local["include_dashboard"] is False and local["dashboard_host"] == "127.0.0.1"
    cfg.ray.init.include_dashboard = True
    asked = ray_init_kwargs(actor_settings(cfg))
    assert asked["include_dashboard"] is True and asked["dashboard_host"] == "127.0.0.1"
    cfg.ray.init.dashboard_host = "0.0.0.0"  # the user's own choice wins
    assert ray_init_kwargs(actor_settings(cfg))["dashboard_host"] == "0.0.0.0"


def test_weights_travel_to_actors_as_arrays_bit_for_bit():
    """The push's wire form (numpy arrays Ray hands over without a copy) gives back every tensor exactly."""
    from torchrl_grpo.collect.actor_weights import as_arrays, from_arrays

    weights = {"w": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "h": torch.randn(2, 2).half(),
               "t": torch.randn(4, 3).t()}
    arrays = as_arrays(weights)
    assert all(isinstance(a, np.ndarray) for a, _ in arrays.values())
    back = from_arrays(arrays)
    assert list(back) == list(weights)
    for name, t in weights.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@needs_ray_and_vllm
def test_ray_tests_run_one_after_the_other_on_one_xdist_worker(request):
    """Two Ray tests at once break each other (the SLURM script's `ray stop --force` ends every Ray of the machine;
    each test checks that no Ray daemon is left): conftest groups them, and under pytest-xdist their ids carry the
    group that --dist loadgroup schedules by. pytest 9.2 broke that suffix with xdist 3.8 (constraints pin 9.1)."""
    assert request.node.get_closest_marker("xdist_group").args == ("ray",)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert request.node.nodeid.endswith("@ray")
