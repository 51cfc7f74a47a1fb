"""The objective against values computed independently, element by element, in float64 plain Python."""
import math

import pytest
import torch
from tensordict import TensorDict

from torchrl_grpo.objective import (
    GRPOLoss,
    accumulation_weight,
    aggregate,
    clipped_surrogate,
    group_advantages,
    kl_estimate,
    token_log_probs,
    total_loss,
)


def _mean(xs):
    return sum(xs) / len(xs)


def _unbiased_std(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_group_advantages_match_hand_formula():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 0.0, 3.0]
    adv, tied = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4, "group", eps=1e-6)
    expected = []
    for g in range(3):
        group = rewards[4 * g: 4 * g + 4]
        m, s = _mean(group), _unbiased_std(group)
        expected += [(r - m) / (s + 1e-6) for r in group]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert tied.tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_batch_and_none_scaling():
    rewards = [1.0, 0.0, 3.0, 1.0]
    r = torch.tensor(rewards, dtype=torch.float64)
    none, _ = group_advantages(r, 2, "none")
    assert none.tolist() == [0.5, -0.5, 1.0, -1.0]
    batch, _ = group_advantages(r, 2, "batch", eps=0.0)
    s = _unbiased_std(rewards)
    assert torch.allclose(batch, torch.tensor([0.5 / s, -0.5 / s, 1 / s, -1 / s], dtype=torch.float64))


def test_ties_and_group_of_one_give_zero_not_nan():
    adv, tied = group_advantages(torch.tensor([0.7, 0.7, 0.7]), 3)
    assert adv.tolist() == [0.0, 0.0, 0.0] and tied.all()
    adv, tied = group_advantages(torch.tensor([1.0, 5.0]), 1)
    assert adv.tolist() == [0.0, 0.0] and not torch.isnan(adv).any()


def test_kl_estimators():
    logp = torch.tensor([-1.0, -0.2, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -0.2, -2.0], dtype=torch.float64)
    for est, f in {
        "k1": lambda d: d,
        "k2": lambda d: d * d / 2,
        "k3": lambda d: math.exp(-d) + d - 1,
    }.items():
        got = kl_estimate(logp, ref, est)
        want = [f(a - b) for a, b in zip(logp.tolist(), ref.tolist())]
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12), est
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


# ragged batch: 3 completions, completion tokens at different places, padding elsewhere
VALUES = torch.tensor(
    [[9.0, 1.0, 2.0, 3.0, 9.0], [9.0, 9.0, 4.0, 9.0, 9.0], [9.0, 5.0, 6.0, 9.0, 9.0]], dtype=torch.float64
)
MASK = torch.tensor(
    [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0]], dtype=torch.bool
)


def test_aggregations_count_completion_tokens_only():
    assert aggregate(VALUES, MASK, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4 + 5 + 6) / 6)
    seq = _mean([_mean([1, 2, 3]), 4.0, _mean([5, 6])])
    assert aggregate(VALUES, MASK, "sequence_mean").item() == pytest.approx(seq)
    assert aggregate(VALUES, MASK, "constant_sum", constant=10).item() == pytest.approx(21 / (3 * 10))
    empty = MASK.clone()
    empty[1] = False
    assert aggregate(VALUES, empty, "sequence_mean").item() == pytest.approx(_mean([2.0, 5.5]))


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant_sum"])
def test_accumulated_microbatches_equal_the_whole(mode):
    whole = aggregate(VALUES, MASK, mode, constant=4)
    parts = [(VALUES[:2], MASK[:2]), (VALUES[2:], MASK[2:])]
    weights = [accumulation_weight(mode, m) for _, m in parts]
    acc = sum(aggregate(v, m, mode, constant=4) * w for (v, m), w in zip(parts, weights)) / sum(weights)
    assert acc.item() == pytest.approx(whole.item())


def test_clipped_surrogate_both_sides():
    logp_old = torch.zeros(4, 1, dtype=torch.float64)
    ratios = [0.5, 1.5, 0.5, 1.5]
    logp = torch.tensor([[math.log(x)] for x in ratios], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    loss, ratio, low, high = clipped_surrogate(logp, logp_old, adv, 0.2, 0.28)
    want = []
    for w, a in zip(ratios, adv.tolist()):
        want.append(-min(w * a, min(max(w, 0.8), 1.28) * a))
    assert torch.allclose(loss.squeeze(-1), torch.tensor(want, dtype=torch.float64))
    assert low.squeeze(-1).tolist() == [True, False, False, False]
    assert high.squeeze(-1).tolist() == [False, True, False, False]


def test_clipped_tokens_get_no_gradient():
    logp = torch.tensor([[math.log(1.5)], [math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    loss, *_ = clipped_surrogate(logp, torch.zeros(2, 1, dtype=torch.float64), torch.tensor([1.0, 1.0]), 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad[0].item() == 0.0  # ratio 1.5 > 1.2 with A > 0: clipped
    assert logp.grad[1].item() == pytest.approx(-1.1)  # d(-w A)/dlogp = -w A


class TableLM(torch.nn.Module):
    """A 'language model' whose next-token logits depend only on the current token (a learnable table),
    so that expected log-probs can be computed by hand."""

    def __init__(self, vocab=5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        logits = self.table[input_ids]
        return type("Out", (), {"logits": logits[:, -logits_to_keep:] if logits_to_keep else logits})()


def _hand_logp(model, tokens, temperature):
    table = model.table.detach()
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for i in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            row = (table[tokens[i, t - 1]] / temperature).tolist()
            z = math.log(sum(math.exp(x) for x in row))
            out[i, t] = row[tokens[i, t]] - z
    return out


def test_token_log_probs_shift_and_temperature():
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4], [2, 2, 0, 1]])
    got, entropy = token_log_probs(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 0.7, True)
    assert torch.allclose(got.double(), _hand_logp(model, tokens, 0.7), atol=1e-5)
    assert got[:, 0].abs().sum() == 0
    late, _ = token_log_probs(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 0.7, start=2)
    assert torch.equal(late[:, 2:], got[:, 2:]) and late[:, :2].abs().sum() == 0
    p = torch.softmax(model.table.detach()[tokens[0, 0]] / 0.7, -1)
    assert entropy[0, 1].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def _batch(tokens, mask, adv, old, ref):
    return TensorDict(
        {
            "tokens": tokens,
            "attention_mask": torch.ones_like(tokens, dtype=torch.bool),
            "completion_mask": mask,
            "advantage": adv,
            "old_log_probs": old,
            "sample_log_probs": old,
            "ref_log_probs": ref,
        },
        batch_size=[tokens.shape[0]],
    )


def test_grpo_loss_value_and_gradient_against_hand_computation():
    torch.manual_seed(0)
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4, 2], [2, 2, 0, 1, 1], [1, 4, 4, 0, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0])
    current = _hand_logp(model, tokens, 1.0)
    old = (current + 0.3 * torch.randn(current.shape, dtype=torch.float64)) * mask
    ref = (current + 0.2 * torch.randn(current.shape, dtype=torch.float64)) * mask
    loss_fn = GRPOLoss(model, clip_epsilon_low=0.2, clip_epsilon_high=0.28, aggregation="sequence_mean",
                       kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.05, entropy_coeff=0.0)
    out = loss_fn(_batch(tokens, mask, adv, old, ref))

    def hand(logp):
        seqs_obj, seqs_ref, seqs_inf = [], [], []
        for i in range(3):
            obj, kr, ki = [], [], []
            for t in range(5):
                if not mask[i, t]:
                    continue
                w = torch.exp(logp[i, t] - old[i, t])
                a = adv[i].double()
                obj.append(-torch.minimum(w * a, w.clamp(0.8, 1.28) * a))
                d = logp[i, t] - ref[i, t]
                kr.append(torch.exp(-d) + d - 1)
                d = logp[i, t] - old[i, t]
                ki.append(torch.exp(-d) + d - 1)
            seqs_obj.append(sum(obj) / len(obj))
            seqs_ref.append(sum(kr) / len(kr))
            seqs_inf.append(sum(ki) / len(ki))
        return sum(seqs_obj) / 3, 0.1 * sum(seqs_ref) / 3, 0.05 * sum(seqs_inf) / 3

    # independent value: a float64 table model, differentiated through a plain log-softmax
    table = model.table.detach().clone().requires_grad_(True)
    logits = table[tokens[:, :-1]]
    logp = torch.nn.functional.pad(
        torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1), (1, 0))
    obj, kr, ki = hand(logp)
    assert out["loss_objective"].item() == pytest.approx(obj.item(), abs=1e-5)
    assert out["loss_kl_to_ref"].item() == pytest.approx(kr.item(), abs=1e-5)
    assert out["loss_kl_to_inference"].item() == pytest.approx(ki.item(), abs=1e-5)
    (obj + kr + ki).backward()
    total_loss(out).backward()
    assert torch.allclose(model.table.grad, table.grad, atol=1e-5)


def test_padding_and_longer_prompt_change_no_term():
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4], [2, 2, 0, 1]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    cur = _hand_logp(model, tokens, 1.0)
    old, ref = (cur - 0.1) * mask, (cur + 0.2) * mask
    kwargs = dict(kl_to_ref_coeff=0.3, kl_to_inference_coeff=0.2, entropy_coeff=0.1, aggregation="token_mean")
    base = GRPOLoss(model, **kwargs)(_batch(tokens, mask, adv, old, ref))
    # one more prompt token in front and two padding tokens at the end of each row
    tokens2 = torch.cat([torch.tensor([[1], [3]]), tokens, torch.zeros(2, 2, dtype=torch.long)], 1)
    mask2 = torch.cat([torch.zeros(2, 1, dtype=torch.bool), mask, torch.zeros(2, 2, dtype=torch.bool)], 1)
    pad = lambda x: torch.cat([torch.full((2, 1), 7.0, dtype=x.dtype), x, torch.full((2, 2), -5.0, dtype=x.dtype)], 1)
    batch2 = _batch(tokens2, mask2, adv, pad(old), pad(ref))
    batch2["attention_mask"][:, -2:] = False
    other = GRPOLoss(model, **kwargs)(batch2)
    for key in ("loss_objective", "loss_kl_to_ref", "loss_kl_to_inference", "loss_entropy", "ess"):
        assert other[key].item() == pytest.approx(base[key].item(), abs=1e-6), key


def test_all_tied_rewards_give_zero_objective_and_finite_grads():
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1], [2, 2, 0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]], dtype=torch.bool)
    adv, _ = group_advantages(torch.tensor([1.0, 1.0]), 2)
    cur = _hand_logp(model, tokens, 1.0) * mask
    out = GRPOLoss(model)(_batch(tokens, mask, adv, cur, cur))
    assert out["loss_objective"].item() == 0.0
    total_loss(out).backward()
    assert torch.isfinite(model.table.grad).all()


def test_entropy_bonus_value_and_gradient():
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4], [2, 2, 0, 1]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    cur = _hand_logp(model, tokens, 1.0) * mask
    out = GRPOLoss(model, entropy_coeff=0.1, aggregation="token_mean")(
        _batch(tokens, mask, torch.zeros(2), cur, cur))
    total_loss(out).backward()
    table = model.table.detach().clone().requires_grad_(True)
    terms = []
    for i in range(2):
        for t in range(1, 4):
            if mask[i, t]:
                logp = torch.log_softmax(table[tokens[i, t - 1]], -1)
                terms.append(-(logp.exp() * logp).sum())
    expected = -0.1 * sum(terms) / len(terms)
    assert out["loss_entropy"].item() == pytest.approx(expected.item(), abs=1e-6)
    expected.backward()
    assert torch.allclose(model.table.grad, table.grad, atol=1e-6)
