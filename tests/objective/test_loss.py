"""GRPOLoss (torchrl_grpo/objective/loss.py) on a table language model: values and gradients against hand
computation in float64 plain Python, padding, ties, the entropy bonus."""

import pytest
import torch

from loss_cases import TableLM, hand_logp, loss_batch
from torchrl_grpo.objective.advantages import group_advantages
from torchrl_grpo.objective.log_probs import token_log_probs
from torchrl_grpo.objective.loss import GRPOLoss, total_loss


def test_token_log_probs_shift_and_temperature():
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4], [2, 2, 0, 1]])
    got, entropy = token_log_probs(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 0.7, True)
    assert torch.allclose(got.double(), hand_logp(model, tokens, 0.7), atol=1e-5)
    assert got[:, 0].abs().sum() == 0
    wanted = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)
    some, _ = token_log_probs(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 0.7, wanted=wanted)
    assert torch.equal(some[wanted], got[wanted]) and some[~wanted].abs().sum() == 0
    p = torch.softmax(model.table.detach()[tokens[0, 0]] / 0.7, -1)
    assert entropy[0, 1].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)



def test_grpo_loss_value_and_gradient_against_hand_computation():
    torch.manual_seed(0)
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4, 2], [2, 2, 0, 1, 1], [1, 4, 4, 0, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0])
    current = hand_logp(model, tokens, 1.0)
    old = (current + 0.3 * torch.randn(current.shape, dtype=torch.float64)) * mask
    ref = (current + 0.2 * torch.randn(current.shape, dtype=torch.float64)) * mask
    loss_fn = GRPOLoss(model, clip_epsilon_low=0.2, clip_epsilon_high=0.28, aggregation="sequence_mean",
                       kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.05, entropy_coeff=0.0)
    out = loss_fn(loss_batch(tokens, mask, adv, old, ref))

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
    current = hand_logp(model, tokens, 1.0)
    old = (current + 0.3 * torch.randn(current.shape, dtype=torch.float64)) * mask
    loss_fn = GRPOLoss(model, clip_epsilon_low=0.2, clip_epsilon_high=0.28, aggregation="token_mean",
                       importance_level=level)
    out = loss_fn(loss_batch(tokens, mask, adv, old, None))
    assert loss_fn.rows(loss_batch(tokens, mask, adv * ~mask, old, None)).signal.tolist() == [False] * 3  # 99s ignored

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
    cur = hand_logp(model, tokens, 1.0)
    old, ref = (cur - 0.1) * mask, (cur + 0.2) * mask
    kwargs = dict(kl_to_ref_coeff=0.3, kl_to_inference_coeff=0.2, entropy_coeff=0.1, aggregation="token_mean")
    base = GRPOLoss(model, **kwargs)(loss_batch(tokens, mask, adv, old, ref))
    # one more prompt token in front and two padding tokens at the end of each row
    tokens2 = torch.cat([torch.tensor([[1], [3]]), tokens, torch.zeros(2, 2, dtype=torch.long)], 1)
    mask2 = torch.cat([torch.zeros(2, 1, dtype=torch.bool), mask, torch.zeros(2, 2, dtype=torch.bool)], 1)

    def pad(x):
        return torch.cat([torch.full((2, 1), 7.0, dtype=x.dtype), x, torch.full((2, 2), -5.0, dtype=x.dtype)], 1)

    batch2 = loss_batch(tokens2, mask2, adv, pad(old), pad(ref))
    batch2["attention_mask"][:, -2:] = False
    other = GRPOLoss(model, **kwargs)(batch2)
    for key in ("loss_objective", "loss_kl_to_ref", "loss_kl_to_inference", "loss_entropy", "ess"):
        assert other[key].item() == pytest.approx(base[key].item(), abs=1e-6), key


def test_all_tied_rewards_give_zero_objective_and_finite_grads():
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1], [2, 2, 0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]], dtype=torch.bool)
    adv, _ = group_advantages(torch.tensor([1.0, 1.0]), 2)
    cur = hand_logp(model, tokens, 1.0) * mask
    out = GRPOLoss(model)(loss_batch(tokens, mask, adv, cur, cur))
    assert out["loss_objective"].item() == 0.0
    total_loss(out).backward()
    assert torch.isfinite(model.table.grad).all()


def test_entropy_bonus_value_and_gradient():
    model = TableLM()
    tokens = torch.tensor([[0, 3, 1, 4], [2, 2, 0, 1]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    cur = hand_logp(model, tokens, 1.0) * mask
    out = GRPOLoss(model, entropy_coeff=0.1, aggregation="token_mean")(
        loss_batch(tokens, mask, torch.zeros(2), cur, cur))
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
