"""Async GRPO: Ray rollout actors collect while the trainer optimizes (see torchrl_grpo/run/sources.py, ActorSource).

    python grpo-async.py env=gsm_symbolic                    # one vLLM actor, one-step off-policy
    python grpo-async.py ray.num_actors=2 train.max_staleness=2
    python grpo-async.py ray.address=auto                     # join a running Ray cluster
    python grpo-async.py train_model.num_devices=2            # two data-parallel trainer ranks (gloo on the CPU)

It composes the same config tree as grpo.py with mode=async (added unless a mode= is given).
Exit codes: 0 done (or stopped by SIGINT/SIGTERM with a checkpoint), 2 bad config, 1 a rollout actor
died or hung (one line on stderr, after a checkpoint of the last finished step).
"""
from torchrl_grpo.core.allocator import apply_memory_settings

if __name__ == "__main__":
    apply_memory_settings()  # first, before torch is imported: kernel caches bounded, tcmalloc preloaded

import sys  # noqa: E402

from torchrl_grpo.run.entry import entry_point, torchrun_follower, train_async  # noqa: E402


@entry_point
def main(cfg, run_dir):
    train_async(cfg, run_dir)


if __name__ == "__main__" and not torchrun_follower():  # under torchrun the ranks above 0 follow rank 0
    if not any(arg.startswith("mode=") for arg in sys.argv[1:]):
        sys.argv.insert(1, "mode=async")
    main()
