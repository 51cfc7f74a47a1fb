"""The GRPO objective family: per-token log-probs, registered terms, one module per family (``advantages``,
``overlong``, ``aggregation``, ``kl``, ``surrogates``, ``modifiers``; ``registry``), the rules between loss options
(``rules``), the loss that composes the terms (``loss``; its forward reads as the default GRPO objective) and the
actor-critic's terms (``critic``). Imports core (the batch's keys) besides torch and TorchRL."""
# every family's terms register on import: whichever module a caller imports first, the registries are full
from torchrl_grpo.objective import advantages, aggregation, kl, modifiers, overlong, surrogates  # noqa: F401
