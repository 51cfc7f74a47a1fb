"""What a run shows and keeps: the step lines, progress bar, metrics.csv, samples, wandb, TensorBoard and MLflow,
the summary, the figures and the memory per step. Imports core and config (its settings)."""
