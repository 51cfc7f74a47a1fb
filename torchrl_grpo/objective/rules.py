"""The rules between the loss's options, written once for both ways a loss is built: the config's validation
names each key ``loss.<key>`` (:func:`torchrl_grpo.config.validate.validate`), :class:`GRPOLoss` built from Python
names its keyword argument. Each option on its own (a registered name, a modifier above its floor) is the config
schema's to check, and GRPOLoss's for its keyword arguments."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrl_grpo.objective.registry import MISMATCH_CORRECTIONS
from torchrl_grpo.objective.surrogates import COMPLETION_LEVELS


def combination_problem(options: Mapping[str, Any], prefix: str = "") -> str | None:
    """The first rule that ``options`` (``aggregation``, ``importance_level`` and the surrogate modifiers, by key)
    break, as one line naming each key as ``prefix + key``; None when they hold."""
    aggregation, level = options.get("aggregation"), options.get("importance_level")
    if level in COMPLETION_LEVELS and aggregation != "sequence_mean":
        return (f"{prefix}aggregation={aggregation} with {prefix}importance_level={level}: that term gives one loss "
                f"per completion, averaged per completion; set {prefix}aggregation=sequence_mean")
    corrections = [key for key in MISMATCH_CORRECTIONS if options.get(key) is not None]
    if len(corrections) > 1:
        settings = " with ".join(f"{prefix}{key}={options.get(key)}" for key in corrections)
        return (f"{settings}: {' and '.join(corrections)} both weigh the loss by the engine/trainer ratio "
                "exp(logp_old - logp_sample); keep one, turn the other off")
    return None
