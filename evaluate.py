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
the last line of stdout. Metrics: torchrl_grpo/evaluation.py.
"""
from torchrl_grpo.allocator import apply_memory_settings

if __name__ == "__main__":
    apply_memory_settings()  # first, before torch is imported: kernel caches bounded, tcmalloc preloaded

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from grpo_utils import build_eval_task  # noqa: E402
from torchrl_grpo.command_line import checked_command_line  # noqa: E402
from torchrl_grpo.console import quiet_libraries  # noqa: E402
from torchrl_grpo.errors import exit_with_one_line  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parent / "config")


@checked_command_line(CONFIG_DIR, "grpo_gsm8k")
@hydra.main(config_path=CONFIG_DIR, config_name="grpo_gsm8k", version_base="1.3")
@exit_with_one_line
def main(cfg: DictConfig) -> None:
    from torchrl_grpo.config import validate
    from torchrl_grpo.evaluation import evaluate_with_engine, format_table, read_responses, score_responses

    quiet_libraries(cfg.logging.verbose is True)
    validate(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    task = build_eval_task(cfg)
    if cfg.eval.responses:
        metrics, records = score_responses(task, *read_responses(cfg.eval.responses, task))
        source = str(cfg.eval.responses)
    else:
        from grpo_utils import build_eval_engine

        engine, tokenizer = build_eval_engine(cfg)
        try:
            metrics, records = evaluate_with_engine(engine, task, tokenizer, cfg.eval, int(cfg.inference_model.max_tokens),
                                                   int(cfg.inference_model.max_model_len))
        finally:
            engine.close()
        source = str(cfg.model.name)
    with open(run_dir / "eval_responses.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    (run_dir / "eval_metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"evaluation of {source} on {task.name}:\n{format_table(metrics)}")
    print(json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main()
