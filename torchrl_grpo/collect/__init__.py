"""What makes the step's batches: the collector in this process, the prefetching one (``train.sync_iter=false``),
the Ray rollout actors and the transports of their weights. The loop's batch sources over them are
:mod:`torchrl_grpo.run.sources`'. Imports core, config, objective, models, tasks, episodes and engines."""
