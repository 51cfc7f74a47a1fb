"""GRPOLoss's default loss (the ``grpo`` preset's terms) against GRPO's equation computed by hand in float64 plain
Python, its value and its gradient, on hand-made rows: ragged, one without tokens, ratios past both clip bounds."""
import math

import pytest
import torch

from loss_cases import TableLM, loss_batch
from torchrl_grpo.objective.loss import GRPOLoss, total_loss

# 4 completions of 6 tokens: ragged, one without tokens (row 2); advantages of both signs and a zero; the ratios
# DELTA = logp - old cross both clip bounds
TOKENS = torch.tensor([[0, 3, 1, 4, 2, 1], [2, 2, 0, 1, 1, 3], [1, 4, 4, 0, 3, 2], [3, 0, 2, 2, 4, 1]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([1.0, -0.5, 0.7, 0.0])
DELTA = torch.tensor([[0.0, 0.0, 0.5, -0.1, 0.05, 0.0], [0.0, -0.4, 0.3, 0.0, 0.15, -0.25],
                      [0.0] * 6, [0.0, 0.0, 0.0, -0.3, 0.4, 0.0]])
REF_GAP = torch.tensor([[0.0, 0.0, 0.2, -0.3, 0.1, 0.0], [0.0, 0.1, -0.2, 0.05, 0.0, 0.4],
                        [0.0] * 6, [0.0, 0.0, 0.0, 0.25, -0.15, 0.0]])


def hand_logp(table, i, t):
    """log softmax(table[previous token])[token]: the TableLM's log-prob of token t of row i."""
    row = table[TOKENS[i, t - 1]]
    return row[TOKENS[i, t]] - math.log(sum(math.exp(x) for x in row))


def hand_grpo(table, old, ref, clip_eps, kl_coef):
    """``mean_i mean_t -min(w A, clip(w, 1 - eps, 1 + eps) A) + beta mean_i mean_t k3``, ``w = exp(logp - old)``,
    ``k3 = exp(-d) + d - 1`` with ``d = logp - ref``: each mean over the loss tokens, then the completions with any."""
    per_completion = []
    for i in range(len(TOKENS)):
        tokens = [t for t in range(TOKENS.shape[1]) if MASK[i, t]]
        if not tokens:
            continue
        total = 0.0
        for t in tokens:
            logp, a = hand_logp(table, i, t), ADV[i].item()
            w, d = math.exp(logp - old[i][t]), logp - ref[i][t]
            total += -min(w * a, min(max(w, 1 - clip_eps), 1 + clip_eps) * a) + kl_coef * (math.exp(-d) + d - 1)
        per_completion.append(total / len(tokens))
    return sum(per_completion) / len(per_completion)


@pytest.mark.parametrize("clip_eps, kl_coef", [(0.2, 0.0), (0.2, 0.05), (0.1, 0.3)])
def test_default_loss_is_grpo_by_hand(clip_eps, kl_coef):
    model = TableLM().float()  # float32 like a trained model: the loss is float32 too
    table = model.table.detach().tolist()
    logp = torch.tensor([[hand_logp(table, i, t) if MASK[i, t] else 0.0 for t in range(6)] for i in range(4)])
    old, ref = torch.where(MASK, logp - DELTA, 0.0), torch.where(MASK, logp - REF_GAP, 0.0)  # float32, as a batch's
    loss = GRPOLoss(model, clip_epsilon_low=clip_eps, clip_epsilon_high=clip_eps, kl_to_ref_coeff=kl_coef)
    got = total_loss(loss(loss_batch(TOKENS, MASK, ADV, old, ref)))
    (grad,) = torch.autograd.grad(got, model.table)

    old, ref = old.double().tolist(), ref.double().tolist()
    args, step = (old, ref, clip_eps, kl_coef), 1e-6
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(hand_grpo(table, *args), abs=1e-6)
    for a in range(5):  # the gradient: central differences of the hand loss in each table entry
        for b in range(5):
            up, down = [row[:] for row in table], [row[:] for row in table]
            up[a][b] += step
            down[a][b] -= step
            want = (hand_grpo(up, *args) - hand_grpo(down, *args)) / (2 * step)
            assert grad[a, b].item() == pytest.approx(want, abs=1e-5), (a, b)
