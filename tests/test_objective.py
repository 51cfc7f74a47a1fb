"""The objective against values computed independently, element by element, in float64 plain Python."""
import math

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from helpers import CONFIG_DIR, cfg_with
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.objective.log_probs import token_log_probs
from torchrl_grpo.objective.loss import GRPOLoss, total_loss
from torchrl_grpo.objective.terms import (
    accumulation_weight,
    aggregate,
    clipped_surrogate,
    completion_mean,
    geometric_mean_surrogate,
    group_advantages,
    kl_estimate,
    loss_token_mask,
    mis_weights,
    off_policy_keep,
    overlong_buffer_tokens,
    overlong_penalty,
    sapo_surrogate,
    sequence_clipped_surrogate,
    tis_weights,
)
from torchrl_grpo.run.build import build_loss


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


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    rewards = [1.0, 0.0, 3.0, 2.0, 0.5, 0.5, 1.5]
    adv, _ = group_advantages(torch.tensor(rewards[:6], dtype=torch.float64), 3, "rloo")
    expected = [r - _mean([x for j, x in enumerate(g) if j != i])
                for g in (rewards[:3], rewards[3:6]) for i, r in enumerate(g)]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert group_advantages(torch.tensor([2.0, 7.0]), 1, "rloo")[0].tolist() == [0.0, 0.0]  # no other completion


def test_reinforce_pp_whitens_over_the_batch_without_a_group_baseline():
    rewards = [1.0, 1.0, 0.0, 3.0, 2.0, 2.0]  # the first group ties: against the batch it still has signal
    adv, tied = group_advantages(torch.tensor(rewards, dtype=torch.float64), 2, "reinforce_pp", eps=0.0)
    m, s = _mean(rewards), _unbiased_std(rewards)
    assert torch.allclose(adv, torch.tensor([(r - m) / s for r in rewards], dtype=torch.float64), atol=1e-12)
    assert adv[0] != 0 and tied.tolist() == [True, True, False, False, True, True]
    assert group_advantages(torch.tensor([0.1] * 6), 3, "reinforce_pp")[0].tolist() == [0.0] * 6  # a tied batch


def test_reinforce_pp_baseline_scales_the_group_centred_rewards_by_their_batch_spread():
    rewards = [1.0, 0.0, 3.0, 2.0, 0.5, 0.5]
    adv, _ = group_advantages(torch.tensor(rewards, dtype=torch.float64), 2, "reinforce_pp_baseline", eps=0.0)
    centred = [r - _mean(rewards[2 * (i // 2): 2 * (i // 2) + 2]) for i, r in enumerate(rewards)]
    s = _unbiased_std([c - _mean(centred) for c in centred])
    assert torch.allclose(adv, torch.tensor([c / s for c in centred], dtype=torch.float64), atol=1e-12)
    assert adv[4:].tolist() == [0.0, 0.0]  # a tied group against its own baseline: no signal


def test_sapo_gate_gradient_is_the_unclipped_one_on_policy_and_fades_smoothly():
    """d/dlogp of ``-(4/tau) sigmoid(tau (w - 1)) A`` is ``-4 sigmoid (1 - sigmoid) w A`` (by hand): ``-A`` at
    ``w = 1``, never exactly 0 past the clip range, smaller the further off-policy, faster for ``tau_neg``."""
    d = [0.0, 0.3, 1.5, -0.7]
    old = torch.zeros(2, 4, dtype=torch.float64)
    logp = torch.tensor([d, d], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, ratio, low, high = sapo_surrogate(logp, old, adv, 1.0, 3.0, 0.2, 0.2)
    loss.sum().backward()

    def sig(x):
        return 1 / (1 + math.exp(-x))

    for i, (a, tau) in enumerate(((2.0, 1.0), (-1.0, 3.0))):
        for t, x in enumerate(d):
            w = math.exp(x)
            assert loss[i, t].item() == pytest.approx(-4 / tau * sig(tau * (w - 1)) * a, abs=1e-12)
            g = sig(tau * (w - 1))
            assert logp.grad[i, t].item() == pytest.approx(-4 * g * (1 - g) * w * a, abs=1e-12)
    assert logp.grad[0, 0].item() == pytest.approx(-2.0) and logp.grad[1, 0].item() == pytest.approx(1.0)
    assert (logp.grad != 0).all()
    assert abs(logp.grad[1, 2]) / abs(logp.grad[1, 0]) < abs(logp.grad[0, 2]) / abs(logp.grad[0, 0])
    assert high[0].tolist() == [False, True, True, False] and low[1].tolist() == [False, False, False, True]


def test_gmpo_clips_each_log_ratio_on_its_advantages_side_and_keeps_the_others_gradient():
    """``-A exp(mean_t m_t)`` by hand: with A > 0 only log-ratios above eps_high are cut, with A < 0 only those
    below -eps_low; a cut token has no gradient, the others ``-A g / n``."""
    d = [[0.9, 0.1, -0.6], [0.9, 0.1, -0.6]]
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp = torch.tensor(d, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.5, -2.0], dtype=torch.float64)
    loss, ratio, low, high = geometric_mean_surrogate(logp, torch.zeros(2, 3, dtype=torch.float64), adv, mask,
                                                      0.4, 0.4)
    loss.sum().backward()
    kept = [[0.4, 0.1, -0.6], [0.9, 0.1, -0.4]]
    for i, a in enumerate((1.5, -2.0)):
        g = math.exp(_mean(kept[i]))
        assert loss[i].item() == pytest.approx(-a * g, abs=1e-12)
        assert ratio[i].item() == pytest.approx(math.exp(_mean(d[i])), abs=1e-12)
        want = [0.0 if kept[i][t] != d[i][t] else -a * g / 3 for t in range(3)]
        assert logp.grad[i].tolist() == pytest.approx(want, abs=1e-12)
    assert high.tolist() == [[True, False, False], [False, False, False]]
    assert low.tolist() == [[False, False, False], [False, False, True]]


def test_cispo_keeps_the_gradient_of_every_token_the_ppo_clip_drops():
    """Ratios past the range on both sides: the PPO clip zeroes those tokens' gradient, CISPO keeps
    ``-clip(w) A`` for each (a float64 computation by hand)."""
    from torchrl_grpo.objective.terms import cispo_surrogate

    base = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    old = base - torch.tensor([[0.5, -0.5, 0.01, 2.0]], dtype=torch.float64)  # ratios e^0.5, e^-0.5, e^0.01, e^2
    adv = torch.tensor([1.0], dtype=torch.float64)
    logp = base.clone().requires_grad_(True)
    loss, ratio, low, high = cispo_surrogate(logp, old, adv, 0.2, 0.28)
    loss.sum().backward()
    weights = [min(max(math.exp(d), 0.8), 1.28) for d in (0.5, -0.5, 0.01, 2.0)]
    assert loss[0].tolist() == pytest.approx([-w * b for w, b in zip(weights, base[0].tolist())], abs=1e-12)
    assert logp.grad[0].tolist() == pytest.approx([-w for w in weights], abs=1e-12)  # none is zero
    assert high[0].tolist() == [True, False, False, True] and low[0].tolist() == [False, True, False, False]
    ppo = base.clone().requires_grad_(True)
    clipped_surrogate(ppo, old, adv, 0.2, 0.28)[0].sum().backward()
    assert ppo.grad[0, 0] == 0 and ppo.grad[0, 3] == 0


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
        self.head = torch.nn.Identity()  # the "hidden state" is already the logits row

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, use_cache=False):
        hidden = self.table[input_ids]
        return type("Out", (), {"logits": self.head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)})()


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
    wanted = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)
    some, _ = token_log_probs(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 0.7, wanted=wanted)
    assert torch.equal(some[wanted], got[wanted]) and some[~wanted].abs().sum() == 0
    p = torch.softmax(model.table.detach()[tokens[0, 0]] / 0.7, -1)
    assert entropy[0, 1].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def _batch(tokens, mask, adv, old, ref, sample=None, truncated=None):
    data = {
        "tokens": tokens,
        "attention_mask": torch.ones_like(tokens, dtype=torch.bool),
        "completion_mask": mask,
        "advantage": adv,
        "old_log_probs": old,
        "sample_log_probs": old if sample is None else sample,
        "truncated": torch.zeros(tokens.shape[0], dtype=torch.bool) if truncated is None else truncated,
    }
    if ref is not None:
        data["ref_log_probs"] = ref
    return TensorDict(data, batch_size=[tokens.shape[0]])


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


@pytest.mark.parametrize("level", ["token", "cispo", "sapo"])
def test_per_token_advantages_value_and_gradient_against_hand_computation(level):
    """loss.advantage=gae: an advantage per token [N, L] (a critic's), each token's term with its own ``A_it``;
    token mean over the batch, as the ppo preset."""
    torch.manual_seed(1)
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4, 2], [2, 2, 0, 1, 1], [1, 4, 4, 0, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    adv = torch.where(mask, torch.randn(3, 5, dtype=torch.float64), torch.full((3, 5), 99.0, dtype=torch.float64))
    current = _hand_logp(model, tokens, 1.0)
    old = (current + 0.3 * torch.randn(current.shape, dtype=torch.float64)) * mask
    loss_fn = GRPOLoss(model, clip_epsilon_low=0.2, clip_epsilon_high=0.28, aggregation="token_mean",
                       importance_level=level)
    out = loss_fn(_batch(tokens, mask, adv, old, None))
    assert loss_fn.signal_rows(_batch(tokens, mask, adv * ~mask, old, None)).tolist() == [False] * 3  # 99s ignored

    def term(logp, i, t):
        w, a = torch.exp(logp[i, t] - old[i, t]), adv[i, t]
        if level == "token":
            return -torch.minimum(w * a, w.clamp(0.8, 1.28) * a)
        if level == "cispo":
            return -w.clamp(0.8, 1.28).detach() * a * logp[i, t]
        tau = 1.0 if a > 0 else 1.05
        return -torch.sigmoid(tau * (w - 1)) * 4 / tau * a

    table = model.table.detach().clone().requires_grad_(True)
    logp = torch.nn.functional.pad(
        torch.log_softmax(table[tokens[:, :-1]], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1), (1, 0))
    terms = [term(logp, i, t) for i in range(3) for t in range(5) if mask[i, t]]
    expected = sum(terms) / len(terms)
    assert out["loss_objective"].item() == pytest.approx(expected.item(), abs=1e-6)
    expected.backward()
    total_loss(out).backward()
    assert torch.allclose(model.table.grad, table.grad, atol=1e-6)


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

    def pad(x):
        return torch.cat([torch.full((2, 1), 7.0, dtype=x.dtype), x, torch.full((2, 2), -5.0, dtype=x.dtype)], 1)

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


# ---------------------------------------------------------------------------------------------------
# the variants (GSPO, TIS, off-policy mask, overlong) against plain-Python computations
# ---------------------------------------------------------------------------------------------------

# A ragged batch of 6 completions: ties in the advantages (1.0 twice, -0.5 twice), an empty row (3), a
# truncated row (4). Per completion token: DELTA = logp - old (the log-ratio), GAMMA = old - sample (the
# TIS log-weight). The values sit away from every clip boundary used below and hit both sides.
V_TOKENS = torch.tensor([[0, 3, 1, 4, 2, 1], [2, 2, 0, 1, 1, 3], [1, 4, 4, 0, 3, 2],
                         [3, 0, 2, 2, 4, 1], [4, 1, 3, 0, 0, 2], [2, 3, 1, 1, 0, 4]])
V_MASK = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0],
                       [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
V_ADV = torch.tensor([1.0, -0.5, 1.0, 0.7, -1.0, -0.5])
V_TRUNCATED = torch.tensor([False, False, False, False, True, False])
DELTA = [[0.3, -0.1, 0.05], [-0.5, -0.2], [0.9], [], [-1.2, 0.4, 0.1, -0.05, 0.2], [0.02, -0.03, 0.15, -0.3]]
GAMMA = [[0.1, 0.6, -0.2], [0.0, 0.5], [-1.2], [], [0.3, 0.3, 0.3, 0.3, 0.3], [0.05, 0.45, -0.1, 0.2]]


def _per_token(rows, mask, outside):
    """[N, L] float64 with the rows' values on the completion tokens and ``outside`` elsewhere."""
    out = torch.full(mask.shape, outside, dtype=torch.float64)
    for i, values in enumerate(rows):
        out[i, mask[i].nonzero().squeeze(-1)] = torch.tensor(values, dtype=torch.float64)
    return out


def _variant_batch(model):
    """old/sample/ref built from the model's own log-probs; junk (+-30) outside the completions."""
    current = _hand_logp(model, V_TOKENS, 1.0)

    def inside(x, fill):
        return torch.where(V_MASK, x, torch.full_like(x, fill))

    old = inside(current - _per_token(DELTA, V_MASK, 0.0), 30.0)
    sample = inside(old - _per_token(GAMMA, V_MASK, 0.0), -30.0)
    ref = inside(current + 0.1 * torch.randn(current.shape, generator=torch.Generator().manual_seed(1),
                                             dtype=torch.float64), 30.0)
    return _batch(V_TOKENS, V_MASK, V_ADV, old, ref, sample=sample, truncated=V_TRUNCATED)


def _hand_objective(logp, batch, v):
    """The objective of variant ``v`` written out per completion and per token with torch scalars
    (differentiable in ``logp``), sharing no code with torchrl_grpo.objective.loss."""
    mask, adv = batch["completion_mask"], batch["advantage"]
    old, sample = batch["old_log_probs"], batch["sample_log_probs"]
    lo, hi = 1 - v["eps_low"], 1 + v["eps_high"]
    cap, threshold, mis = v.get("tis_cap"), v.get("threshold"), v.get("mis_cap")
    rows = []
    for i in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        if v.get("overlong") == "mask" and batch["truncated"][i]:
            toks = []
        if not toks:
            rows.append([])
            continue
        a = float(adv[i])
        if v.get("importance_level") in ("sequence", "gmpo"):
            if v.get("importance_level") == "gmpo":  # each log-ratio clipped on the side A's sign makes it bite
                clip = (lambda x: torch.clamp(x, max=v["eps_high"])) if a > 0 else (
                    lambda x: torch.clamp(x, min=-v["eps_low"]))
                term = -a * torch.exp(sum(clip(logp[i, t] - old[i, t]) for t in toks) / len(toks))
            else:
                s = torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))
                term = -torch.minimum(s * a, torch.clamp(s, lo, hi) * a)
            rho = math.exp(sum(float(old[i, t] - sample[i, t]) for t in toks) / len(toks))
            if cap is not None:
                term = term * min(rho, cap)
            if mis is not None:
                term = term * (rho if 1 / mis <= rho <= mis else 0.0)
            terms = [term] * len(toks)
        else:
            terms = []
            for t in toks:
                w = torch.exp(logp[i, t] - old[i, t])
                if v.get("importance_level") == "cispo":  # a clipped weight held constant, on logp itself
                    term = -min(max(w.item(), lo), hi) * a * logp[i, t]
                elif v.get("importance_level") == "sapo":  # a sigmoid gate, no clip
                    tau = v["tau_pos"] if a > 0 else v["tau_neg"]
                    term = -(4 / tau) * torch.sigmoid(tau * (w - 1)) * a
                else:
                    term = -torch.minimum(w * a, torch.clamp(w, lo, hi) * a)
                rho = math.exp(float(old[i, t] - sample[i, t]))
                if cap is not None:
                    term = term * min(rho, cap)
                if mis is not None:
                    term = term * (rho if 1 / mis <= rho <= mis else 0.0)
                terms.append(term)
        if threshold is not None:
            divergence = sum(float(sample[i, t]) - logp[i, t].item() for t in toks) / len(toks)
            if a < 0 and divergence > threshold:
                terms = [0.0 * x for x in terms]
        rows.append(terms)
    if v["aggregation"] == "token_mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if v["aggregation"] == "sequence_mean":
        present = [r for r in rows if r]
        return sum(sum(r) / len(r) for r in present) / len(present)
    return sum(sum(r) for r in rows) / (len(rows) * v["constant"])


VARIANTS = {
    "grpo": dict(aggregation="sequence_mean", eps_low=0.2, eps_high=0.2),
    "clip_higher_token_mean": dict(aggregation="token_mean", eps_low=0.2, eps_high=0.28),
    "dr_grpo": dict(aggregation="constant_sum", constant=7.0, eps_low=0.2, eps_high=0.2),
    "gspo": dict(aggregation="sequence_mean", importance_level="sequence", eps_low=0.1, eps_high=0.15),
    "overlong_mask": dict(aggregation="token_mean", eps_low=0.2, eps_high=0.28, overlong="mask"),
    "tis_token": dict(aggregation="token_mean", eps_low=0.2, eps_high=0.28, tis_cap=1.5),
    "tis_sequence": dict(aggregation="sequence_mean", importance_level="sequence", eps_low=0.1, eps_high=0.15,
                         tis_cap=1.2),
    "off_policy_mask": dict(aggregation="sequence_mean", eps_low=0.2, eps_high=0.2, threshold=0.05),
    "gspo_off_policy_mask": dict(aggregation="sequence_mean", importance_level="sequence", eps_low=0.1,
                                 eps_high=0.15, threshold=0.05),
    "all_token": dict(aggregation="constant_sum", constant=5.0, eps_low=0.2, eps_high=0.28, tis_cap=1.5,
                      threshold=0.05, overlong="mask"),
    "cispo": dict(aggregation="token_mean", importance_level="cispo", eps_low=1.0, eps_high=0.28),
    "cispo_narrow_tis": dict(aggregation="sequence_mean", importance_level="cispo", eps_low=0.1, eps_high=0.1,
                             tis_cap=1.5),
    "sapo": dict(aggregation="sequence_mean", importance_level="sapo", eps_low=0.2, eps_high=0.2, tau_pos=1.0,
                 tau_neg=1.05),
    "sapo_steep_mis": dict(aggregation="token_mean", importance_level="sapo", eps_low=0.2, eps_high=0.2, tau_pos=2.0,
                           tau_neg=7.0, mis_cap=1.5, overlong="mask"),
    "gmpo": dict(aggregation="sequence_mean", importance_level="gmpo", eps_low=0.4, eps_high=0.4),
    "gmpo_tis_off_policy": dict(aggregation="sequence_mean", importance_level="gmpo", eps_low=0.3, eps_high=0.5,
                                tis_cap=1.2, threshold=0.05),
    "mis_token": dict(aggregation="token_mean", eps_low=0.2, eps_high=0.28, mis_cap=1.5),
    "mis_sequence": dict(aggregation="sequence_mean", importance_level="sequence", eps_low=0.1, eps_high=0.15,
                         mis_cap=1.3),
}


def _loss_for(model, v, **extra):
    return GRPOLoss(
        model, clip_epsilon_low=v["eps_low"], clip_epsilon_high=v["eps_high"], aggregation=v["aggregation"],
        aggregation_constant=v.get("constant", 1.0), importance_level=v.get("importance_level", "token"),
        tis_cap=v.get("tis_cap"), overlong=v.get("overlong", "none"), off_policy_mask_threshold=v.get("threshold"),
        mis_cap=v.get("mis_cap"), tau_pos=v.get("tau_pos", 1.0), tau_neg=v.get("tau_neg", 1.05), **extra,
    )


def _table_logp(table, tokens):
    """Independent float64 log-probs of the table model, differentiable in ``table``."""
    logits = table[tokens[:, :-1]]
    return torch.nn.functional.pad(torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1), (1, 0))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_value_and_gradient_against_hand_computation(name):
    v = VARIANTS[name]
    model = TableLM()
    batch = _variant_batch(model)
    out = _loss_for(model, v)(batch)
    table = model.table.detach().clone().requires_grad_(True)
    expected = _hand_objective(_table_logp(table, V_TOKENS), batch, v)
    assert out["loss_objective"].item() == pytest.approx(expected.item(), abs=1e-6)
    assert expected.item() != 0.0
    out["loss_objective"].backward()
    expected.backward()
    assert torch.allclose(model.table.grad, table.grad, atol=1e-6)
    assert model.table.grad.abs().sum() > 0


def test_variant_batch_hits_clipping_on_both_sides_at_both_levels():
    """The batch above is only a good test if both clip branches are taken at the token and sequence level."""
    model = TableLM()
    b = _variant_batch(model)
    logp = _hand_logp(model, V_TOKENS, 1.0)
    _, _, low, high = clipped_surrogate(logp, b["old_log_probs"], V_ADV.double(), 0.2, 0.28)
    # low: DELTA < log 0.8 with A < 0 (-0.5, -1.2, -0.3); high: DELTA > log 1.28 with A > 0 (0.3, 0.9)
    assert (low & V_MASK).sum() == 3 and (high & V_MASK).sum() == 2
    _, s, low, high = sequence_clipped_surrogate(logp, b["old_log_probs"], V_ADV.double(), V_MASK, 0.1, 0.15)
    assert low.tolist() == [False, True, False, False, True, False]
    assert high.tolist() == [False, False, True, False, False, False]
    want = [math.exp(_mean(d)) if d else 1.0 for d in DELTA]
    assert torch.allclose(s, torch.tensor(want, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("name", ["tis_token", "tis_sequence", "off_policy_mask", "all_token"])
def test_tis_and_off_policy_diagnostics_count_the_right_tokens(name):
    v = VARIANTS[name]
    model = TableLM()
    batch = _variant_batch(model)
    out = _loss_for(model, v)(batch)
    mask = loss_token_mask(V_MASK, V_TRUNCATED, v.get("overlong", "none"))
    rows = [i for i in range(6) if mask[i].any()]
    n_tokens = sum(len(DELTA[i]) for i in rows)
    if "tis_cap" in v:
        cap = v["tis_cap"]
        if v.get("importance_level") == "sequence":
            weights = {i: [min(math.exp(_mean(GAMMA[i])), cap)] * len(GAMMA[i]) for i in rows}
            capped = sum(len(GAMMA[i]) for i in rows if math.exp(_mean(GAMMA[i])) > cap)
        else:
            weights = {i: [min(math.exp(g), cap) for g in GAMMA[i]] for i in rows}
            capped = sum(math.exp(g) > cap for i in rows for g in GAMMA[i])
        assert capped > 0
        assert out["tis_truncated_fraction"].item() == pytest.approx(capped / n_tokens)
        assert out["tis_weight_mean"].item() == pytest.approx(sum(sum(w) for w in weights.values()) / n_tokens)
    else:
        assert "tis_truncated_fraction" not in out.keys()
    if "threshold" in v:
        # D_i = mean(sample - logp) = -mean(DELTA_i + GAMMA_i); dropped iff A_i < 0 and D_i > delta: row 1 only
        divergence = {i: -_mean([d + g for d, g in zip(DELTA[i], GAMMA[i])]) for i in rows}
        dropped = [i for i in rows if V_ADV[i] < 0 and divergence[i] > v["threshold"]]
        assert dropped == [1]
        assert out["off_policy_masked_fraction"].item() == pytest.approx(len(DELTA[1]) / n_tokens)
    else:
        assert "off_policy_masked_fraction" not in out.keys()


@pytest.mark.parametrize("name", ["mis_token", "mis_sequence", "sapo_steep_mis"])
def test_mis_diagnostics_count_the_tokens_that_left_the_loss(name):
    v = VARIANTS[name]
    out = _loss_for(TableLM(), v)(_variant_batch(TableLM()))
    mask = loss_token_mask(V_MASK, V_TRUNCATED, v.get("overlong", "none"))
    rows = [i for i in range(6) if mask[i].any()]
    if v.get("importance_level") == "sequence":
        rho = [r for i in rows for r in [math.exp(_mean(GAMMA[i]))] * len(GAMMA[i])]
    else:
        rho = [math.exp(g) for i in rows for g in GAMMA[i]]
    cap = v["mis_cap"]
    below, above = sum(r < 1 / cap for r in rho), sum(r > cap for r in rho)
    assert below > 0 and above > 0  # the batch leaves the band on both sides
    assert out["mis_masked_fraction"].item() == pytest.approx((below + above) / len(rho))
    assert out["mis_weight_mean"].item() == pytest.approx(sum(r for r in rho if 1 / cap <= r <= cap) / len(rho))


def test_gmpo_clip_fractions_are_per_token_and_its_ratio_per_completion():
    v = VARIANTS["gmpo"]
    out = _loss_for(TableLM(), v)(_variant_batch(TableLM()))
    tokens = [(i, d) for i in range(6) for d in DELTA[i]]
    high = sum(d > 0.4 and V_ADV[i] > 0 for i, d in tokens)
    low = sum(d < -0.4 and V_ADV[i] < 0 for i, d in tokens)
    assert (low, high) == (2, 1)  # -0.5 (row 1), -1.2 (row 4); 0.9 (row 2)
    assert out["clip_fraction_high"].item() == pytest.approx(high / len(tokens))
    assert out["clip_fraction_low"].item() == pytest.approx(low / len(tokens))
    means = [math.exp(_mean(d)) for d in DELTA if d]
    assert (out["ratio_mean"].item() == pytest.approx(_mean(means))
            and out["ratio_max"].item() == pytest.approx(max(means)))


def test_off_policy_keep_drops_exactly_negative_advantage_drifted_completions():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, -0.5, -0.5], [-3.0, 0, 0], [-1.0, -1.0, 0], [0, 0, 0]],
                        dtype=torch.float64)
    sample = torch.tensor([[-0.2, -1.8, -9.0], [-0.5, -0.4, -0.3], [-1.0, 0, 0], [-0.2, -1.8, 0], [0, 0, 0]],
                          dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 0.0, 2.0, -1.0], dtype=torch.float64)
    keep, d = off_policy_keep(logp, sample, adv, mask, 0.3)
    # D = mean(sample - logp): (0.8 + 0.2)/2 = 0.5; (0 + 0.1 + 0.2)/3 = 0.1; 2.0; (0.8 - 0.8)/2 = 0; empty 0
    assert torch.allclose(d, torch.tensor([0.5, 0.1, 2.0, 0.0, 0.0], dtype=torch.float64))
    assert keep.tolist() == [False, True, True, True, True]  # a tie (A = 0) and A > 0 are always kept
    keep, _ = off_policy_keep(logp, sample, adv, mask, 0.5)  # D == delta is kept (strict >)
    assert keep.tolist() == [True, True, True, True, True]


def test_tis_weights_cap_and_count():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -0.5, -2.0, 50.0], [0.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    sample = torch.tensor([[-2.0, -0.5, -1.0, -50.0], [0.0, -1.2, -0.4, 0.0]], dtype=torch.float64)
    w, capped = tis_weights(old, sample, 2.0, mask)
    want = [[min(math.exp(1.0), 2.0), 1.0, math.exp(-1.0), 1.0], [1.0, math.exp(0.2), math.exp(-0.6), 1.0]]
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float64))
    assert (capped & mask).tolist() == [[True, False, False, False], [False, False, False, False]]
    w, capped = tis_weights(old, sample, 1.1, mask, level="sequence")
    assert torch.allclose(w, torch.tensor([1.0, min(math.exp(-0.2), 1.1)], dtype=torch.float64))
    assert capped.tolist() == [False, False]
    w, capped = tis_weights(old, sample, 0.9, mask, level="sequence")
    assert w.tolist() == pytest.approx([0.9, math.exp(-0.2)]) and capped.tolist() == [True, False]


def test_mis_weights_keep_the_ratio_inside_the_band_and_zero_outside():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -0.5, -2.0, 50.0], [0.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    sample = torch.tensor([[-2.0, -0.5, -1.0, -50.0], [0.0, -1.2, -0.4, 0.0]], dtype=torch.float64)
    w, masked = mis_weights(old, sample, 2.0, mask)  # band [0.5, 2]: e^1 out above, e^-1 out below
    want = [[0.0, 1.0, 0.0, 1.0], [1.0, math.exp(0.2), math.exp(-0.6), 1.0]]
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float64))
    assert (masked & mask).tolist() == [[True, False, True, False], [False, False, False, False]]
    w, masked = mis_weights(old, sample, 1.1, mask, level="sequence")  # e^0 kept, e^-0.2 < 1/1.1 out
    assert w.tolist() == pytest.approx([1.0, 0.0]) and masked.tolist() == [False, True]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_extreme_ratios_clip_on_both_sides_with_zero_gradient(level):
    """Ratios e^{+-20}: the clipped branch is taken, the value is the clipped one, no gradient, no inf/NaN."""
    eps_low, eps_high = (0.2, 0.28) if level == "token" else (3e-4, 4e-4)
    logd = torch.tensor([[20.0, 20.0], [-20.0, -20.0], [20.0, 20.0], [-20.0, -20.0], [0.0, 0.0]], dtype=torch.float64)
    logp = logd.clone().requires_grad_(True)
    old = torch.zeros_like(logd)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0], dtype=torch.float64)
    mask = torch.ones(5, 2, dtype=torch.bool)
    if level == "token":
        loss, ratio, low, high = clipped_surrogate(logp, old, adv, eps_low, eps_high)
        per_row = loss[:, 0]
        low, high = low[:, 0], high[:, 0]
    else:
        loss, ratio, low, high = sequence_clipped_surrogate(logp, old, adv, mask, eps_low, eps_high)
        per_row = loss
    big, small = math.exp(20.0), math.exp(-20.0)
    want = [-(1 + eps_high), (1 - eps_low), big, -small, -2.0]  # -min(rA, clip(r)A) by hand
    assert torch.allclose(per_row.detach(), torch.tensor(want, dtype=torch.float64), rtol=1e-12)
    assert low.tolist() == [False, True, False, False, False]
    assert high.tolist() == [True, False, False, False, False]
    loss.sum().backward()
    g = logp.grad
    assert torch.isfinite(g).all()
    assert g[0].abs().sum() == 0 and g[1].abs().sum() == 0  # clipped: no gradient
    assert (g[2] != 0).all() and (g[3] != 0).all() and (g[4] != 0).all()  # unclipped branch: gradient
    if level == "sequence":  # through the mean: each token of row 4 gets -A * s / |y| = -2 * 1 / 2
        assert g[4].tolist() == pytest.approx([-1.0, -1.0])


def test_sequence_surrogate_value_and_gradient_against_plain_python():
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    base = torch.tensor([[0.0, -1.0, -0.7, -2.0], [0.0, 0.0, -0.1, 5.0], [-0.3, -1.5, 3.0, 0.0], [1.0, 2.0, 3.0, 4.0]],
                        dtype=torch.float64)
    old = base - torch.tensor([[9.0, 0.01, 0.02, -0.01], [9.0, 9.0, 0.5, -9.0], [-0.1, -0.2, 9.0, 9.0], [9.0] * 4],
                              dtype=torch.float64)
    adv = torch.tensor([1.5, 1.0, -1.0, 1.0], dtype=torch.float64)
    logp = base.clone().requires_grad_(True)
    loss, ratio, *_ = sequence_clipped_surrogate(logp, old, adv, mask, 0.2, 0.28)
    loss.sum().backward()
    ref = base.clone().requires_grad_(True)
    total = 0.0
    for i in range(4):
        toks = [t for t in range(4) if mask[i, t]]
        if not toks:
            continue
        s = torch.exp(sum(ref[i, t] - old[i, t] for t in toks) / len(toks))
        total = total - torch.minimum(s * adv[i], torch.clamp(s, 0.8, 1.28) * adv[i])
    total.backward()
    assert loss[:3].sum().item() == pytest.approx(total.item(), abs=1e-12)
    assert ratio[3].item() == 1.0 and loss[3].item() == -1.0  # empty: s = 1 (left out by the aggregation)
    assert torch.allclose(logp.grad[:3], ref.grad[:3], atol=1e-12)
    # the row-1 sequence ratio e^{0.5} > 1.28 with A > 0: clipped, no gradient; rows 0 and 2 get some
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0, 1:].abs().min() > 0 and logp.grad[2, :2].abs().min() > 0


@pytest.mark.parametrize("name", ["grpo", "gspo", "tis_token", "tis_sequence", "off_policy_mask", "all_token"])
def test_tied_rewards_and_groups_of_one_give_zero_objective_and_finite_grads(name):
    v = VARIANTS[name]
    for rewards, group in (([0.3] * 6, 3), ([1.0, 0.0, 2.0, 5.0, 1.0, 0.0], 1)):
        model = TableLM()
        batch = _variant_batch(model)
        batch["advantage"] = group_advantages(torch.tensor(rewards), group)[0]
        out = _loss_for(model, v, kl_to_inference_coeff=0.1, entropy_coeff=0.1, kl_to_ref_coeff=0.1)(batch)
        assert out["loss_objective"].item() == 0.0
        assert all(torch.isfinite(value).all() for value in out.values())
        total_loss(out).backward()
        assert torch.isfinite(model.table.grad).all()


@pytest.mark.parametrize("name", ["grpo", "clip_higher_token_mean", "gspo", "tis_sequence", "off_policy_mask"])
def test_empty_and_overlong_masked_rows_contribute_nothing(name):
    """Row 3 (no completion token) and, with overlong=mask, row 4 (truncated) change no loss term: the same
    loss as the batch without them, same gradient."""
    v = dict(VARIANTS[name], overlong="mask")
    model = TableLM()
    batch = _variant_batch(model)
    kwargs = dict(kl_to_inference_coeff=0.1, entropy_coeff=0.1, kl_to_ref_coeff=0.1)
    full = _loss_for(model, v, **kwargs)(batch)
    total_loss(full).backward()
    grad_full, model.table.grad = model.table.grad.clone(), None
    kept = _loss_for(model, v, **kwargs)(batch[torch.tensor([0, 1, 2, 5])])
    total_loss(kept).backward()
    for key in ("loss_objective", "loss_kl_to_ref", "loss_kl_to_inference", "loss_entropy", "ratio_mean", "ess"):
        assert full[key].item() == pytest.approx(kept[key].item(), abs=1e-6), key
    assert torch.allclose(grad_full, model.table.grad, atol=1e-6)


def test_a_batch_without_any_loss_token_is_zero_not_nan():
    model = TableLM()
    batch = _variant_batch(model)
    batch["completion_mask"] = torch.zeros_like(V_MASK)
    for v in VARIANTS.values():
        out = _loss_for(model, v, kl_to_inference_coeff=0.1, entropy_coeff=0.1, kl_to_ref_coeff=0.1)(batch)
        assert all(torch.isfinite(value).all() for value in out.values())
        assert total_loss(out).item() == 0.0
        model.table.grad = None
        total_loss(out).backward()
        assert model.table.grad is None or torch.isfinite(model.table.grad).all()


@pytest.mark.parametrize("name", ["overlong_mask", "gspo", "all_token", "dr_grpo"])
def test_micro_batches_weighted_by_the_loss_equal_the_whole(name):
    """The loop's contract: sum_k loss_k * w_k / sum_k w_k == loss of the whole batch, with w_k from
    GRPOLoss.accumulation_weight (which knows the rows overlong=mask leaves out)."""
    v = VARIANTS[name]
    model = TableLM()
    batch = _variant_batch(model)
    loss = _loss_for(model, v)
    whole = loss(batch)["loss_objective"].item()
    parts = [batch[torch.tensor(idx)] for idx in ([0, 4], [1, 2, 3], [5])]
    weights = [loss.accumulation_weight(p) for p in parts]
    acc = sum(loss(p)["loss_objective"].item() * w for p, w in zip(parts, weights)) / sum(weights)
    assert acc == pytest.approx(whole, abs=1e-6)


def test_kl_diagnostics_per_estimator():
    model = TableLM()
    batch = _variant_batch(model)
    out = GRPOLoss(model)(batch)
    logp = _hand_logp(model, V_TOKENS, 1.0)
    k = {"k1": lambda d: d, "k2": lambda d: d * d / 2, "k3": lambda d: math.exp(-d) + d - 1}
    cells = [(i, t) for i in range(6) for t in range(6) if V_MASK[i, t]]
    for est, f in k.items():
        for key, other in ((f"kl_{est}", batch["ref_log_probs"]), (f"kl_inference_{est}", batch["sample_log_probs"])):
            want = _mean([f(float(logp[i, t] - other[i, t])) for i, t in cells])
            assert out[key].item() == pytest.approx(want, abs=1e-5), key
    del batch["ref_log_probs"]
    out = GRPOLoss(model)(batch)
    assert "kl_k1" not in out.keys() and "kl_inference_k3" in out.keys()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_padding_and_longer_prompt_change_no_term_in_any_variant(name):
    v = VARIANTS[name]
    model = TableLM()
    batch = _variant_batch(model)
    kwargs = dict(kl_to_ref_coeff=0.3, kl_to_inference_coeff=0.2, entropy_coeff=0.1)
    base = _loss_for(model, v, **kwargs)(batch)
    n = len(batch)
    tokens2 = torch.cat([torch.full((n, 1), 2), V_TOKENS, torch.zeros(n, 2, dtype=torch.long)], 1)

    def pad(x, a, b):
        return torch.cat([torch.full((n, 1), a, dtype=x.dtype), x, torch.full((n, 2), b, dtype=x.dtype)], 1)

    batch2 = _batch(tokens2, pad(V_MASK, False, False), V_ADV, pad(batch["old_log_probs"], 7.0, float("inf")),
                    pad(batch["ref_log_probs"], -5.0, float("-inf")),
                    sample=pad(batch["sample_log_probs"], float("nan"), -80.0), truncated=V_TRUNCATED)
    batch2["attention_mask"][:, -2:] = False
    other = _loss_for(model, v, **kwargs)(batch2)
    assert set(other.keys()) == set(base.keys())
    for key in base.keys():
        assert other[key].item() == pytest.approx(base[key].item(), abs=1e-6), key


def test_bf16_inputs_agree_with_float64():
    torch.manual_seed(0)
    mask = torch.rand(4, 40) < 0.8
    mask[3] = False
    logp = -torch.rand(4, 40, dtype=torch.float64) * 3
    old = logp - 0.3 * torch.randn(4, 40, dtype=torch.float64)
    sample = old - 0.3 * torch.randn(4, 40, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.7, 0.4, 2.0], dtype=torch.float64)

    def b(x):
        return x.to(torch.bfloat16)

    def close(got, want):
        return torch.allclose(got.double(), want, rtol=3e-2, atol=3e-2)

    for got, want in (
        (clipped_surrogate(b(logp), b(old), b(adv), 0.2, 0.28)[0], clipped_surrogate(logp, old, adv, 0.2, 0.28)[0]),
        (sequence_clipped_surrogate(b(logp), b(old), b(adv), mask, 0.1, 0.15)[0],
         sequence_clipped_surrogate(logp, old, adv, mask, 0.1, 0.15)[0]),
        (tis_weights(b(old), b(sample), 1.5, mask)[0], tis_weights(old, sample, 1.5, mask)[0]),
        (tis_weights(b(old), b(sample), 1.1, mask, "sequence")[0], tis_weights(old, sample, 1.1, mask, "sequence")[0]),
        (off_policy_keep(b(logp), b(sample), b(adv), mask, 0.1)[1], off_policy_keep(logp, sample, adv, mask, 0.1)[1]),
        (completion_mean(b(logp), mask), completion_mean(logp, mask)),
    ):
        assert got.dtype == torch.float32  # half precision is widened for the exps and sums
        assert torch.isfinite(got.double()).all() and close(got, want)
    for est in ("k1", "k2", "k3"):
        assert close(kl_estimate(b(logp), b(old), est), kl_estimate(logp, old, est))
    for mode in ("token_mean", "sequence_mean", "constant_sum"):
        assert close(aggregate(b(logp), mask, mode, 40.0), aggregate(logp, mask, mode, 40.0))
    # a bf16 token count is exact only up to 256: aggregate counts in float32
    many = torch.ones(1, 1001, dtype=torch.bool)
    assert aggregate(torch.ones(1, 1001, dtype=torch.bfloat16), many, "token_mean").item() == 1.0


def test_overlong_penalty_values():
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 12])
    # max 10, buffer 4: 0 up to 6 tokens, then (6 - len) / 4 down to -1 at 10, -1 beyond
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_buffer_tokens(None, 20480) == 4096 and overlong_buffer_tokens(None, 3) == 1
    assert overlong_buffer_tokens(7, 100) == 7
    # null buffer: 24 // 5 = 4 tokens, the ramp starts after 20
    assert overlong_penalty(torch.tensor([19.0, 20.0, 22.0, 24.0]), 24).tolist() == [0.0, 0.0, -0.5, -1.0]


def test_overlong_mask_empties_truncated_rows_only():
    truncated = torch.tensor([False, True, False])
    assert torch.equal(loss_token_mask(MASK, truncated, "none"), MASK)
    assert torch.equal(loss_token_mask(MASK, truncated, "soft"), MASK)
    masked = loss_token_mask(MASK, truncated, "mask")
    assert masked[1].sum() == 0 and torch.equal(masked[[0, 2]], MASK[[0, 2]])
    with pytest.raises(ValueError):
        loss_token_mask(MASK, truncated, "cut")


@pytest.mark.parametrize("level", ["sequence", "gmpo"])
def test_per_completion_levels_need_sequence_mean(level):
    with pytest.raises(ValueError, match="sequence_mean"):
        GRPOLoss(TableLM(), importance_level=level, aggregation="token_mean")


def test_two_mismatch_corrections_are_refused():
    with pytest.raises(ValueError, match="tis_cap and mis_cap"):
        GRPOLoss(TableLM(), tis_cap=2.0, mis_cap=2.0)
    with pytest.raises(ValueError, match="mis_cap=1.0 must be > 1"):
        GRPOLoss(TableLM(), mis_cap=1.0)


# ---------------------------------------------------------------------------------------------------
# presets (config/loss/*.yaml) through Hydra and validate()
# ---------------------------------------------------------------------------------------------------

PRESETS = tuple(sorted(path.stem for path in (CONFIG_DIR / "loss").glob("*.yaml")))


def test_every_preset_sets_every_loss_key():
    keys = {name: set(OmegaConf.load(CONFIG_DIR / "loss" / f"{name}.yaml")) for name in PRESETS}
    assert all(k == keys["grpo"] for k in keys.values()), keys
    assert {"importance_level", "tis_cap", "overlong", "overlong_buffer", "off_policy_mask_threshold",
            "dynamic_sampling", "max_resample_rounds"} <= keys["grpo"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_compose_validate_and_build(name):
    cfg = cfg_with(f"loss={name}")
    resolve_run(cfg)
    loss = build_loss(cfg, TableLM())
    assert loss.aggregation == cfg.loss.aggregation and loss.importance_level == cfg.loss.importance_level
    assert loss.clip_epsilon_high == pytest.approx(cfg.loss.clip_epsilon_high)
    assert loss.aggregation_constant == cfg.inference_model.max_tokens
    resolve_run(cfg_with(f"loss={name}", "model=qwen2.5-1.5b-instruct"))


def test_preset_values():
    dapo, dr, gspo, grpo = (cfg_with(f"loss={n}").loss for n in ("dapo", "dr_grpo", "gspo", "grpo"))
    assert (dapo.clip_epsilon_low, dapo.clip_epsilon_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
    assert dapo.overlong == "soft" and dapo.dynamic_sampling is True and dapo.max_resample_rounds == 3
    assert (dr.reward_scale, dr.aggregation) == ("none", "constant_sum")
    assert (gspo.importance_level, gspo.aggregation) == ("sequence", "sequence_mean")
    assert (gspo.clip_epsilon_low, gspo.clip_epsilon_high) == (3e-4, 4e-4)
    assert (grpo.aggregation, grpo.reward_scale, grpo.kl_estimator) == ("sequence_mean", "group", "k3")
    assert grpo.overlong == "none" and grpo.dynamic_sampling is False and grpo.importance_level == "token"
    sapo, gmpo, rpp = (cfg_with(f"loss={n}").loss for n in ("sapo", "gmpo", "reinforce_pp"))
    assert (sapo.importance_level, sapo.tau_pos, sapo.tau_neg) == ("sapo", 1.0, 1.05)
    assert (gmpo.importance_level, gmpo.aggregation, gmpo.clip_epsilon_low, gmpo.clip_epsilon_high) == (
        "gmpo", "sequence_mean", 0.4, 0.4)
    assert (rpp.reward_scale, rpp.aggregation) == ("reinforce_pp", "token_mean")
    ppo = cfg_with("loss=ppo").loss
    assert (ppo.advantage, ppo.reward_scale, ppo.importance_level, ppo.aggregation) == ("gae", "none", "token",
                                                                                        "token_mean")
    assert {cfg_with(f"loss={n}").loss.advantage for n in PRESETS if n != "ppo"} == {"group"}
    assert set(PRESETS) >= {"grpo", "dapo", "dr_grpo", "gspo", "cispo", "rloo", "sapo", "gmpo", "reinforce_pp", "ppo"}


@pytest.mark.parametrize("overrides, key", [
    (["loss.importance_level=seq"], "loss.importance_level='seq'"),
    (["loss=gspo", "loss.aggregation=token_mean"], "loss.aggregation=token_mean with loss.importance_level=sequence"),
    (["loss.tis_cap=2", "loss.old_log_probs=engine"], "loss.tis_cap=2 with loss.old_log_probs=engine: "),
    (["loss.tis_cap=0", "loss.old_log_probs=trainer"], "loss.tis_cap=0"),
    (["loss.mis_cap=2", "loss.old_log_probs=engine"], "loss.mis_cap=2 with loss.old_log_probs=engine: "),
    (["loss.mis_cap=1", "loss.old_log_probs=trainer"], "loss.mis_cap=1: must be a number > 1"),
    (["loss.mis_cap=2", "loss.tis_cap=2", "loss.old_log_probs=trainer"], "loss.tis_cap=2 with loss.mis_cap=2: "),
    (["loss=gmpo", "loss.aggregation=token_mean"], "loss.aggregation=token_mean with loss.importance_level=gmpo"),
    (["loss.tau_neg=0"], "loss.tau_neg=0"),
    (["loss.overlong=cut"], "loss.overlong='cut'"),
    (["loss=dapo", "loss.overlong_buffer=24"], "loss.overlong_buffer=24 with inference_model.max_tokens=24"),
    (["loss.overlong_buffer=0"], "loss.overlong_buffer=0"),
    (["loss.off_policy_mask_threshold=-1"], "loss.off_policy_mask_threshold=-1"),
    (["loss.dynamic_sampling=3"], "loss.dynamic_sampling=3"),
    (["loss.max_resample_rounds=-1"], "loss.max_resample_rounds=-1"),
    (["loss.max_resample_rounds=1.5"], "loss.max_resample_rounds=1.5"),
    (["loss.advantage=critic"], "loss.advantage='critic'"),
    (["loss=ppo", "loss.importance_level=sequence", "loss.aggregation=sequence_mean"],
     "loss.advantage=gae with loss.importance_level=sequence: a critic gives an advantage per token"),
    (["loss=ppo", "loss.reward_scale=group"], "loss.advantage=gae with loss.reward_scale=group: the critic is"),
    (["loss=ppo", "loss.off_policy_mask_threshold=0.5"], "loss.advantage=gae with loss.off_policy_mask_threshold"),
    (["loss=ppo", "critic.lmbda=1.5"], "critic.lmbda=1.5: must be in [0, 1]"),
    (["loss=ppo", "critic.value_clip=0"], "critic.value_clip=0: must be a number > 0, or null"),
    (["loss=ppo", "critic.lr=0"], "critic.lr=0"),
])
def test_bad_loss_variant_keys_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        resolve_run(cfg_with(*overrides))
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_good_loss_variant_combinations_validate():
    resolve_run(cfg_with("loss.tis_cap=2", "loss.old_log_probs=trainer"))
    resolve_run(cfg_with("loss=gspo", "loss.tis_cap=1.5", "loss.old_log_probs=trainer",
                         "loss.off_policy_mask_threshold=0.5"))
    resolve_run(cfg_with("loss=dapo", "loss.overlong_buffer=8"))
    resolve_run(cfg_with("loss.overlong=mask", "loss.overlong_buffer=100"))  # the buffer only matters with soft
    resolve_run(cfg_with("loss=ppo", "env.repeats=1", "env.num_envs=4", "critic.value_clip=null", "critic.lmbda=0"))
    resolve_run(cfg_with("loss=ppo", "loss.importance_level=cispo", "loss.tis_cap=2", "loss.old_log_probs=trainer"))
