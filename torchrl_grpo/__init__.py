"""GRPO post-training on TorchRL: one subpackage per layer, from core up to run (docs/architecture.md)."""


def __getattr__(name):  # `from torchrl_grpo import train, evaluate, export`, imported when first asked for
    if name in ("train", "evaluate"):
        from torchrl_grpo.run import api

        return getattr(api, name)
    if name == "export":
        from torchrl_grpo.run.export import export

        return export
    raise AttributeError(f"module 'torchrl_grpo' has no attribute {name!r}")


__all__ = ["evaluate", "export", "train"]
