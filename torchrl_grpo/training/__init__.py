"""The trainer: advantages, the reference's and trainer's log-probs, micro-batches and accumulation, the
optimizer step, its state for checkpoints, an actor-critic run's critic, the no-signal watch; and the weight sync,
which pushes its weights into the engines (in this process, their own, or Ray actors), checks and times each
push. Imports core, config, objective, parallel, models and engines."""
