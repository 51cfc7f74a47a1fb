"""Async GRPO (Ray actors collect while the trainer optimizes): not built yet.

It composes the same config tree as grpo.py (with mode=async) and then stops with a clear message, so
that scripts written for the original recipe fail loudly instead of silently training in sync mode.
"""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from grpo_utils import exit_on_config_error
from torchrl_grpo.errors import ConfigError

CONFIG_DIR = str(Path(__file__).resolve().parent / "config")


@hydra.main(config_path=CONFIG_DIR, config_name="grpo_gsm8k", version_base="1.3")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    raise ConfigError("grpo-async.py: async mode is not available yet; run `python grpo.py` (sync) with the same overrides")


if __name__ == "__main__":
    if not any(arg.startswith("mode=") for arg in sys.argv[1:]):
        sys.argv.insert(1, "mode=async")
    main()
