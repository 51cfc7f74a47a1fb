"""Packed micro-batches (train.micro_batch_tokens; torchrl_grpo/training/micro_batches.py and the packed forward of
torchrl_grpo/objective/log_probs.py): the plan's budget, shares and errors; packed log-probs equal to the padded ones
on the real tiny model in float64 (values and gradients, multi-turn rows with inserted tokens, LoRA); the update of
a packed step equal to the padded step's for every aggregation; and a model that lets packed rows see each other
refused in one line."""
import dataclasses
import types

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from helpers import LORA, cfg_with, padded_rows
from torchrl_grpo.config.settings import CriticSettings, TrainSettings
from torchrl_grpo.config.validate import validate
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.models import packed_attention
from torchrl_grpo.models.loading import load_policy
from torchrl_grpo.models.packed_attention import attend_by_row, packed_rows, varlen_rows
from torchrl_grpo.objective.critic import token_values
from torchrl_grpo.objective.log_probs import packing_gap, token_log_probs
from torchrl_grpo.objective.loss import GRPOLoss
from torchrl_grpo.training.critic import Critic
from torchrl_grpo.training.micro_batches import packed_micro_batches
from torchrl_grpo.training.trainer import Trainer


def test_a_plan_holds_every_row_once_within_the_budget_longest_first():
    lengths = torch.tensor([5, 9, 3, 7, 2, 8, 4, 6])
    rows = torch.arange(100, 108)
    plan = packed_micro_batches(rows, lengths, budget=12)
    assert sorted(int(r) for micro in plan for share in micro for r in share) == list(range(100, 108))
    loads = [int(lengths[share - 100].sum()) for micro in plan for share in micro]
    assert max(loads) <= 12 and sum(loads) == 44
    assert len(plan) == 4 and loads == [11, 11, 11, 11]  # 44 tokens by 12: 4 is the fewest, equally loaded
    assert [[int(r) - 100 for r in micro[0]] for micro in plan] == [[4, 1], [2, 5], [6, 3], [0, 7]]  # shortest first
    again = packed_micro_batches(rows, lengths, budget=12)  # every rank plans alike
    assert [[s.tolist() for s in micro] for micro in plan] == [[s.tolist() for s in micro] for micro in again]


def test_ranks_get_equal_token_loads_and_a_share_of_every_micro_batch():
    lengths = torch.tensor([30, 28, 25, 20, 18, 10, 9, 4, 3, 1])
    plan = packed_micro_batches(torch.arange(10), lengths, budget=60, ranks=2)
    assert all(len(micro) == 2 and all(len(share) for share in micro) for micro in plan)
    loads = [[int(lengths[share].sum()) for share in micro] for micro in plan]
    assert loads == [[37, 37], [36, 38]]  # 148 tokens: two micro-batches of 60 per rank, every share 36-38
    assert sorted(int(r) for micro in plan for share in micro for r in share) == list(range(10))
    # two rows for two ranks where one would fit the budget: each rank gets one
    plan = packed_micro_batches(torch.arange(2), torch.tensor([3, 2]), budget=20, ranks=2)
    assert [[share.tolist() for share in micro] for micro in plan] == [[[0], [1]]]
    with pytest.raises(RunError, match="cannot give a share of every micro-batch to each data-parallel rank"):
        packed_micro_batches(torch.arange(1), torch.tensor([3]), budget=20, ranks=2)


def test_a_row_longer_than_the_budget_is_an_error_not_a_truncation():
    with pytest.raises(RunError, match=r"a completion of 13 tokens .* longer than train.micro_batch_tokens=12"):
        packed_micro_batches(torch.arange(2), torch.tensor([5, 13]), budget=12)


def test_the_budget_must_hold_the_longest_row_twice_over_with_ranks():
    validate(cfg_with("inference_model.max_model_len=512", "train.micro_batch_tokens=512"))
    for extra, need in (([], 512), (["train_model.num_devices=2", "train.strategy=fsdp"], 1024)):
        with pytest.raises(ConfigError) as error:
            validate(cfg_with("inference_model.max_model_len=512", f"train.micro_batch_tokens={need - 1}", *extra))
        message = str(error.value)
        assert "\n" not in message and message.endswith(f"set train.micro_batch_tokens={need} or more")


def multi_turn_batch(vocab: int, seed: int = 0, rows: int = 6) -> TensorDict:
    """Right-padded rows of mixed lengths; each completion has a hole (a tool's inserted tokens, not trained)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(4, 9), (2, 5), (6, 12), (3, 3), (5, 7), (2, 10)][:rows]
    tokens, attention, completion = padded_rows(vocab, lengths, g, pad=2)
    for i, (p, c) in enumerate(lengths):
        if c > 4:
            completion[i, p + 2: p + 4] = False  # inserted tokens between two turns
    sample = torch.where(completion, -3 * torch.rand(tokens.shape, generator=g), 0.0)
    return TensorDict({"tokens": tokens, "attention_mask": attention, "completion_mask": completion,
                       "sample_log_probs": sample, "reward": torch.rand(len(lengths), generator=g),
                       "truncated": torch.zeros(len(lengths), dtype=torch.bool)}, batch_size=[len(lengths)])


@pytest.mark.parametrize("by_row", [False, True], ids=["block_mask", "by_row"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["plain", "lora"])
def test_packed_log_probs_and_gradients_are_the_padded_ones(tiny_model_path, lora, by_row):
    """transformers' block mask over the packed sequence (sdpa), and sdpa row by row (what a run uses)."""
    torch.manual_seed(0)
    model = load_policy(tiny_model_path, dtype=torch.float64, device="cpu", lora=lora)
    if by_row:
        attend_by_row(model)
        assert model.config._attn_implementation == "packed_rows"
    batch = multi_turn_batch(model.config.vocab_size)
    results = []
    for packed in (False, True):
        got, entropy = token_log_probs(model, batch["tokens"], batch["attention_mask"], 0.8, with_entropy=True,
                                       wanted=batch["completion_mask"], entropy_grad=True, packed=packed)
        weights = torch.linspace(-1, 1, got.numel(), dtype=torch.float64).view_as(got)
        (got * weights + entropy).sum().backward()
        results.append((got, entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        model.zero_grad()
    (padded, padded_entropy, padded_grads), (packed, packed_entropy, packed_grads) = results
    assert torch.allclose(packed, padded, atol=1e-12, rtol=0) and torch.allclose(packed_entropy, padded_entropy,
                                                                                    atol=1e-12, rtol=0)
    assert (packed[~batch["completion_mask"]] == 0).all()
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-12, rtol=1e-9), name


def test_packed_critic_values_and_gradients_are_the_padded_ones(tiny_model_path):
    """The critic (a value head on the tiny model, sdpa row by row as a run sets it) reads packed rows as padded."""
    critic = load_policy(tiny_model_path, dtype=torch.float64, device="cpu", value_head=True)
    attend_by_row(critic)
    batch = multi_turn_batch(critic.config.vocab_size)
    results = []
    for packed in (False, True):
        values = token_values(critic, batch["tokens"], batch["attention_mask"], batch["completion_mask"], packed)
        (values * torch.linspace(-1, 1, values.numel(), dtype=torch.float64).view_as(values)).sum().backward()
        results.append((values, {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}))
        critic.zero_grad()
    (padded, padded_grads), (packed, packed_grads) = results
    assert padded.abs().max() > 0 and torch.allclose(packed, padded, atol=1e-12, rtol=0)
    assert padded_grads.keys() == packed_grads.keys() and padded_grads
    for name, grad in padded_grads.items():  # the value head is float32: its gradients sum in another order
        assert torch.allclose(packed_grads[name], grad, atol=1e-6, rtol=1e-5), name


def one_step(model_path: str, loss_options: dict, tokens: int | None, parallel=None,
             critic: bool = False) -> tuple[dict, dict]:
    """A step of two optimizer steps over a float64 tiny policy (and with ``critic`` a value model, PPO's GAE
    advantages): padded micro-batches of 2 rows, or packed ones of ``tokens``; the metrics and the updated weights
    (the critic's prefixed ``critic.``)."""
    policy = load_policy(model_path, dtype=torch.float64, device="cpu")
    torch.manual_seed(0)  # the critic's fresh value head
    value_model = load_policy(model_path, dtype=torch.float64, device="cpu", value_head=True) if critic else None
    if tokens is not None:
        for model in (policy, value_model):
            if model is not None:
                attend_by_row(model)  # as a run does
    loss = GRPOLoss(policy, temperature=0.9, packed=tokens is not None, **loss_options)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    settings = TrainSettings(group_size=3, micro_batch=2, accumulation=2, epochs=1, temperature=0.9,
                             recompute_old_log_probs=True, kl_in_reward_coeff=0.0, reward_scale="group",
                             clip_grad_norm=None, mixed_precision=False, max_nonfinite_updates=3, seed=0,
                             micro_batch_tokens=tokens)
    value = None if value_model is None else Critic(
        value_model, torch.optim.SGD(value_model.parameters(), lr=0.5),
        CriticSettings(gamma=1.0, lmbda=0.95, value_clip=0.2, whiten_advantages=False))
    trainer = Trainer(policy, None, loss, optimizer, settings, torch.device("cpu"), None, parallel, critic=value)
    batch = multi_turn_batch(policy.config.vocab_size, seed=1)
    metrics = trainer.prepare(batch)
    metrics.update(trainer.optimize(batch))
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    if value_model is not None:
        weights.update({f"critic.{n}": p.detach().clone() for n, p in value_model.named_parameters()})
    return metrics, weights


@pytest.mark.parametrize("loss_options", [
    {"aggregation": "token_mean"},
    {"aggregation": "sequence_mean"},
    {"aggregation": "constant_sum", "aggregation_constant": 16.0},
    {"aggregation": "sequence_mean", "importance_level": "sequence"},  # GSPO's sequence ratio
], ids=["token_mean", "sequence_mean", "constant_sum", "gspo"])
def test_a_packed_step_takes_the_padded_steps_update(tiny_model_path, loss_options):
    """Each optimizer step's four rows, two at a time padded or packed by 20 tokens (one to three rows each): the
    weights after the step agree to the rounding of the loss, which every run computes in float32 (measured: 6e-8
    where the step moved a weight by 0.57); a count that differed would be off by tens of percent."""
    padded, padded_weights = one_step(tiny_model_path, loss_options, None)
    packed, packed_weights = one_step(tiny_model_path, loss_options, 20)
    moved = max((padded_weights[k] - w).abs().max().item()
                for k, w in load_policy(tiny_model_path, dtype=torch.float64, device="cpu").named_parameters())
    gap = max((packed_weights[k] - w).abs().max().item() for k, w in padded_weights.items())
    assert moved > 1e-2 and gap < 1e-6 * moved, (moved, gap)
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-6)


def test_a_packed_ppo_step_takes_the_padded_steps_update_policy_and_critic(tiny_model_path):
    """With a critic (GAE advantages from its values, its clipped value loss), packed = padded for both models."""
    padded, padded_weights = one_step(tiny_model_path, {"aggregation": "token_mean"}, None, critic=True)
    packed, packed_weights = one_step(tiny_model_path, {"aggregation": "token_mean"}, 20, critic=True)
    torch.manual_seed(0)
    start = {f"critic.{k}": w for k, w in load_policy(tiny_model_path, dtype=torch.float64, device="cpu",
                                                       value_head=True).named_parameters()}
    moved = max((padded_weights[k] - w).abs().max().item() for k, w in start.items())
    gap = max((packed_weights[k] - w).abs().max().item() for k, w in padded_weights.items())
    assert moved > 1e-2 and gap < 1e-6 * moved, (moved, gap)
    assert packed["explained_variance"] == pytest.approx(padded["explained_variance"], rel=1e-6)


def test_a_model_whose_rows_see_each_other_when_packed_is_refused(tiny_model_path, monkeypatch):
    """The check runs the policy (and a critic) as it is: on the tiny Qwen2 a row packed after another does not move
    (gap 0); with transformers' packed-sequence detection switched off it sees the row before it, and the run is
    refused."""
    import transformers.masking_utils

    from torchrl_grpo.run.build import check_packing_keeps_rows_apart

    policy = load_policy(tiny_model_path, dtype=torch.bfloat16, device="cpu", trainable=False)
    critic = load_policy(tiny_model_path, dtype=torch.bfloat16, device="cpu", trainable=False, value_head=True)

    def values(model, rows, attention):
        return token_values(model, rows, attention, attention, packed=True)

    assert packing_gap(policy) == 0 and packing_gap(critic, values) == 0
    check_packing_keeps_rows_apart(policy)
    check_packing_keeps_rows_apart(critic, values)
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    assert packing_gap(policy) > 0.1
    for model, read, name in ((policy, None, "Qwen2ForCausalLM"), (critic, values, "Qwen2ForTokenClassification")):
        with pytest.raises(ConfigError) as error:
            check_packing_keeps_rows_apart(model, read)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"train.micro_batch_tokens: {name} lets packed rows")
        assert message.endswith("set train.micro_batch_tokens=null")


def test_settings_carry_the_budget():
    cfg = cfg_with("train.micro_batch_tokens=2048", "inference_model.max_model_len=1024")
    from torchrl_grpo.config.spec import resolve_run

    spec = resolve_run(cfg)
    assert spec.train.micro_batch_tokens == 2048 and "tokens per packed micro-batch" in spec.plan.table()
    assert dataclasses.replace(spec.train, micro_batch_tokens=None).micro_batch_tokens is None


def test_grpo_py_trains_packed_micro_batches(tmp_path):
    """grpo.py as users start it, with the transformers engine: the batch plan says so and two steps train."""
    from helpers import SMALL, finite, metric_rows, run

    run_dir = tmp_path / "run"
    done = run([*SMALL, "inference_model.backend=transformers", "inference_model.max_model_len=256",
                "train.micro_batch_tokens=512", "train.total_dialog_turns=16", f"hydra.run.dir={run_dir}"],
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens per packed micro-batch" in done.stdout and "512" in done.stdout
    logged = metric_rows(run_dir)
    assert len(logged) == 2 and all(finite(r["loss"]) and finite(r["grad_norm"]) for r in logged)


def test_attention_by_row_is_plain_sdpa_for_padded_rows_and_generation(tiny_model_path, tokenizer):
    """The same model serves padded micro-batches and (the transformers engine) generation with a KV cache: there
    packed_rows is sdpa, bit for bit."""
    from torchrl_grpo.engines.hf import TransformersEngine

    plain = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", trainable=False)
    by_row = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", trainable=False)
    attend_by_row(by_row)
    batch = multi_turn_batch(plain.config.vocab_size)
    with torch.no_grad():
        padded = [token_log_probs(m, batch["tokens"], batch["attention_mask"], wanted=batch["completion_mask"])[0]
                  for m in (plain, by_row)]
    assert torch.equal(*padded)
    samples = [TransformersEngine(m, tokenizer, seed=3).generate([[5, 9, 13], [7, 3]], n=2, max_tokens=6)
               for m in (plain, by_row)]
    assert [(c.token_ids, c.log_probs) for c in samples[0]] == [(c.token_ids, c.log_probs) for c in samples[1]]


class WrittenElements(TorchDispatchMode):
    """Counts the elements of every tensor the ops under it return: the memory traffic of a backward."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def written_by_backward(rows: int) -> int:
    """Elements written by the per-row sdpa's backward over 256 tokens packed as ``rows`` rows."""
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=1)
    tokens = 256
    positions = torch.arange(tokens // rows).repeat(rows).unsqueeze(0)
    q, k, v = (torch.randn(1, 2, tokens, 4, requires_grad=True) for _ in range(3))
    out, _ = packed_rows(module, q, k, v, None, position_ids=positions)
    written = WrittenElements()
    with written:
        out.sum().backward()
    return written.count


def test_attention_by_row_backward_does_not_grow_with_the_rows():
    """The per-row sdpa's backward writes as much for 32 rows as for 2 in the same tokens: per-row slices wrote a zero
    tensor of the whole micro-batch for each row (rows x tokens), which made packed steps 3x slower on a GPU."""
    assert written_by_backward(32) < 1.2 * written_by_backward(2)


def causal_attention_by_hand(q, k, v, scale):
    """One row's causal attention in float64 from its definition: q [L, heads, dim], k and v [L, kv heads, dim]."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1).double() for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def varlen_stand_in(newer: bool, calls: list):
    """torch's varlen_attn as the two signatures its releases have (2.10's ``is_causal``, no GQA, no scale; later
    ``window_size``, ``enable_gqa``, ``scale``), computing each row from :func:`causal_attention_by_hand`."""
    def rows(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        bounds = cu_q.tolist()
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        calls.append(bounds)
        return torch.cat([causal_attention_by_hand(q[a:b], k[a:b], v[a:b], scale)
                          for a, b in zip(bounds, bounds[1:])]).to(q.dtype)

    if newer:
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                        enable_gqa=False):
            assert window_size == (-1, 0) and (enable_gqa or k.shape[1] == q.shape[1])
            return rows(q, k, v, cu_q, cu_k, max_q, max_k, scale or q.shape[-1] ** -0.5)
    else:
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            assert is_causal and k.shape[1] == q.shape[1]  # no GQA in this release: the heads come repeated
            return rows(q, k, v, cu_q, cu_k, max_q, max_k, q.shape[-1] ** -0.5)
    return varlen_attn


@pytest.mark.parametrize("newer", [False, True], ids=["torch-2.10", "later"])
def test_varlen_rows_lays_out_the_packed_rows_for_torchs_varlen_kernel(monkeypatch, newer):
    """The GPU path's layout, bounds, causality and GQA, against attention computed row by row from its definition
    (torch's kernel itself needs a CUDA device: the stand-in takes its place, with each release's signature)."""
    import inspect

    calls = []
    stand_in = varlen_stand_in(newer, calls)
    monkeypatch.setattr(packed_attention, "VARLEN", stand_in)
    monkeypatch.setattr(packed_attention, "VARLEN_PARAMS", inspect.signature(stand_in).parameters)
    g = torch.Generator().manual_seed(0)
    sizes = [5, 3, 8]
    query = torch.randn(1, 4, sum(sizes), 8, generator=g, dtype=torch.float64)
    key, value = (torch.randn(1, 2, sum(sizes), 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = varlen_rows(query, key, value, [0, 5, 8, 16], scaling=8 ** -0.5)
    assert calls == [[0, 5, 8, 16]] and out.shape == (1, 16, 4, 8)
    begin = 0
    for size in sizes:
        row = slice(begin, begin + size)
        expected = causal_attention_by_hand(*(t[0, :, row].transpose(0, 1) for t in (query, key, value)), 8 ** -0.5)
        torch.testing.assert_close(out[0, row], expected)
        begin += size


def test_packed_rows_takes_varlen_only_where_the_kernel_runs(monkeypatch):
    """On a CPU, or in float32, the rows go through sdpa one by one; a sliding window takes transformers' mask."""
    def refuse(*args, **kwargs):
        raise AssertionError("varlen_attn called off a GPU")

    monkeypatch.setattr(packed_attention, "VARLEN", refuse)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=1)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.bfloat16) for _ in range(3))
    out, _ = packed_rows(module, q, k, v, None, position_ids=positions)
    first = torch.nn.functional.scaled_dot_product_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], is_causal=True)
    torch.testing.assert_close(out[0, :3], first[0].transpose(0, 1))
    assert not packed_attention.varlen_fits(q, None)  # a CPU tensor
    window = torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.ones(8, 8, dtype=torch.bool).tril(-2)
    windowed, _ = packed_rows(module, q, k, v, window[None, None], position_ids=positions, sliding_window=2)
    torch.testing.assert_close(windowed, sdpa_attention_forward(module, q, k, v, window[None, None])[0])


def test_row_bounds_are_read_once_per_position_ids_tensor():
    """Every layer of a forward gets the same position ids: their bounds are computed once (one host sync), and new
    position ids (the next micro-batch) are read again."""
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    first = packed_attention.row_bounds(positions)
    assert first == [0, 3, 5] and packed_attention.row_bounds(positions) is first
    assert packed_attention.row_bounds(torch.tensor([[0, 1, 0, 1, 2]])) == [0, 2, 5]
    assert packed_attention.row_bounds(torch.tensor([[0, 1, 2, 3, 4]])) is None  # one row: plain sdpa
