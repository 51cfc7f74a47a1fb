"""Batch sources: the collector in this process, the prefetching one (``train.sync_iter=false``) and the Ray
rollout actors. Imports episodes, engines, tasks, config and core."""
