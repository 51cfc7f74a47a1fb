"""Sync GRPO: collect, then optimize, then push weights (see README.md).

    python grpo.py                                  # SmolLM2-135M on GSM8K (hub), vLLM engine
    python grpo.py env=gsm_symbolic                 # the same, fully offline
    python grpo.py model=tiny env=gsm_symbolic train.total_dialog_turns=32   # a smoke run in seconds
    python grpo.py train.strategy=fsdp train_model.num_devices=2  # two data-parallel ranks (gloo on the CPU)
    torchrun --nnodes 2 --nproc-per-node 1 ... grpo.py            # data-parallel ranks torchrun starts
"""
from torchrl_grpo.allocator import apply_memory_settings

if __name__ == "__main__":
    apply_memory_settings()  # first, before torch is imported: kernel caches bounded, tcmalloc preloaded

from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from grpo_utils import build_sync, data_parallel_ranks, torchrun_follower  # noqa: E402
from torchrl_grpo.command_line import checked_command_line  # noqa: E402
from torchrl_grpo.console import quiet_libraries  # noqa: E402
from torchrl_grpo.errors import exit_with_one_line  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parent / "config")


@checked_command_line(CONFIG_DIR, "grpo_gsm8k")
@hydra.main(config_path=CONFIG_DIR, config_name="grpo_gsm8k", version_base="1.3")
@exit_with_one_line
def main(cfg: DictConfig) -> None:
    from torchrl_grpo.sync_loop import run_sync

    quiet_libraries(cfg.logging.verbose is True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with data_parallel_ranks(cfg, run_dir) as parallel:  # train.strategy=fsdp: this is rank 0, the others follow
        run = build_sync(cfg, run_dir, parallel)
        try:
            run_sync(run)
        finally:
            run.collector.engine.close()


if __name__ == "__main__" and not torchrun_follower():  # under torchrun the ranks above 0 follow rank 0
    main()
