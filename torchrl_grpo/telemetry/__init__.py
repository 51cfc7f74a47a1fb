"""What a run shows and keeps: the step lines, progress bar, metrics.csv, samples, wandb, the summary and the
figures. Imports core and config (its settings)."""
