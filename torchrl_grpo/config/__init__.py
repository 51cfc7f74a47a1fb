"""The composed config checked and resolved: the schema (every key, kind, range), the batch and memory plans, the
placement of models on devices, the precision choices, each part's settings, the run spec that holds them resolved
once, the command line, the shipped config tree and its reference page. Imports core and objective (the names of
its registered terms, the rules between loss options)."""
from pathlib import Path

# the shipped config tree (Hydra's search path; ./config links here)
CONFIG_DIR = Path(__file__).resolve().parent / "recipes"
