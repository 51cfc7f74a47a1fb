"""GRPO post-training on TorchRL: one subpackage per layer, from core up to run (docs/architecture.md)."""
