"""Runs: the composition root (config -> objects), the sync and async loops, evaluation, the run state
(checkpoints and resume), stop requests and the entry scripts' shared preamble. The top layer."""
