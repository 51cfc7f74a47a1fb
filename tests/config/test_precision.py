"""What ``auto`` resolves to for the precision keys (torchrl_grpo/config/precision.py), on a CPU with native bf16, one
without (torch's check made to answer no) and a GPU; explicit values always win; resolve_run() refuses what the
resolved values cannot do; the run spec resolves them once for the roles' devices."""
import pytest
import torch

from helpers import cfg_with
from torchrl_grpo.config.precision import resolve_precision
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError


@pytest.fixture(params=[True, False], ids=["native-bf16-cpu", "emulated-bf16-cpu"])
def native(request, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: request.param)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    return request.param


def resolved(cfg, device="cpu"):
    precision = resolve_precision(cfg, device, device, device)
    return precision.autocast_bf16, precision.engine, precision.trainer_old_log_probs


def test_auto_follows_the_hardware(native):
    cfg = cfg_with()
    assert (cfg.train.mixed_precision, cfg.inference_model.torch_dtype, cfg.loss.old_log_probs) == ("auto",) * 3
    low = torch.bfloat16 if native else torch.float32
    assert resolved(cfg) == (native, low, native)
    assert resolved(cfg, "cuda:0") == (True, torch.bfloat16, True)  # a GPU, whatever the CPU
    spec = resolve_run(cfg)  # the trainer's settings take the resolved values
    assert (spec.train.mixed_precision, spec.train.recompute_old_log_probs) == (native, native)
    assert spec.precision == resolve_precision(cfg, "cpu", "cpu", "cpu")
    assert (spec.precision.train_weights, spec.precision.reference) == (torch.float32, torch.float32)


@pytest.mark.parametrize("overrides, expected", [
    (["train.mixed_precision=false"], (False, torch.float32, False)),
    (["train.mixed_precision=true"], (True, torch.bfloat16, True)),
    (["train.mixed_precision=true", "inference_model.torch_dtype=float32", "loss.old_log_probs=engine"],
     (True, torch.float32, False)),
    (["train.mixed_precision=false", "loss.old_log_probs=trainer"], (False, torch.float32, True)),
    # pure bf16 weights: the trainer computes in bf16 without autocast
    (["train.mixed_precision=false", "train_model.torch_dtype=bfloat16"], (False, torch.bfloat16, True)),
])
def test_explicit_values_win(native, overrides, expected):
    assert resolved(cfg_with(*overrides)) == expected


def test_engine_on_a_gpu_is_bf16_even_beside_a_float32_trainer(native):
    cfg = cfg_with("train.mixed_precision=false")
    assert resolve_precision(cfg, "cpu", "cuda:0", "cpu").engine == torch.bfloat16


def test_the_resolved_denominator_is_checked(native):
    cfg = cfg_with("inference_model.top_p=0.9")
    if native:
        resolve_run(cfg)  # the trainer recomputes the old log-probs: nucleus sampling is fine
        return
    with pytest.raises(ConfigError) as err:
        resolve_run(cfg)
    assert str(err.value).startswith("inference_model.top_p=0.9 with loss.old_log_probs=auto (the engine's, as "
                                     "training runs in float32 here): ")


def test_the_actors_engines_resolve_for_the_gpus_they_ask_for(native):
    """Async mode: the actors' engines are on a GPU when each asks for one (``ray.actor_num_gpus``), whatever the
    trainer's machine has; their dtype is resolved once, with the trainer's, and sent to them."""
    on_cpu = resolve_run(cfg_with("mode=async", "train.mixed_precision=false"))
    on_gpu = resolve_run(cfg_with("mode=async", "train.mixed_precision=false", "ray.actor_num_gpus=1",
                                  "ray.address=auto"))  # a cluster's GPUs
    assert (on_cpu.precision.engine, on_gpu.precision.engine) == (torch.float32, torch.bfloat16)
