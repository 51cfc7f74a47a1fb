"""The keys of a step's batch, in the order a step fills them, and the dtype and shape of each.

The batch is a TensorDict of ``N = prompts x G`` rows, group-major (the G completions of a prompt are consecutive),
each row a prompt and its completion (a multi-turn episode: every turn, with what the environment inserted between
them) right-padded to ``L``, the step's longest row. Every module reads and writes it through these names.
"""
from __future__ import annotations

from jaxtyping import Bool, Float, Float32, Int64, jaxtyped
from tensordict import TensorDictBase
from torch import Tensor


class Batch:
    """Key -> what it holds and who writes it; its dtype and shape: :data:`SHAPES`."""

    # the collector (:func:`torchrl_grpo.episodes.trajectories.build_batch`)
    TOKENS = "tokens"  # prompt and completion ids, right-padded
    ATTENTION_MASK = "attention_mask"  # the row's tokens, not its padding
    COMPLETION_MASK = "completion_mask"  # the tokens the engine sampled (the loss's tokens)
    SAMPLE_LOG_PROBS = "sample_log_probs"  # the engine's log-probs there, 0 elsewhere
    TRUNCATED = "truncated"  # the completion hit max_tokens
    GROUP = "group"  # the row's prompt, 0 .. prompts - 1
    POLICY_VERSION = "policy_version"  # the trainer update whose weights sampled the row (streamed: its oldest token)
    TOKEN_VERSIONS = "token_versions"  # streamed rows: the policy version that sampled each token, -1 elsewhere
    REWARD = "reward"  # the weighted total of the row's rewards (the trainer may add a KL penalty)
    REWARDS = "rewards"  # a TensorDict: one entry per reward name, unweighted (NaN: not applicable)
    # the collector's stand-in, and the trainer's own with ``loss.old_log_probs=trainer``
    OLD_LOG_PROBS = "old_log_probs"  # the log-probs the ratio is against
    # the trainer (:meth:`torchrl_grpo.training.trainer.Trainer.prepare`)
    REF_LOG_PROBS = "ref_log_probs"  # the reference policy's (a KL term on)
    ADVANTAGE = "advantage"  # one per row (group advantages) or per token (GAE)
    VALUE_OLD = "value_old"  # the critic's values before the update (GAE)
    RETURN = "return"  # the value targets (GAE)


# Key -> its dtype and shape (N rows of L tokens); Batch.REWARDS: those of each of its entries. Float is any float
# dtype (float32, bf16, float64). Checked by check_batch, which the tests call: a run never pays for it.
SHAPES = {
    Batch.TOKENS: Int64[Tensor, "N L"],
    Batch.ATTENTION_MASK: Bool[Tensor, "N L"],
    Batch.COMPLETION_MASK: Bool[Tensor, "N L"],
    Batch.SAMPLE_LOG_PROBS: Float32[Tensor, "N L"],
    Batch.TRUNCATED: Bool[Tensor, " N"],
    Batch.GROUP: Int64[Tensor, " N"],
    Batch.POLICY_VERSION: Int64[Tensor, " N"],
    Batch.TOKEN_VERSIONS: Int64[Tensor, "N L"],
    Batch.REWARD: Float32[Tensor, " N"],
    Batch.REWARDS: Float[Tensor, " N"],
    Batch.OLD_LOG_PROBS: Float[Tensor, "N L"],
    Batch.REF_LOG_PROBS: Float[Tensor, "N L"],
    Batch.ADVANTAGE: Float[Tensor, " N"] | Float[Tensor, "N L"],
    Batch.VALUE_OLD: Float[Tensor, "N L"],
    Batch.RETURN: Float[Tensor, "N L"],
}


def check_batch(batch: TensorDictBase) -> None:
    """Raise a TypeError naming each key of ``batch`` whose dtype or shape is not its :data:`SHAPES` one, ``N`` and
    ``L`` the same for every key. Keys the step has not filled yet are not checked."""
    wrong = []
    with jaxtyped("context"):  # N and L bound by the first key that has them, held to by the others
        for key, kind in SHAPES.items():
            if key in batch.keys():
                values = list(batch[key].values()) if key == Batch.REWARDS else [batch[key]]
                wrong += [f"{key} is {v.dtype} {list(v.shape)}, not {_name(kind)}" for v in values
                          if not isinstance(v, kind)]
    if wrong:
        raise TypeError(f"the batch is not as core.batch.SHAPES says (N, L the same for every key): {'; '.join(wrong)}")


def _name(kind) -> str:
    """``Float[Tensor, 'N L']``, or ``A | B`` for a union."""
    return " | ".join(k.__name__ for k in getattr(kind, "__args__", (kind,)))
