"""Sync GRPO: collect, then optimize, then push weights (see README.md).

    python grpo.py                                  # SmolLM2-135M on GSM8K (hub), vLLM engine
    python grpo.py env=gsm_symbolic                 # the same, fully offline
    python grpo.py model=tiny env=gsm_symbolic train.total_dialog_turns=32   # a smoke run in seconds
    python grpo.py train.strategy=fsdp train_model.num_devices=2  # two data-parallel ranks (gloo on the CPU)
    torchrun --nnodes 2 --nproc-per-node 1 ... grpo.py            # data-parallel ranks torchrun starts
"""
import sys

from torchrl_grpo.run.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])  # = torchrl-grpo train ...
