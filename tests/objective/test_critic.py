"""The actor-critic's terms against values computed independently in float64 plain Python."""
import math

import pytest
import torch

from torchrl_grpo.objective.critic import (
    clipped_value_loss,
    explained_variance,
    gae,
    last_token,
    token_rewards,
    token_values,
    whiten,
)

# three rows over 9 positions: a prompt then a completion then padding; two turns with the environment's tokens
# between them; a row without any completion token
MASK = torch.tensor([
    [0, 0, 1, 1, 1, 1, 0, 0, 0],
    [0, 1, 1, 0, 0, 1, 1, 1, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0],
], dtype=torch.bool)


def _plain_gae(rewards, values, mask, gamma, lmbda):
    """Backwards over each row's completion tokens, in the order they come, skipping every other position."""
    advantages = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        steps = [t for t, m in enumerate(row) if m]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            running = delta + gamma * lmbda * running
            advantages[i][t] = running
            next_value = values[i][t]
    return advantages


@pytest.mark.parametrize("gamma,lmbda", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_plain_python_over_gaps_padding_and_empty_rows(gamma, lmbda):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    rewards = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    advantages, returns = gae(rewards, values, MASK, gamma, lmbda)
    expected = _plain_gae(rewards.tolist(), values.tolist(), MASK.tolist(), gamma, lmbda)
    assert advantages.dtype == torch.float64
    assert torch.allclose(advantages, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    expected_returns = [[a + v if m else 0.0 for a, v, m in zip(ar, vr, mr)]
                        for ar, vr, mr in zip(expected, values.tolist(), MASK.tolist())]
    assert torch.allclose(returns, torch.tensor(expected_returns, dtype=torch.float64), atol=1e-12)
    assert not advantages[~MASK].any()  # what is outside the completions (values there too) never leaks in


def test_gae_with_lambda_and_gamma_one_is_the_reward_to_go_minus_the_value():
    values = torch.tensor([[0.0, 0.5, -1.0, 2.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True]])
    advantages, returns = gae(rewards, values, mask, 1.0, 1.0)
    assert advantages.tolist() == [[0.0, 2.5, 4.0, 1.0]]
    assert returns.tolist() == [[0.0, 3.0, 3.0, 3.0]]


def test_token_rewards_put_the_reward_on_the_last_token_and_the_kl_on_every_token():
    reward = torch.tensor([2.0, -1.0, 5.0])
    kl = torch.arange(27, dtype=torch.float32).view(3, 9) / 10
    assert last_token(MASK).nonzero().tolist() == [[0, 5], [1, 7]]
    plain = token_rewards(reward, MASK)
    assert plain[0, 5] == 2.0 and plain[1, 7] == -1.0 and plain.abs().sum() == 3.0
    with_kl = token_rewards(reward, MASK, kl, kl_coeff=0.5)
    for i, row in enumerate(MASK.tolist()):
        steps = [t for t, m in enumerate(row) if m]
        for t in range(9):
            expected = ((reward[i].item() if steps and t == steps[-1] else 0.0)
                        - (0.5 * kl[i, t].item() if row[t] else 0))
            assert with_kl[i, t].item() == pytest.approx(expected, abs=1e-6)


def test_clipped_value_loss_value_and_gradient_against_plain_python():
    old = [0.0, 1.0, -0.5, 2.0, 0.3]
    new = [0.5, 0.9, -1.2, 2.05, 0.3]
    ret = [1.0, 0.0, 0.0, 2.2, -1.0]
    clip = 0.2
    values = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    loss, clipped = clipped_value_loss(values, torch.tensor(old), torch.tensor(ret), clip)
    loss.sum().backward()
    for k, (o, v, r) in enumerate(zip(old, new, ret)):
        moved = o + max(-clip, min(clip, v - o))
        a, b = (v - r) ** 2, (moved - r) ** 2
        assert loss[k].item() == pytest.approx(0.5 * max(a, b), abs=1e-6)
        assert bool(clipped[k]) == (b > a)
        # the clipped branch has no gradient where the clip bites; otherwise d/dv 0.5 (v - r)^2 = v - r
        grad = 0.0 if (b > a and abs(v - o) > clip) else (v - r)
        assert values.grad[k].item() == pytest.approx(grad, abs=1e-6)
    unclipped, none = clipped_value_loss(torch.tensor(new), torch.tensor(old), torch.tensor(ret), None)
    assert torch.allclose(unclipped, 0.5 * (torch.tensor(new) - torch.tensor(ret)) ** 2) and not none.any()


def test_explained_variance_against_plain_python():
    returns = torch.tensor([[1.0, 2.0, 0.0, 9.0], [4.0, 0.0, 0.0, 9.0]])
    values = torch.tensor([[1.5, 1.0, 7.0, 9.0], [3.0, 0.0, 0.0, 9.0]])
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    r, v = [1.0, 2.0, 4.0], [1.5, 1.0, 3.0]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1)  # noqa: E731
    assert explained_variance(values, returns, mask) == pytest.approx(1 - var([a - b for a, b in zip(r, v)]) / var(r))
    assert explained_variance(returns, returns, mask) == 1.0
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask))  # returns that do not vary


def test_whiten_over_the_masked_tokens_of_the_batch():
    x = torch.tensor([[1.0, 100.0, 3.0], [5.0, -7.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True], [True, False, False]])
    picked = [1.0, 3.0, 5.0]
    m = sum(picked) / 3
    s = math.sqrt(sum((p - m) ** 2 for p in picked) / 2)
    out = whiten(x, mask, eps=0.0)
    assert torch.allclose(out[mask], torch.tensor([(p - m) / s for p in picked], dtype=torch.float64))
    assert not out[~mask].any()


class _EchoCritic(torch.nn.Module):
    """A 'critic' whose value head outputs each position's token id."""

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": input_ids.float().unsqueeze(-1)})


def test_token_values_read_the_state_before_each_token():
    tokens = torch.tensor([[7, 8, 9, 10], [3, 4, 5, 0]])
    wanted = torch.tensor([[False, False, True, True], [False, True, True, False]])
    values = token_values(_EchoCritic(), tokens, torch.ones_like(tokens), wanted)
    assert values.tolist() == [[0.0, 0.0, 8.0, 9.0], [0.0, 3.0, 4.0, 0.0]]
