"""The recipe's name for the composition root, kept for scripts and notebooks that import it: the builders
live in :mod:`torchrl_grpo.run.build`, the data-parallel launcher in :mod:`torchrl_grpo.parallel.launcher`."""
from torchrl_grpo.config.placement import adopt_torchrun_ranks
from torchrl_grpo.config.spec import RunSpec, resolve_run
from torchrl_grpo.parallel.launcher import data_parallel_ranks, follow_rank, torchrun_follower
from torchrl_grpo.run.build import (
    build_async,
    build_common,
    build_engine,
    build_eval_engine,
    build_eval_task,
    build_follower,
    build_loss,
    build_optimizer,
    build_policy,
    build_sync,
    build_trainer,
    build_weight_check,
    read_inputs,
    seed_everything,
)

__all__ = ["adopt_torchrun_ranks", "build_async", "build_common", "build_engine", "build_eval_engine",
           "build_eval_task", "build_follower", "build_loss", "build_optimizer", "build_policy", "build_sync",
           "build_trainer", "build_weight_check", "data_parallel_ranks", "follow_rank", "read_inputs",
           "resolve_run", "RunSpec", "seed_everything", "torchrun_follower"]
