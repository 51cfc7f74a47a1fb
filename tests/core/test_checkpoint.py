"""Finding the checkpoint to resume from when some are damaged: ``auto`` and a run directory skip them with a
warning naming them; a damaged checkpoint named explicitly is a one-line error. Checkpoints here are their
files only (state, weights, config), which is all that checking them reads."""
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from torchrl_grpo.core import checkpoint
from torchrl_grpo.core.checkpoint import (
    STATE_FILE,
    damage,
    find_resume_point,
    list_checkpoints,
    load_state,
    rng_state,
    set_rng_state,
)
from torchrl_grpo.core.errors import ConfigError


def make_checkpoint(directory, step):
    path = directory / f"step_{step:06d}"
    path.mkdir(parents=True)
    torch.save({"step": step}, path / STATE_FILE)
    save_file({"w": torch.arange(1000.0)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return path


@pytest.fixture
def checkpoints(tmp_path):
    return [make_checkpoint(tmp_path / "run" / "checkpoints", step) for step in (1, 2, 3)]


@pytest.mark.parametrize("breaks, reason", [
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:2000]),
     "model.safetensors:"),
    (lambda p: (p / "model.safetensors").unlink(), "no *.safetensors weights"),
    (lambda p: (p / STATE_FILE).write_bytes(b"not a pickle"), f"{STATE_FILE}:"),
    # any pickled object beyond tensors and plain containers (here numpy's RNG state, as the state files
    # written before weights_only held it): torch.load(weights_only=True) refuses it, so it is damaged
    (lambda p: torch.save({"step": 3, "numpy": np.random.get_state()}, p / STATE_FILE), f"{STATE_FILE}: Unpickling"),
    (lambda p: (p / "config.json").write_text("{broken"), "config.json:"),
])
def test_damage_says_what_does_not_load(checkpoints, breaks, reason):
    assert damage(checkpoints[-1]) is None
    breaks(checkpoints[-1])
    assert damage(checkpoints[-1]).startswith(reason)


def test_auto_and_a_run_directory_skip_damaged_checkpoints(checkpoints, tmp_path, capsys):
    (checkpoints[-1] / STATE_FILE).write_bytes(b"")
    assert find_resume_point("auto", tmp_path / "run" / "checkpoints") == checkpoints[1]
    assert f"warning: skipping checkpoint {checkpoints[-1]}: it does not load" in capsys.readouterr().err
    assert find_resume_point(str(tmp_path / "run"), tmp_path / "elsewhere") == checkpoints[1]
    for path in checkpoints[:2]:
        (path / "model.safetensors").unlink()
    assert find_resume_point("auto", tmp_path / "run" / "checkpoints") is None  # nothing loads: a fresh start
    with pytest.raises(ConfigError, match="none of its checkpoints loads"):
        find_resume_point(str(tmp_path / "run"), tmp_path / "elsewhere")


def test_a_damaged_checkpoint_named_explicitly_is_a_one_line_error(checkpoints):
    (checkpoints[0] / "config.json").write_text("")
    with pytest.raises(ConfigError) as err:
        find_resume_point(str(checkpoints[0]), checkpoints[0].parent)
    message = str(err.value)
    assert message.startswith(f"train.resume={checkpoints[0]}: that checkpoint does not load (config.json:")
    assert "\n" not in message
    assert find_resume_point(str(checkpoints[1]), checkpoints[0].parent) == checkpoints[1]


class FakePolicy:
    def save_pretrained(self, directory, **kwargs):
        save_file({"w": torch.zeros(3)}, str(directory / "model.safetensors"))

    def parameters(self):
        return iter([torch.zeros(3)])


class FakeTrainer:
    """What RunState needs of a trainer: a policy that saves, an optimizer, the micro-batch shuffle, and whether
    training diverged."""

    parallel = scheduler = critic = None

    def __init__(self, diverged=None):
        self.diverged = diverged
        self.policy = FakePolicy()
        self.optimizer = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
        self.shuffle = torch.Generator()

    def divergence(self):
        return self.diverged


class FakeTokenizer:
    def save_pretrained(self, directory):
        (directory / "tokenizer.json").write_text("{}")


class Position:
    def state_dict(self):
        return {"position": 1}


def test_after_step_checkpoints_when_due_asked_or_diverged(tmp_path):
    from helpers import cfg_with
    from torchrl_grpo.config.spec import resolve_run
    from torchrl_grpo.core.errors import RunError
    from torchrl_grpo.run.state import RunState

    state = RunState(resolve_run(cfg_with("logging.checkpoint_frequency=2")), tmp_path)
    assert state.after_step(1, 10, FakeTrainer(), FakeTokenizer(), Position(), lambda: False) is None
    assert not (tmp_path / "checkpoints" / "step_000001").exists()
    assert state.after_step(2, 10, FakeTrainer(), FakeTokenizer(), Position(), lambda: False) is None
    assert damage(tmp_path / "checkpoints" / "step_000002") is None
    stopped = state.after_step(3, 10, FakeTrainer(), FakeTokenizer(), Position(), lambda: True)
    assert stopped.startswith("stopped after step 3 (checkpoint saved); continue with train.resume=auto")
    with pytest.raises(RunError, match=r"^it diverged; stopped \(checkpoint of step 4 saved in .*checkpoints\)$"):
        state.after_step(4, 10, FakeTrainer("it diverged"), FakeTokenizer(), Position(), lambda: False)
    assert damage(tmp_path / "checkpoints" / "step_000004") is None


def test_a_repeated_sigterm_is_the_same_stop_request_a_second_ctrl_c_interrupts(capsys):
    """One preemption can reach the trainer twice (srun passes it on; Ray's daemons signal the driver): it must not
    turn a stop with a checkpoint into an interrupt. Ctrl-C pressed twice still stops at once."""
    import os
    import signal

    from torchrl_grpo.run.stop_request import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
    assert capsys.readouterr().err.count("SIGTERM: finishing this step and saving a checkpoint") == 1
    with pytest.raises(KeyboardInterrupt), StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) == before  # the handler before it is back


def test_rng_states_come_back_exactly_through_a_weights_only_load(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.randn()  # numpy now holds a cached Gaussian: part of its state
    torch.save({"rng": rng_state()}, tmp_path / STATE_FILE)
    draws = (random.random(), np.random.randn(3).tolist(), torch.rand(2).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(load_state(tmp_path)["rng"])
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(2).tolist()) == draws


class Weights:
    """What ``checkpoint.save`` asks of a model and a tokenizer: a ``save_pretrained`` writing a weights file."""

    def save_pretrained(self, path, **_):
        save_file({"w": torch.arange(10.0)}, str(path / "model.safetensors"))


def test_the_oldest_checkpoint_leaves_its_name_before_it_is_deleted(tmp_path, monkeypatch):
    """Past ``keep``, the oldest checkpoint goes; a kill while its files are deleted leaves a ``.tmp_`` folder that
    resume skips, and every ``step_*`` folder whole."""
    directory = tmp_path / "checkpoints"
    for step in (1, 2):
        checkpoint.save(directory, step, Weights(), Weights(), {"step": step}, keep=2)
    deleted = checkpoint.shutil.rmtree

    def killed_halfway(path, ignore_errors=False):
        if "step_000001" not in str(path):  # the save's own temporary folder
            return deleted(path, ignore_errors=ignore_errors)
        (Path(path) / "model.safetensors").unlink()
        raise KeyboardInterrupt  # the process dies with the oldest checkpoint half deleted

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(directory, 3, Weights(), Weights(), {"step": 3}, keep=2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", deleted)
    assert [p.name for p in list_checkpoints(directory)] == ["step_000002", "step_000003"]
    assert all(damage(p) is None for p in list_checkpoints(directory))
    assert [p.name for p in directory.iterdir() if p.name.startswith(".tmp_")] == [
        f".tmp_step_000001_removed_{os.getpid()}"]
    checkpoint.save(directory, 4, Weights(), Weights(), {"step": 4}, keep=2)
    assert [p.name for p in list_checkpoints(directory)] == ["step_000003", "step_000004"]
