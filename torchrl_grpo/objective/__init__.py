"""The GRPO objective family: registered terms (advantages, ratios, clipping, KL estimators, aggregations,
overlong handling) and the loss that composes them. Imports only torch and TorchRL."""
