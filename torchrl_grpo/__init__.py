"""GRPO post-training on TorchRL: one module per concern (see README.md)."""
