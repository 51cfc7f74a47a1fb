"""Sync GRPO: collect, then optimize, then push weights (see README.md).

    python grpo.py                                  # SmolLM2-135M on GSM8K (hub), vLLM engine
    python grpo.py env=gsm_symbolic                 # the same, fully offline
    python grpo.py model=tiny env=gsm_symbolic train.total_dialog_turns=32   # a smoke run in seconds
    python grpo.py train.strategy=fsdp train_model.num_devices=2  # two data-parallel ranks (gloo on the CPU)
    torchrun --nnodes 2 --nproc-per-node 1 ... grpo.py            # data-parallel ranks torchrun starts
"""
from torchrl_grpo.core.allocator import apply_memory_settings

if __name__ == "__main__":
    apply_memory_settings()  # first, before torch is imported: kernel caches bounded, tcmalloc preloaded

from torchrl_grpo.run.entry import entry_point, torchrun_follower, train_sync  # noqa: E402


@entry_point
def main(cfg, run_dir):
    train_sync(cfg, run_dir)


if __name__ == "__main__" and not torchrun_follower():  # under torchrun the ranks above 0 follow rank 0
    main()
