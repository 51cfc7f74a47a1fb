"""Async GRPO: Ray rollout actors collect while the trainer optimizes (see torchrl_grpo/run/sources.py, ActorSource).

    python grpo-async.py env=gsm_symbolic                    # one vLLM actor, one-step off-policy
    python grpo-async.py ray.num_actors=2 train.max_staleness=2
    python grpo-async.py ray.address=auto                     # join a running Ray cluster
    python grpo-async.py train_model.num_devices=2            # two data-parallel trainer ranks (gloo on the CPU)

It composes the same config tree as grpo.py with mode=async (added unless a mode= is given).
Exit codes: 0 done (or stopped by SIGINT/SIGTERM with a checkpoint), 2 bad config, 1 a rollout actor
died or hung (one line on stderr, after a checkpoint of the last finished step).
"""
import sys

from torchrl_grpo.run.cli import main

if __name__ == "__main__":
    main(["train-async", *sys.argv[1:]])  # = torchrl-grpo train-async ...
