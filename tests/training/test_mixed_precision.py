"""train.mixed_precision: bf16 autocast over float32 master weights (what ``auto`` resolves to:
tests/config/test_precision.py). On the CPU, against float32 on the same small batch: bf16 matmuls really run, the loss
and the gradient norm stay within a bound, the weights stay float32, and the ratio's two log-probs are computed
alike."""
import dataclasses

import torch
from tensordict import TensorDict

from torchrl_grpo.config.settings import TrainSettings
from torchrl_grpo.models.loading import load_policy
from torchrl_grpo.objective.loss import GRPOLoss
from torchrl_grpo.training.trainer import Trainer

SETTINGS = TrainSettings(group_size=4, micro_batch=4, accumulation=2, epochs=1, temperature=1.0,
                         recompute_old_log_probs=True, kl_in_reward_coeff=0.0, reward_scale="group",
                         clip_grad_norm=None, mixed_precision=False, max_nonfinite_updates=3, seed=0)


def make_batch(vocab: int, n: int = 8, length: int = 24, prompt: int = 8) -> TensorDict:
    """``n`` completions after ``prompt`` tokens, of lengths ``length`` minus 0, 4 or 8 (right padding)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, vocab, (n, length), generator=g)
    attention = torch.zeros(n, length, dtype=torch.bool)
    completion = torch.zeros(n, length, dtype=torch.bool)
    for i in range(n):
        end = length - (i % 3) * 4
        attention[i, :end] = True
        completion[i, prompt:end] = True
    return TensorDict({"tokens": tokens, "attention_mask": attention, "completion_mask": completion,
                       "sample_log_probs": torch.where(completion, -2.0, 0.0),
                       "reward": torch.rand(n, generator=g)}, batch_size=[n])


def one_step(model_path: str, mixed: bool) -> tuple[dict, torch.Tensor, torch.nn.Module, list]:
    policy = load_policy(model_path, dtype=torch.float32, device="cpu")
    matmul_dtypes = []
    caching = []  # whether autocast keeps bf16 copies of the weights (it must not: Trainer._autocast)

    def seen(module, args, out):
        matmul_dtypes.append(out.dtype)
        caching.append(torch.is_autocast_cache_enabled())

    policy.model.layers[-1].mlp.down_proj.register_forward_hook(seen)  # the head returns log-probs, not logits
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    trainer = Trainer(policy, None, GRPOLoss(policy, temperature=1.0), optimizer,
                      dataclasses.replace(SETTINGS, mixed_precision=mixed), torch.device("cpu"), None)
    batch = make_batch(policy.config.vocab_size)
    before = trainer.log_probs(policy, torch.device("cpu"), batch)  # the policy's, before its update
    matmul_dtypes.clear()
    metrics = trainer.prepare(batch)
    metrics.update(trainer.optimize(batch))
    assert not mixed or not any(caching)
    return metrics, before, policy, matmul_dtypes


def test_bf16_autocast_on_cpu_stays_close_to_float32(tiny_model_path):
    full, full_before, _, full_dtypes = one_step(tiny_model_path, mixed=False)
    mixed, mixed_before, policy, mixed_dtypes = one_step(tiny_model_path, mixed=True)
    assert set(full_dtypes) == {torch.float32} and set(mixed_dtypes) == {torch.bfloat16}
    # the log-probs before the update under autocast: close to float32's; the step makes one update, so the
    # ratio's denominator is the training forward's own (Trainer.prepare): exactly 1, never clipped
    mask = make_batch(policy.config.vocab_size)["completion_mask"]
    gap = (mixed_before - full_before)[mask].abs()
    assert 0 < gap.mean() < 0.05, gap.mean()
    assert mixed["clip_fraction"] == 0.0 and mixed["ratio_mean"] == 1.0 and mixed["ratio_max"] == 1.0
    assert abs(mixed["loss"] - full["loss"]) < 0.02 * max(1.0, abs(full["loss"])), (mixed["loss"], full["loss"])
    assert abs(mixed["grad_norm"] - full["grad_norm"]) < 0.05 * full["grad_norm"], (
        mixed["grad_norm"], full["grad_norm"])
    assert mixed["grad_norm"] != full["grad_norm"]  # the bf16 path really ran
    assert all(p.dtype == torch.float32 for p in policy.parameters())


def test_a_cpu_without_native_bf16_is_warned_once(tiny_model_path, monkeypatch, capsys):
    from helpers import cfg_with
    from torchrl_grpo.config.spec import resolve_run
    from torchrl_grpo.run.build import build_trainer

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU trainer, on a machine with GPUs too
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # whatever this CPU has
    cfg = cfg_with("model=tiny", "train.mixed_precision=true")
    build_trainer(resolve_run(cfg), tiny_model_path)
    assert "without native bf16" not in capsys.readouterr().err
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    trainer = build_trainer(resolve_run(cfg), tiny_model_path)
    err = capsys.readouterr().err
    assert err.count("warning: train.mixed_precision=true on a CPU without native bf16") == 1
    assert "set train.mixed_precision=false" in err and trainer.settings.mixed_precision is True
    for default_or_off in ("train.mixed_precision=auto", "train.mixed_precision=false"):
        other = cfg_with("model=tiny", default_or_off)
        build_trainer(resolve_run(other), tiny_model_path)
        assert "without native bf16" not in capsys.readouterr().err


def test_weight_casts_are_made_again_in_the_backward_not_kept_by_the_graph(tiny_model_path):
    """Autocast's bf16 casts of the weights (and the transposed views of them that linear layers save) are not
    held from the forward to the backward (:mod:`torchrl_grpo.training.recast`): the graph keeps exactly their
    bytes less, and the gradients are the same bit for bit."""
    from torchrl_grpo.objective.log_probs import token_log_probs
    from torchrl_grpo.training.recast import pack_saved, unpack_saved

    policy = load_policy(tiny_model_path, dtype=torch.float32, device="cpu")
    batch = make_batch(policy.config.vocab_size)

    def backward(pack):
        kept = {}

        def counted(saved):
            packed = pack(saved)
            if isinstance(packed, torch.Tensor):
                kept[packed.untyped_storage().data_ptr()] = packed.untyped_storage().nbytes()
            return packed

        policy.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(counted, unpack_saved):
            taken, _ = token_log_probs(policy, batch["tokens"], batch["attention_mask"],
                                       wanted=batch["completion_mask"])
            loss = (taken * torch.linspace(-1, 1, taken.numel()).view_as(taken)).sum()
        loss.backward()
        params = {p.untyped_storage().data_ptr() for p in policy.parameters()}
        return sum(n for ptr, n in kept.items() if ptr not in params), [p.grad.clone() for p in policy.parameters()]

    kept_all, grads = backward(lambda saved: saved)
    kept_fewer, recast_grads = backward(pack_saved)
    weights = {m.weight.data_ptr(): m.weight.numel() for m in policy.modules() if isinstance(m, torch.nn.Linear)}
    assert kept_all - kept_fewer == 2 * sum(weights.values())  # one bf16 copy of every linear weight
    assert all(torch.equal(a, b) for a, b in zip(grads, recast_grads))
