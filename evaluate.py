"""Evaluate a model on a task, or score responses you already have (same config tree as grpo.py).

    python evaluate.py env=gsm_symbolic                                  # SmolLM2 on gsm_symbolic's eval split
    python evaluate.py model.name=outputs/<run>/checkpoints/step_000030 env=gsm_symbolic
    python evaluate.py env=reasoning_gym eval.samples=8 eval.temperature=1.0    # pass@1..8
    python evaluate.py --config-name grpo_ifeval env.data_path=input_data.jsonl eval.responses=responses.jsonl

It generates with the rollout engine (``inference_model.backend``) on the task's evaluation split
(``env`` with ``env.eval`` merged over it) or reads ``eval.responses`` (a JSONL of the dataset's fields plus
``response``, or of ``prompt`` and ``response`` only, as IFEval publishes them: rows found in that split by
prompt), scores with the task's rewards, writes ``eval_responses.jsonl`` (re-scorable) and
``eval_metrics.json`` to the run directory, prints a table, and prints the metrics as one JSON object on
the last line of stdout. Metrics: torchrl_grpo/run/evaluation.py.
"""
import sys

from torchrl_grpo.run.cli import main

if __name__ == "__main__":
    main(["eval", *sys.argv[1:]])  # = torchrl-grpo eval ...
