"""grpo.py with train.sync_iter=false (the next batch is generated while the current one trains): a real
subprocess, Hydra, the tiny model and the vLLM CPU engine, then a resume; and the key's validation."""
import pytest

from helpers import FLOAT32, cfg_with, finite, metric_rows, needs_vllm, run
from helpers import SMALL as BASE
from torchrl_grpo.config.validate import validate
from torchrl_grpo.core.errors import ConfigError

SMALL = [*BASE, *FLOAT32, "train.sync_iter=false"]


@needs_vllm
def test_sync_iter_false_overlaps_one_step_then_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "logging.checkpoint_frequency=2", "train.kl_to_ref_coeff=0.05", "loss.old_log_probs=trainer",
            f"hydra.run.dir={run_dir}"]
    first = run([*args, "train.total_dialog_turns=32"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "summary:" in first.stdout
    logged = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in logged] == [1, 2, 3, 4]
    for key in ("reward", "loss_objective", "kl_to_ref", "engine_trainer_logp_gap_max", "batch_wait_time"):
        assert all(finite(r[key]) for r in logged), key
    # batch k+1 is sampled by the weights before step k's update: one version behind from step 2 on
    assert [float(r["staleness"]) for r in logged] == [0, 1, 1, 1]
    assert [float(r["policy_version"]) for r in logged] == [0, 0, 1, 2]
    saved = run_dir / "checkpoints" / "step_000004"
    assert (saved / "model.safetensors").is_file() and (saved / "trainer_state.pt").is_file()

    # the batch prefetched during step 4 is not in the checkpoint: it is sampled again, with step 4's weights
    resumed = run([*args, "train.total_dialog_turns=48", "train.resume=auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_000004" in resumed.stdout
    logged = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in logged] == [1, 2, 3, 4, 5, 6]
    assert [float(r["staleness"]) for r in logged[4:]] == [0, 1]
    assert [float(r["policy_version"]) for r in logged[4:]] == [4, 4]


def test_sync_iter_is_validated():
    assert cfg_with().train.sync_iter is True
    validate(cfg_with("train.sync_iter=false"))
    with pytest.raises(ConfigError, match=r"^train.sync_iter='yes': must be true or false$"):
        validate(cfg_with("train.sync_iter=yes"))
    with pytest.raises(ConfigError, match=r"^train.sync_iter=false with inference_model.backend=transformers: "):
        validate(cfg_with("train.sync_iter=false", "inference_model.backend=transformers"))


def test_a_bad_sync_iter_is_one_line_and_exit_code_2(tmp_path):
    bad = run(["model=tiny", "train.sync_iter=maybe", f"hydra.run.dir={tmp_path}"], cwd=tmp_path, timeout=120)
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert lines == ["error: train.sync_iter='maybe': must be true or false"]
