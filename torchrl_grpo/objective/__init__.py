"""The GRPO objective family: registered terms, one module per family (``advantages``, ``overlong``,
``aggregation``, ``kl``, ``surrogates``, ``modifiers``), the default GRPO objective in one function (``grpo``) and
the loss that composes the terms (``loss``). Imports only torch and TorchRL."""
# every family's terms register on import: whichever module a caller imports first, the registries are full
from torchrl_grpo.objective import advantages, aggregation, kl, modifiers, overlong, surrogates  # noqa: F401
