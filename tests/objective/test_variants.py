"""The objective's variants (GSPO, GMPO, CISPO, SAPO, TIS, MIS, off-policy mask, overlong) through GRPOLoss against
plain-Python computations, element by element."""
import math

import pytest
import torch

from loss_cases import TableLM, hand_logp, loss_batch, mean
from torchrl_grpo.objective.advantages import group_advantages
from torchrl_grpo.objective.aggregation import aggregate, completion_mean
from torchrl_grpo.objective.kl import kl_estimate
from torchrl_grpo.objective.loss import GRPOLoss, total_loss
from torchrl_grpo.objective.modifiers import mis_weights, off_policy_keep, tis_weights
from torchrl_grpo.objective.overlong import loss_token_mask
from torchrl_grpo.objective.surrogates import clipped_surrogate, sequence_clipped_surrogate

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
    current = hand_logp(model, V_TOKENS, 1.0)

    def inside(x, fill):
        return torch.where(V_MASK, x, torch.full_like(x, fill))

    old = inside(current - _per_token(DELTA, V_MASK, 0.0), 30.0)
    sample = inside(old - _per_token(GAMMA, V_MASK, 0.0), -30.0)
    ref = inside(current + 0.1 * torch.randn(current.shape, generator=torch.Generator().manual_seed(1),
                                             dtype=torch.float64), 30.0)
    return loss_batch(V_TOKENS, V_MASK, V_ADV, old, ref, sample=sample, truncated=V_TRUNCATED)


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
    logp = hand_logp(model, V_TOKENS, 1.0)
    _, _, low, high = clipped_surrogate(logp, b["old_log_probs"], V_ADV.double(), 0.2, 0.28)
    # low: DELTA < log 0.8 with A < 0 (-0.5, -1.2, -0.3); high: DELTA > log 1.28 with A > 0 (0.3, 0.9)
    assert (low & V_MASK).sum() == 3 and (high & V_MASK).sum() == 2
    _, s, low, high = sequence_clipped_surrogate(logp, b["old_log_probs"], V_ADV.double(), V_MASK, 0.1, 0.15)
    assert low.tolist() == [False, True, False, False, True, False]
    assert high.tolist() == [False, False, True, False, False, False]
    want = [math.exp(mean(d)) if d else 1.0 for d in DELTA]
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
            weights = {i: [min(math.exp(mean(GAMMA[i])), cap)] * len(GAMMA[i]) for i in rows}
            capped = sum(len(GAMMA[i]) for i in rows if math.exp(mean(GAMMA[i])) > cap)
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
        divergence = {i: -mean([d + g for d, g in zip(DELTA[i], GAMMA[i])]) for i in rows}
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
        rho = [r for i in rows for r in [math.exp(mean(GAMMA[i]))] * len(GAMMA[i])]
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
    means = [math.exp(mean(d)) for d in DELTA if d]
    assert (out["ratio_mean"].item() == pytest.approx(mean(means))
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
    GRPOLoss.rows' weight (which knows the rows overlong=mask leaves out)."""
    v = VARIANTS[name]
    model = TableLM()
    batch = _variant_batch(model)
    loss = _loss_for(model, v)
    whole = loss(batch)["loss_objective"].item()
    parts = [batch[torch.tensor(idx)] for idx in ([0, 4], [1, 2, 3], [5])]
    weights = [loss.rows(p).weight() for p in parts]
    acc = sum(loss(p)["loss_objective"].item() * w for p, w in zip(parts, weights)) / sum(weights)
    assert acc == pytest.approx(whole, abs=1e-6)


def test_kl_diagnostics_per_estimator():
    model = TableLM()
    batch = _variant_batch(model)
    out = GRPOLoss(model)(batch)
    logp = hand_logp(model, V_TOKENS, 1.0)
    k = {"k1": lambda d: d, "k2": lambda d: d * d / 2, "k3": lambda d: math.exp(-d) + d - 1}
    cells = [(i, t) for i in range(6) for t in range(6) if V_MASK[i, t]]
    for est, f in k.items():
        for key, other in ((f"kl_{est}", batch["ref_log_probs"]), (f"kl_inference_{est}", batch["sample_log_probs"])):
            want = mean([f(float(logp[i, t] - other[i, t])) for i, t in cells])
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

    batch2 = loss_batch(tokens2, pad(V_MASK, False, False), V_ADV, pad(batch["old_log_probs"], 7.0, float("inf")),
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


@pytest.mark.parametrize("level", ["sequence", "gmpo"])
def test_per_completion_levels_need_sequence_mean(level):
    with pytest.raises(ValueError, match="sequence_mean"):
        GRPOLoss(TableLM(), importance_level=level, aggregation="token_mean")


def test_two_mismatch_corrections_are_refused():
    with pytest.raises(ValueError, match="tis_cap and mis_cap"):
        GRPOLoss(TableLM(), tis_cap=2.0, mis_cap=2.0)
    with pytest.raises(ValueError, match="mis_cap=1.0 must be > 1"):
        GRPOLoss(TableLM(), mis_cap=1.0)
