"""The trainer: advantages, the reference's and trainer's log-probs, micro-batches and accumulation, the
optimizer step, the weights it hands to engines, its state for checkpoints. Imports everything below it
but collection and runs."""
