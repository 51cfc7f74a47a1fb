"""The default objective in one function (torchrl_grpo/objective/grpo.py) against GRPOLoss's default loss, bit for
bit, and against a hand computation in float64 plain Python."""
import math

import pytest
import torch

from loss_cases import TableLM, loss_batch
from torchrl_grpo.objective.grpo import grpo_objective
from torchrl_grpo.objective.log_probs import token_log_probs
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


def _inputs(model):
    """The policy's log-probs as GRPOLoss's forward reads them (float32, zeros outside the completions), and the
    batch's old and reference log-probs at the gaps above from them."""
    logp, _ = token_log_probs(model, TOKENS, torch.ones_like(TOKENS, dtype=torch.bool), 1.0, with_entropy=True,
                              wanted=MASK)
    logp = torch.where(MASK, logp.float(), 0.0)
    old = torch.where(MASK, logp.detach() - DELTA, 0.0)
    ref = torch.where(MASK, logp.detach() - REF_GAP, 0.0)
    return logp, old, ref


@pytest.mark.parametrize("clip_eps, kl_coef", [(0.2, 0.0), (0.2, 0.05), (0.1, 0.3)])
def test_grpo_objective_is_grpo_loss_default_bit_for_bit(clip_eps, kl_coef):
    model = TableLM().float()  # float32 like a trained model's log-probs and entropy: the total is float32 too
    logp, old, ref = _inputs(model)
    want_loss = GRPOLoss(model, clip_epsilon_low=clip_eps, clip_epsilon_high=clip_eps, kl_to_ref_coeff=kl_coef)
    want = total_loss(want_loss(loss_batch(TOKENS, MASK, ADV, old, ref)))
    (want_grad,) = torch.autograd.grad(want, model.table)
    got = grpo_objective(logp, old, ref, ADV, MASK, clip_eps=clip_eps, kl_coef=kl_coef)
    (got_grad,) = torch.autograd.grad(got, model.table)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_grpo_objective_against_hand_computation():
    logp = torch.where(MASK, -1.0 - 0.1 * TOKENS.double(), 0.0)
    old, ref = torch.where(MASK, logp - DELTA.double(), 0.0), torch.where(MASK, logp - REF_GAP.double(), 0.0)
    per_completion = []
    for i in range(4):
        tokens = [t for t in range(6) if MASK[i, t]]
        if not tokens:
            continue
        total = 0.0
        for t in tokens:
            w, a = (logp[i, t] - old[i, t]).exp().item(), ADV[i].item()
            d = (logp[i, t] - ref[i, t]).item()
            total += -min(w * a, min(max(w, 0.8), 1.2) * a) + 0.05 * (math.exp(-d) + d - 1)
        per_completion.append(total / len(tokens))
    got = grpo_objective(logp, old, ref, ADV.double(), MASK, clip_eps=0.2, kl_coef=0.05)
    assert got.item() == pytest.approx(sum(per_completion) / len(per_completion), abs=1e-12)
