"""Tasks: datasets and their reward functions."""
