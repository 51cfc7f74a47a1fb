"""The objective's registered terms (torchrl_grpo/objective/: advantages, surrogates, KL estimators,
aggregations) against values computed independently, element by element, in float64 plain Python."""
import math

import pytest
import torch

from loss_cases import mean, unbiased_std
from torchrl_grpo.objective.advantages import group_advantages
from torchrl_grpo.objective.aggregation import accumulation_weight, aggregate
from torchrl_grpo.objective.kl import kl_estimate
from torchrl_grpo.objective.overlong import loss_token_mask, overlong_buffer_tokens, overlong_penalty
from torchrl_grpo.objective.surrogates import clipped_surrogate, geometric_mean_surrogate, sapo_surrogate


def test_group_advantages_match_hand_formula():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 0.0, 3.0]
    adv, tied = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4, "group", eps=1e-6)
    expected = []
    for g in range(3):
        group = rewards[4 * g: 4 * g + 4]
        m, s = mean(group), unbiased_std(group)
        expected += [(r - m) / (s + 1e-6) for r in group]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert tied.tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_batch_and_none_scaling():
    rewards = [1.0, 0.0, 3.0, 1.0]
    r = torch.tensor(rewards, dtype=torch.float64)
    none, _ = group_advantages(r, 2, "none")
    assert none.tolist() == [0.5, -0.5, 1.0, -1.0]
    batch, _ = group_advantages(r, 2, "batch", eps=0.0)
    s = unbiased_std(rewards)
    assert torch.allclose(batch, torch.tensor([0.5 / s, -0.5 / s, 1 / s, -1 / s], dtype=torch.float64))


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    rewards = [1.0, 0.0, 3.0, 2.0, 0.5, 0.5, 1.5]
    adv, _ = group_advantages(torch.tensor(rewards[:6], dtype=torch.float64), 3, "rloo")
    expected = [r - mean([x for j, x in enumerate(g) if j != i])
                for g in (rewards[:3], rewards[3:6]) for i, r in enumerate(g)]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert group_advantages(torch.tensor([2.0, 7.0]), 1, "rloo")[0].tolist() == [0.0, 0.0]  # no other completion


def test_reinforce_pp_whitens_over_the_batch_without_a_group_baseline():
    rewards = [1.0, 1.0, 0.0, 3.0, 2.0, 2.0]  # the first group ties: against the batch it still has signal
    adv, tied = group_advantages(torch.tensor(rewards, dtype=torch.float64), 2, "reinforce_pp", eps=0.0)
    m, s = mean(rewards), unbiased_std(rewards)
    assert torch.allclose(adv, torch.tensor([(r - m) / s for r in rewards], dtype=torch.float64), atol=1e-12)
    assert adv[0] != 0 and tied.tolist() == [True, True, False, False, True, True]
    assert group_advantages(torch.tensor([0.1] * 6), 3, "reinforce_pp")[0].tolist() == [0.0] * 6  # a tied batch


def test_reinforce_pp_baseline_scales_the_group_centred_rewards_by_their_batch_spread():
    rewards = [1.0, 0.0, 3.0, 2.0, 0.5, 0.5]
    adv, _ = group_advantages(torch.tensor(rewards, dtype=torch.float64), 2, "reinforce_pp_baseline", eps=0.0)
    centred = [r - mean(rewards[2 * (i // 2): 2 * (i // 2) + 2]) for i, r in enumerate(rewards)]
    s = unbiased_std([c - mean(centred) for c in centred])
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
        g = math.exp(mean(kept[i]))
        assert loss[i].item() == pytest.approx(-a * g, abs=1e-12)
        assert ratio[i].item() == pytest.approx(math.exp(mean(d[i])), abs=1e-12)
        want = [0.0 if kept[i][t] != d[i][t] else -a * g / 3 for t in range(3)]
        assert logp.grad[i].tolist() == pytest.approx(want, abs=1e-12)
    assert high.tolist() == [[True, False, False], [False, False, False]]
    assert low.tolist() == [[False, False, False], [False, False, True]]


def test_cispo_keeps_the_gradient_of_every_token_the_ppo_clip_drops():
    """Ratios past the range on both sides: the PPO clip zeroes those tokens' gradient, CISPO keeps
    ``-clip(w) A`` for each (a float64 computation by hand)."""
    from torchrl_grpo.objective.surrogates import cispo_surrogate

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
    seq = mean([mean([1, 2, 3]), 4.0, mean([5, 6])])
    assert aggregate(VALUES, MASK, "sequence_mean").item() == pytest.approx(seq)
    assert aggregate(VALUES, MASK, "constant_sum", constant=10).item() == pytest.approx(21 / (3 * 10))
    empty = MASK.clone()
    empty[1] = False
    assert aggregate(VALUES, empty, "sequence_mean").item() == pytest.approx(mean([2.0, 5.5]))


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
