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


def test_master_weights_are_float32_on_a_gpu_too(native):
    """auto: float32 master weights with bf16 compute on a GPU, as on a CPU; the models that are not trained keep
    bf16 there; bf16 master weights only when asked for."""
    spec = resolve_run(cfg_with("train.kl_to_ref_coeff=0.1"), gpu_count=1)
    precision = spec.precision
    assert (precision.train_weights, precision.autocast_bf16) == (torch.float32, True)
    assert (precision.reference, precision.engine) == (torch.bfloat16, torch.bfloat16)
    asked = resolve_run(cfg_with("train_model.torch_dtype=bfloat16"), gpu_count=1)
    assert asked.precision.train_weights == torch.bfloat16


def test_the_share_of_updates_bf16_weights_lose_is_counted_entry_by_entry():
    """Against adding the step in float32 and rounding back to bf16, entry by entry, on hand-made weights."""
    from torchrl_grpo.config.precision import lost_update_share

    weights = torch.tensor([[1.0, 0.5, 2e-3, -3e-3], [0.0, 1e-5, -0.25, 4.0]])
    bias = torch.ones(4)  # a 1-D tensor: not a weight matrix, not counted
    for dtype in (torch.bfloat16, torch.float16):
        w = weights.to(dtype)
        for lr in (2e-5, 1e-3, 1e-2, 1.0):
            kept = ((w.float() + lr).to(dtype) == w) & (w != 0)
            assert lost_update_share([weights, bias], lr, dtype) == pytest.approx(kept.sum().item() / w.numel())
    # at 2e-5 bf16 keeps the entries of 0.25 and up: their half ulp is 2^-11 (0.25) or more
    assert lost_update_share([weights], 2e-5) == 4 / 8
    # float16 keeps three more bits: at 1e-3 only 4.0's update (half an ulp 2^-9) is lost
    assert lost_update_share([weights], 1e-3, torch.float16) == 1 / 8
    assert lost_update_share([bias], 2e-5) == 0.0


def test_bf16_master_weights_that_would_lose_most_updates_warn_once(capsys):
    from torchrl_grpo.run.build import warn_lost_updates

    layer = torch.nn.Linear(64, 64)
    torch.nn.init.uniform_(layer.weight, 0.5, 1.0)
    warn_lost_updates(layer, torch.bfloat16, 2e-5)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "warning: train_model.torch_dtype=bfloat16 with optimizer.lr=2e-05: a step of that size leaves 100.0% of the "
        "weight-matrix entries unchanged")
    warn_lost_updates(layer, torch.bfloat16, 0.1)  # a step large enough to land
    warn_lost_updates(layer, torch.float32, 2e-5)
    assert capsys.readouterr().err == ""
