"""A streamed batch (ray.streaming): completions sampled across a weight push carry each token's policy version
(torchrl_grpo/episodes/trajectories.py build_batch), and the loss on them takes each token's ratio against the
log-prob of the policy that sampled it: the objective computed in float64 by hand."""
import math

import pytest
import torch

from loss_cases import TableLM, hand_logp
from torchrl_grpo.core.batch import Batch, check_batch
from torchrl_grpo.episodes.episode import Episode
from torchrl_grpo.episodes.play import Played
from torchrl_grpo.episodes.trajectories import build_batch
from torchrl_grpo.objective.loss import GRPOLoss

PROMPT = [0, 3]
# two completions of the prompt: the first sampled across a push (versions 4, 4, then 5), the second after it
COMPLETIONS = [([1, 4, 2], [4, 4, 5]), ([2, 2], [5, 5])]


def streamed_batch(samplers: dict[int, TableLM]):
    played, behaviour = [], []
    for ids, versions in COMPLETIONS:
        tokens = torch.tensor([PROMPT + ids])
        lps = [hand_logp(samplers[v], tokens, 1.0)[0, len(PROMPT) + j].item() for j, v in enumerate(versions)]
        episode = Episode.start(PROMPT)
        episode.add_sampled(ids, lps)
        played.append(Played(episode, len(PROMPT), [], "length", "length", versions=versions))
        behaviour.append([float(torch.tensor(lp, dtype=torch.float32)) for lp in lps])  # as the batch holds them
    return build_batch(played, group_size=2, pad_id=0, version=5), behaviour


def near(policy: TableLM, seed: int) -> TableLM:
    """An earlier policy: ``policy``'s table moved a little (ratios near 1, inside the clip range)."""
    model = TableLM()
    with torch.no_grad():
        noise = torch.randn(policy.table.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        model.table.copy_(policy.table + 0.1 * noise)
    return model


def test_the_loss_takes_each_tokens_ratio_against_the_policy_that_sampled_it():
    policy = TableLM(seed=0)
    samplers = {4: near(policy, 1), 5: near(policy, 2)}
    batch, behaviour = streamed_batch(samplers)
    assert batch[Batch.TOKEN_VERSIONS].tolist() == [[-1, -1, 4, 4, 5], [-1, -1, 5, 5, -1]]
    assert batch[Batch.POLICY_VERSION].tolist() == [4, 5]  # each row's oldest token
    advantages = [1.0, -0.5]
    batch[Batch.OLD_LOG_PROBS] = batch[Batch.SAMPLE_LOG_PROBS]  # the collector's: the engine's, per token
    batch[Batch.ADVANTAGE] = torch.tensor(advantages)
    check_batch(batch)
    loss = GRPOLoss(policy, clip_epsilon_low=0.2, clip_epsilon_high=0.28, aggregation="sequence_mean")(batch)

    current = hand_logp(policy, batch[Batch.TOKENS], 1.0)
    per_row = []
    for i, (ids, _) in enumerate(COMPLETIONS):
        terms = []
        for j in range(len(ids)):
            w = math.exp(current[i, len(PROMPT) + j].item() - behaviour[i][j])
            a = advantages[i]
            terms.append(-min(w * a, min(max(w, 0.8), 1.28) * a))
        per_row.append(sum(terms) / len(terms))
    expected = sum(per_row) / len(per_row)
    assert loss["loss_objective"].item() == pytest.approx(expected, abs=1e-6)
    # the test can tell: one policy's log-probs for every token (the later one's) give another objective
    one_version, _ = streamed_batch({4: samplers[5], 5: samplers[5]})
    one_version[Batch.OLD_LOG_PROBS] = one_version[Batch.SAMPLE_LOG_PROBS]
    one_version[Batch.ADVANTAGE] = torch.tensor(advantages)
    other = GRPOLoss(policy, clip_epsilon_low=0.2, clip_epsilon_high=0.28, aggregation="sequence_mean")(one_version)
    assert abs(other["loss_objective"].item() - expected) > 1e-3
