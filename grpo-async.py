"""Async GRPO: Ray rollout actors collect while the trainer optimizes (see torchrl_grpo/async_loop.py).

    python grpo-async.py env=gsm_symbolic                    # one vLLM actor, one-step off-policy
    python grpo-async.py ray.num_actors=2 train.max_staleness=2
    python grpo-async.py ray.address=auto                     # join a running Ray cluster
    python grpo-async.py train_model.num_devices=2            # two data-parallel trainer ranks (gloo on the CPU)

It composes the same config tree as grpo.py with mode=async (added unless a mode= is given).
Exit codes: 0 done (or stopped by SIGINT/SIGTERM with a checkpoint), 2 bad config, 1 a rollout actor
died or hung (one line on stderr, after a checkpoint of the last finished step).
"""
from torchrl_grpo.allocator import apply_memory_settings

if __name__ == "__main__":
    apply_memory_settings()  # first, before torch is imported: kernel caches bounded, tcmalloc preloaded

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from grpo_utils import build_async, data_parallel_ranks, torchrun_follower  # noqa: E402
from torchrl_grpo.command_line import checked_command_line  # noqa: E402
from torchrl_grpo.console import quiet_libraries  # noqa: E402
from torchrl_grpo.errors import exit_with_one_line  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parent / "config")


@checked_command_line(CONFIG_DIR, "grpo_gsm8k")
@hydra.main(config_path=CONFIG_DIR, config_name="grpo_gsm8k", version_base="1.3")
@exit_with_one_line
def main(cfg: DictConfig) -> None:
    from torchrl_grpo.async_loop import run_async

    quiet_libraries(cfg.logging.verbose is True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with data_parallel_ranks(cfg, run_dir) as parallel:  # train.strategy=fsdp: this is rank 0, the others follow
        run_async(build_async(cfg, run_dir, parallel))


if __name__ == "__main__" and not torchrun_follower():  # under torchrun the ranks above 0 follow rank 0
    if not any(arg.startswith("mode=") for arg in sys.argv[1:]):
        sys.argv.insert(1, "mode=async")
    main()
