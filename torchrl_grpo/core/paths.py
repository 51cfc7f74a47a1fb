"""Where the package keeps what it builds and fetches once (converted models, IFEval's tokenizer data)."""
import os
import pathlib


def cache_root() -> pathlib.Path:
    """$TORCHRL_GRPO_CACHE if set, else ~/.cache/torchrl_grpo."""
    env = os.environ.get("TORCHRL_GRPO_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "torchrl_grpo"
