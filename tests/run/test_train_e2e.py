"""grpo.py as users run it: a real subprocess, real Hydra, the tiny model, the real vLLM CPU engine."""
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import (
    CONFIG_DIR,
    SMALL,
    failure_excerpt,
    finite,
    measured,
    metric_rows,
    needs_vllm,
    preempted,
    run,
    start,
    training_values,
    wait_until,
)
from torchrl_grpo.config.precision import native_bf16
from torchrl_grpo.core.allocator import find_tcmalloc


@needs_vllm
def test_killed_run_resumes_exactly_skipping_a_damaged_checkpoint(tmp_path):
    """Killed at a random moment, its newest checkpoint then damaged, a run resumes from the newest one that
    loads and gives, step for step, the metrics of the same run left alone (the engine's sampling state is in
    the checkpoint). The runs take the default precision keys (auto) as this machine resolves them: on a CPU with
    native bf16, bf16 autocast, a bf16 engine and the trainer's log-probs as the ratio's denominator; the run left
    alone is checked for what a user sees (console, grpo.log, plots, metrics, checkpoints), the resumed one asked
    for the progress bar with stderr a pipe."""
    run_dir, whole_dir = tmp_path / "run", tmp_path / "whole"
    args = [*SMALL, "train.total_dialog_turns=48", "logging.checkpoint_frequency=1", "train.kl_to_ref_coeff=0.05",
            "optimizer.scheduler=cosine", "optimizer.warmup_steps=2",  # the schedule resumes where it was, too
            "logging.tensorboard=true"]
    proc = start([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
    wait_until((run_dir / "checkpoints" / "step_000002").exists, proc, seconds=240)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    checkpoints = run_dir / "checkpoints"
    complete = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))
    # logging.keep_checkpoints=2; a kill between a save's rename and the oldest one's removal leaves three
    assert "step_000002" in complete and len(complete) in (2, 3)
    # the save is atomic: every step_* folder is whole; a kill during a save leaves only a .tmp_step_* folder
    assert all((checkpoints / name / "trainer_state.pt").is_file()
               and (checkpoints / name / "model.safetensors").is_file() for name in complete)
    assert all(p.name.startswith(".tmp_step_") for p in checkpoints.iterdir() if p.name not in complete)
    weights = checkpoints / complete[-1] / "model.safetensors"
    with open(weights, "r+b") as f:  # a disk that filled up: the newest checkpoint's weights cut short
        f.truncate(weights.stat().st_size // 2)

    # the progress bar asked for, but stderr is a pipe here: plain step lines, no carriage-return redraws
    again = run([*args, f"hydra.run.dir={run_dir}", "train.resume=auto", "logging.progress_bar=true"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"warning: skipping checkpoint {checkpoints / complete[-1]}: it does not load" in again.stderr
    assert f"resumed from {checkpoints / complete[-2]}" in again.stdout
    assert f"step {int(complete[-2].removeprefix('step_')) + 1} | reward" in again.stdout
    assert "GRPO:" not in again.stderr
    whole = run([*args, f"hydra.run.dir={whole_dir}"], cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed, alone = metric_rows(run_dir), metric_rows(whole_dir)
    assert [int(float(r["step"])) for r in resumed] == list(range(1, 7))
    assert any(map(measured, alone[0])) and "reward" in alone[0] and "grad_norm" in alone[0]
    for mine, theirs in zip(resumed, alone, strict=True):
        assert training_values(mine) == training_values(theirs)
    # 6 optimizer steps: linear warmup over 2 from 0, then cosine to 0 (SMALL: optimizer.lr=1e-3)
    expected = [1e-3 * k / 2 if k < 2 else 1e-3 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 4)) for k in range(6)]
    assert [float(r["lr"]) for r in alone] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    # TensorBoard: each step once, with the resumed run's values (the killed run's steps after the checkpoint purged)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [
        (int(float(r["step"])), pytest.approx(float(r["reward"]), rel=1e-6, abs=1e-7)) for r in resumed]

    out = whole.stdout
    assert "completions per step" in out and "summary:" in out
    assert "allocator: " + ("tcmalloc" if find_tcmalloc() else "glibc malloc: tcmalloc not found") in out
    # start-up noise (vLLM's warnings, loading bars, Python warnings) goes to grpo.log, not the console
    assert "vLLM engine on cpu started" in out and "cpu_worker.py" not in out + whole.stderr
    assert "Loading" not in whole.stderr and "FutureWarning" not in out + whole.stderr
    assert "][vllm.v1.worker.cpu_worker][WARNING] - " in (whole_dir / "grpo.log").read_text()
    assert f"plots: {whole_dir / 'plots'} (3 figures)" in out  # no evaluation: reward, policy and throughput
    assert sorted(p.name for p in (whole_dir / "plots").iterdir()) == ["policy.png", "reward.png", "throughput.png"]
    for key in ("reward", "reward/accuracy", "reward/answer_format", "loss_objective", "kl_to_ref", "entropy",
                "grad_norm", "clip_fraction", "ess", "generation_tokens_per_s", "step_time", "train_flops_per_s",
                "memory/rss_gib", "memory/peak_rss_gib"):
        assert all(finite(r[key]) for r in alone), key
    # on the CPU: the process's memory, no GPU's, and no MFU (no peak known); the summary's speed and memory
    assert not [key for key in alone[0] if key.startswith(("memory/train", "memory/ref", "memory/inference"))]
    assert "mfu" not in alone[0] and "  hardware: train " in out and "process RSS" in out
    if native_bf16("cpu"):
        assert ("precision: trainer bf16 autocast over float32 weights (train.mixed_precision=auto), engine bfloat16 "
                "(inference_model.torch_dtype=auto), old log-probs the trainer's (loss.old_log_probs=auto)") in out
        assert "weight sync check: engine and trainer log-probs" in out and "(engine bfloat16," in out
        # the trainer's bf16 log-probs differ from the bf16 engine's, a little (float32 runs: 1e-4, tests with FLOAT32)
        assert all(0 < float(r["engine_trainer_logp_gap_max"]) < 0.05 for r in alone)
    else:
        assert "precision: trainer float32 (train.mixed_precision=auto), engine float32" in out
    # a checkpoint after every step, the newest logging.keep_checkpoints=2 kept
    assert sorted(p.name for p in (whole_dir / "checkpoints").iterdir()) == ["step_000005", "step_000006"]
    assert (whole_dir / "checkpoints" / "step_000006" / "model.safetensors").is_file()


def test_recipe_paths_run_the_root_scripts(tmp_path):
    recipe = run(["model=tiny", "env.repeats=0", f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
                 script="sota-implementations/grpo/grpo.py", timeout=120)
    assert recipe.returncode == 2 and "env.repeats=0" in recipe.stderr
    recipe_async = run(["model=tiny", "env.repeats=0", f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
                       script="sota-implementations/grpo/grpo-async.py", timeout=120)
    assert recipe_async.returncode == 2 and "env.repeats=0" in recipe_async.stderr


def test_lora_with_the_transformers_engine_and_wandb_offline(tmp_path):
    """A LoRA run with the transformers engine saves the adapter alone and resumes from it; wandb runs offline,
    asked for (the first run) or by default without a key (the resumed one). Keys live in the environment only
    (no config key carries one: wandb reads WANDB_API_KEY itself): the first run, with wandb on, a checkpoint and
    keys in its environment, writes none of them to its configs, checkpoint, logs or console."""
    keys = {"WANDB_API_KEY": "fake-key-1234567890", "OPENAI_API_KEY": "sk-fake-0987654321",
            "HF_TOKEN": "hf_fake1234567890abcdef"}
    run_dir = tmp_path / "run"
    args = [*SMALL, "inference_model.backend=transformers", "train_model.lora.enabled=true", "optimizer.lr=1e-2",
            "logging.wandb.enabled=true", f"hydra.run.dir={run_dir}"]
    first = run([*args, "train.total_dialog_turns=8", "logging.wandb.mode=offline"], cwd=tmp_path, env_extra=keys)
    assert first.returncode == 0, first.stderr[-3000:]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.csv", "grpo.log",
            "checkpoints/step_000001/trainer_state.pt"} <= {str(p.relative_to(run_dir)) for p in files}
    assert list((run_dir / "wandb").rglob("*.wandb"))
    for secret in keys.values():
        assert secret not in first.stdout + first.stderr
        assert not [p for p in files if secret.encode() in p.read_bytes()]
    saved = run_dir / "checkpoints" / "step_000001"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    assert list((run_dir / "wandb").glob("offline-run-*"))
    _assert_adapter_restores(saved, run_dir / ".hydra" / "config.yaml")
    resumed = run([*args, "train.total_dialog_turns=16", "train.resume=auto"], cwd=tmp_path,
                  env_extra={"WANDB_API_KEY": ""})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # logging.wandb.mode=auto without a key
    assert [int(float(r["step"])) for r in metric_rows(run_dir)] == [1, 2]


def _assert_adapter_restores(saved: Path, config_file: Path):
    """The builder's resume path puts the saved adapter back into a fresh LoRA policy, tensor for tensor."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from torchrl_grpo.config.spec import resolve_run
    from torchrl_grpo.models.sources import resolve_model
    from torchrl_grpo.run.build import build_policy
    from torchrl_grpo.run.state import RunState

    cfg = OmegaConf.load(config_file)
    cfg.train.resume = str(saved)
    spec = resolve_run(cfg)
    policy = build_policy(spec.model, resolve_model("tiny"), ["cpu"], torch.float32, RunState(spec, saved.parent))
    restored = get_peft_model_state_dict(policy)
    on_disk = load_file(str(saved / "adapter_model.safetensors"))
    assert on_disk.keys() == restored.keys()
    assert all(torch.equal(on_disk[k], restored[k]) for k in on_disk)
    # lora_A starts random (unseeded here), so equality means the saved values were loaded
    assert any(k.endswith("lora_A.weight") and on_disk[k].abs().sum() > 0 for k in on_disk)


@needs_vllm
def test_sigterm_stops_after_the_step_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "train.total_dialog_turns=400", "logging.checkpoint_frequency=0", f"hydra.run.dir={run_dir}"]
    proc = start(args, cwd=tmp_path)
    wait_until(lambda: metric_rows(run_dir), proc, seconds=240)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    stopped_at = len(metric_rows(run_dir))
    assert 1 <= stopped_at < 50 and f"stopped after step {stopped_at}" in out
    assert (run_dir / "checkpoints" / f"step_{stopped_at:06d}" / "trainer_state.pt").is_file()


# six steps that each update (an entropy bonus: the tiny model's rewards tie), a checkpoint after every one; the
# transformers engine: cheap starts, and its sampling state is in the checkpoint
PREEMPTED = [*SMALL, "inference_model.backend=transformers", "train.total_dialog_turns=48", "train.entropy_coeff=0.01",
             "logging.checkpoint_frequency=1", "logging.keep_checkpoints=0"]


def test_preempted_at_each_point_of_a_step_the_run_resumes_to_the_metrics_of_the_run_left_alone(tmp_path):
    """SIGTERM during step 2's generation, then (resumed) during step 3's optimizer step: each run finishes that
    step, saves its checkpoint whole and ends with 0 within the grace. SIGKILL during step 4's checkpoint write: a
    partial checkpoint that resume skips. Resumed from step 3, SIGTERM during step 5's checkpoint write stops on
    it, not one step later. Resumed to the end, steps 1 to 6 are, metric for metric, those of the run left alone."""
    run_dir, whole_dir = tmp_path / "run", tmp_path / "whole"
    whole = run([*PREEMPTED, f"hydra.run.dir={whole_dir}"], cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    args, checkpoints = [*PREEMPTED, f"hydra.run.dir={run_dir}", "train.resume=auto"], run_dir / "checkpoints"

    def steps():
        return [int(float(r["step"])) for r in metric_rows(run_dir)]

    for point, nth, sig, stops_after in [("generation", 2, "SIGTERM", 2), ("optimizer_step", 1, "SIGTERM", 3),
                                         ("checkpoint_write", 1, "SIGKILL", None),
                                         ("checkpoint_write", 2, "SIGTERM", 5)]:
        done, grace_out = preempted(args, point, nth, sig, cwd=tmp_path)
        saved = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))
        if stops_after is None:  # killed: step 4's files under their temporary name, never taken
            assert done.returncode == -9 and saved == ["step_000001", "step_000002", "step_000003"]
            assert [p.name for p in checkpoints.glob(".tmp_step_000004_*")]
            continue
        assert done.returncode == 0 and not grace_out, failure_excerpt(done)
        assert "SIGTERM: finishing this step and saving a checkpoint" in done.stderr
        assert f"stopped after step {stops_after}" in done.stdout, done.stdout[-2000:]
        assert saved == [f"step_{s:06d}" for s in range(1, stops_after + 1)] and steps() == saved_steps(saved)
    assert "resumed from " + str(checkpoints / "step_000003") in done.stdout
    done = run(args, cwd=tmp_path)
    assert done.returncode == 0 and steps() == [1, 2, 3, 4, 5, 6], done.stderr[-3000:]
    rows, alone = metric_rows(run_dir), metric_rows(whole_dir)
    for mine, theirs in zip(rows, alone, strict=True):
        assert training_values(mine) == training_values(theirs)


def saved_steps(names: list[str]) -> list[int]:
    return [int(n.removeprefix("step_")) for n in names]


@needs_vllm
def test_a_run_that_learns_nothing_says_why_and_stops_with_a_checkpoint_when_asked(tmp_path):
    """The tiny model never answers a GSM8K-style question: every group ties at reward 0, step after step."""
    run_dir = tmp_path / "run"
    done = run([*SMALL, "train.total_dialog_turns=40", "train.no_signal_patience=2", "train.no_signal_stop=true",
                f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no completion carried a learning signal for 2 steps in a row: every group's "
                           "rewards tied (mean reward 0): ") and "loss.dynamic_sampling=true" in last
    assert "; stopped (checkpoint of step 2 saved in " in last
    assert [float(r["signal_fraction"]) for r in metric_rows(run_dir)] == [0.0, 0.0]
    assert (run_dir / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()


def test_ppo_learns_the_length_task_and_resumes_with_its_critic(tmp_path):
    """loss=ppo on TRL's length task (a reward of -|20 - characters|) with the transformers engine: the reward rises,
    the critic's figure is drawn, each checkpoint holds the critic in critic/, and a run resumed from one gives, step
    for step, the metrics (value loss, explained variance...) of the run left alone: the critic's weights, optimizer
    and schedule come back."""
    args = ["model=tiny", "loss=ppo", "env=length_reward", "inference_model.backend=transformers", "env.num_envs=8",
            "env.repeats=2", "train.optim_batch_size=16", "train.total_dialog_turns=320",
            "inference_model.max_tokens=16", "optimizer.lr=3e-3", "critic.lr=3e-3", "optimizer.warmup_steps=1",
            "logging.checkpoint_frequency=14", "logging.keep_checkpoints=0", "logging.progress_bar=false"]
    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    whole = run([*args, f"hydra.run.dir={whole_dir}"], cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    rows = metric_rows(whole_dir)
    reward = [float(r["reward"]) for r in rows]
    assert len(rows) == 20 and sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 5, reward
    assert "explained_variance" in whole.stdout and "LOAD REPORT" not in whole.stdout + whole.stderr
    assert (whole_dir / "plots" / "critic.png").is_file()
    for step in ("step_000014", "step_000020"):
        assert (whole_dir / "checkpoints" / step / "critic" / "model.safetensors").is_file()
    resumed = run([*args, f"hydra.run.dir={resumed_dir}", f"train.resume={whole_dir / 'checkpoints' / 'step_000014'}"],
                  cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = metric_rows(resumed_dir)
    assert [int(float(r["step"])) for r in again] == list(range(15, 21))
    for mine, theirs in zip(again, rows[14:], strict=True):
        assert training_values(mine) == training_values(theirs)


def test_every_loss_preset_trains_with_finite_metrics(tmp_path):
    """A --multirun sweep over every preset (each job in its own directory); the transformers engine, whose start
    is cheap: the objective does not depend on the engine, and train.epochs=2 takes the ratio off 1."""
    presets = sorted(path.stem for path in (CONFIG_DIR / "loss").glob("*.yaml"))
    sweep = run(["--multirun", *SMALL, "inference_model.backend=transformers", "train.total_dialog_turns=16",
                 "train.epochs=2", "train.kl_to_ref_coeff=0.01", f"loss={','.join(presets)}",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, timeout=600)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    prefixes = ("loss", "kl", "ratio", "ess", "clip", "grad_norm", "reward", "entropy")
    for job, preset in enumerate(presets):
        job_dir = tmp_path / "sweep" / str(job)
        assert f"loss={preset}" in OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")  # this job ran this preset
        logged = metric_rows(job_dir)
        assert len(logged) == 2, preset
        checked = {key for key in logged[0] if key.startswith(prefixes)}
        assert all(any(key.startswith(prefix) for key in checked) for prefix in prefixes), (preset, sorted(checked))
        for row in logged:
            for key in checked:
                assert finite(row[key]), (preset, key, row[key])
        if preset == "ppo":  # the critic trains too
            assert all(finite(row[key]) for row in logged for key in ("value_loss", "critic_grad_norm", "value_mean"))
