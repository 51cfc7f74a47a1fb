"""core.batch.SHAPES is checkable: check_batch names each key whose dtype or shape is not the table's."""
import pytest
import torch
from tensordict import TensorDict

from torchrl_grpo.core.batch import Batch, check_batch

N, L = 2, 5


def batch(**replace):
    data = {Batch.TOKENS: torch.zeros(N, L, dtype=torch.long),
            Batch.COMPLETION_MASK: torch.ones(N, L, dtype=torch.bool),
            Batch.SAMPLE_LOG_PROBS: torch.zeros(N, L), Batch.ADVANTAGE: torch.zeros(N),
            Batch.REWARDS: TensorDict({"correct": torch.zeros(N)}, batch_size=[N])}
    return TensorDict({**data, **replace}, batch_size=[N])


def test_a_batch_as_documented_passes_with_advantages_per_row_or_per_token():
    check_batch(batch())
    check_batch(batch(advantage=torch.zeros(N, L, dtype=torch.float64)))


@pytest.mark.parametrize("key, wrong", [
    (Batch.COMPLETION_MASK, torch.ones(N, L + 1, dtype=torch.bool)),  # another L than the tokens'
    (Batch.SAMPLE_LOG_PROBS, torch.zeros(N, L, dtype=torch.bfloat16)),  # the engine's are float32
    (Batch.TOKENS, torch.zeros(N, L, dtype=torch.int32)),
    (Batch.ADVANTAGE, torch.zeros(N, L, 1)),
    (Batch.REWARDS, TensorDict({"correct": torch.zeros(N, dtype=torch.long)}, batch_size=[N])),
])
def test_a_key_of_the_wrong_dtype_or_shape_is_named(key, wrong):
    with pytest.raises(TypeError, match=f"{key} is "):
        check_batch(batch(**{key: wrong}))
