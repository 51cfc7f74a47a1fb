"""Example reward functions to point ``env.rewards`` at (see config/env/length_reward.yaml)."""


def length_reward(completion: str, row) -> float:
    """TRL's first GRPO example: completions of about 20 characters are best, ``-|20 - len|``."""
    return -abs(20 - len(completion))
