"""The keys of a step's batch, in the order a step fills them.

The batch is a TensorDict of ``N = prompts x G`` rows, group-major (the G completions of a prompt are consecutive),
each row a prompt and its completion (a multi-turn episode: every turn, with what the environment inserted between
them) right-padded to ``L``, the step's longest row. Every module reads and writes it through these names.
"""
from __future__ import annotations


class Batch:
    """Key -> what it holds, its shape and dtype, and who writes it."""

    # the collector (:func:`torchrl_grpo.episodes.trajectories.build_batch`)
    TOKENS = "tokens"  # [N, L] long: prompt and completion ids, right-padded
    ATTENTION_MASK = "attention_mask"  # [N, L] bool: the row's tokens, not its padding
    COMPLETION_MASK = "completion_mask"  # [N, L] bool: the tokens the engine sampled (the loss's tokens)
    SAMPLE_LOG_PROBS = "sample_log_probs"  # [N, L] float32: the engine's log-probs there, 0 elsewhere
    TRUNCATED = "truncated"  # [N] bool: the completion hit max_tokens
    GROUP = "group"  # [N] long: the row's prompt, 0 .. prompts - 1
    POLICY_VERSION = "policy_version"  # [N] long: the trainer update whose weights sampled the row
    REWARD = "reward"  # [N] float32: the weighted total of the row's rewards (the trainer may add a KL penalty)
    REWARDS = "rewards"  # TensorDict [N]: one float [N] per reward name, unweighted (NaN: not applicable)
    # the collector's stand-in, and the trainer's own with ``loss.old_log_probs=trainer``
    OLD_LOG_PROBS = "old_log_probs"  # [N, L] float: the log-probs the ratio is against
    # the trainer (:meth:`torchrl_grpo.training.trainer.Trainer.prepare`)
    REF_LOG_PROBS = "ref_log_probs"  # [N, L] float: the reference policy's (a KL term on)
    ADVANTAGE = "advantage"  # [N] float (group advantages) or [N, L] (GAE)
    VALUE_OLD = "value_old"  # [N, L] float: the critic's values before the update (GAE)
    RETURN = "return"  # [N, L] float: the value targets (GAE)
