"""The registries of the objective's terms: a variant is a function registered with ``@register(family, name)``,
and its name is the value of the config key ``loss.<family>`` (``loss.aggregation=token_mean``). A surrogate
modifier is named by its own key instead (``loss.tis_cap``) and is on when that key is not null.
:class:`torchrl_grpo.objective.loss.GRPOLoss` reads the config section through these registries;
``docs/objective.md`` has one row per registered term (equation, key, presets, paper). Importing the
package registers every term (``objective/__init__.py``), whichever module is imported first.

Notation of the terms' docstrings (completion ``i`` of a group of ``G``, token ``t`` of its completion, ``|y_i|``
its number of completion tokens; every log-prob is of the sampled token given its prefix):

* ``logp`` the trained policy's (differentiable), ``logp_old`` the ratio's denominator (``old_log_probs``:
  the engine's sampling log-probs, or the trainer's own recomputed before the update), ``logp_sample``
  the engine's sampling log-probs (``sample_log_probs``), ``logp_ref`` the reference policy's.
* every mean is over the loss mask only (completion tokens), never prompt or padding.

The plain functions under the terms (:func:`~torchrl_grpo.objective.surrogates.clipped_surrogate`, ...) are what
``tests/objective/`` checks against independent float64 computations.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# family -> what its error messages call it; a family's registry is filled by @register below
FAMILIES = {
    "reward_scale": "reward scale",
    "overlong": "overlong",
    "aggregation": "aggregation",
    "kl_estimator": "KL estimator",
    "importance_level": "importance level",
    "surrogate_modifier": "surrogate modifier",
}
REGISTRIES: dict[str, dict[str, Callable]] = {family: {} for family in FAMILIES}
ACCUMULATION_WEIGHTS: dict[str, Callable[[torch.Tensor], float]] = {}
MODIFIER_HINTS: dict[str, str] = {}  # surrogate modifier key -> the fix its config error suggests
MODIFIER_FLOORS: dict[str, float] = {}  # surrogate modifier key -> its parameter must be above this
# the surrogate modifiers that weigh by exp(logp_old - logp_sample), the engine/trainer mismatch: at most one
# of them at a time, and only with the trainer's old log-probs (with the engine's the weight is 1)
MISMATCH_CORRECTIONS: list[str] = []


def register(family: str, name: str, *, weight: Callable[[torch.Tensor], float] | None = None,
             hint: str | None = None, above: float = 0.0, mismatch: bool = False):
    """Decorator: the function becomes choice ``name`` of ``family``. An aggregation also gives its
    accumulation weight, ``weight(loss_mask) -> float``: how much one micro-batch counts in an optimizer step
    so that the weighted micro-batch losses equal the loss of the whole step. A surrogate modifier may give
    the ``hint`` its config key's error suggests, the bound its parameter must be ``above`` (``loss.<name>``
    is a number > ``above``, or null), and whether it is a ``mismatch`` correction
    (:data:`MISMATCH_CORRECTIONS`)."""
    if (family == "aggregation") != (weight is not None):
        raise TypeError(f"{family} {name!r}: an aggregation, and only an aggregation, registers a weight")
    if (hint is not None or above or mismatch) and family != "surrogate_modifier":
        raise TypeError(f"{family} {name!r}: only a surrogate modifier registers a hint, a floor or a mismatch flag")

    def add(fn: Callable) -> Callable:
        if name in REGISTRIES[family]:
            raise ValueError(f"{FAMILIES[family]} {name!r} is registered twice")
        REGISTRIES[family][name] = fn
        if weight is not None:
            ACCUMULATION_WEIGHTS[name] = weight
        if family == "surrogate_modifier":
            MODIFIER_HINTS[name] = hint or f"must be a number > {above:g}, or null to turn it off"
            MODIFIER_FLOORS[name] = above
            if mismatch:
                MISMATCH_CORRECTIONS.append(name)
        return fn

    return add


def term(family: str, name: str) -> Callable:
    """The registered function ``name`` of ``family``; a ValueError listing the choices otherwise."""
    registry = REGISTRIES[family]
    if name not in registry:
        raise ValueError(f"{FAMILIES[family]} {name!r} not in {tuple(registry)}")
    return registry[name]
