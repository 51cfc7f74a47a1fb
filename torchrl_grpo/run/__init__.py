"""Runs: the ``torchrl-grpo`` command and the Hydra entry points' shared preamble, the Python API, the
composition root (config -> objects), the one loop and its batch sources (sync, prefetching, Ray actors),
evaluation, the run state (checkpoints and resume), stop requests, the export of a trained policy. The top
layer."""
