"""The Python API, for scripts and notebooks: ``from torchrl_grpo import train, evaluate``.

    run_dir = train(["model=tiny", "train.total_dialog_turns=64"], dataset=[{"prompt": "Say hi"}, ...],
                    reward_funcs=[reward_len])

Each call composes the shipped config (``config_name``, ``overrides`` as on the command line), runs in this
process and returns the run directory, which holds what a command-line run writes (metrics.csv, checkpoints,
figures, the log, ``.hydra/config.yaml``). Bad input raises :class:`~torchrl_grpo.core.errors.ConfigError` with
the one line the command would print. ``dataset`` (a ``datasets.Dataset`` or a list of dicts) is written to the
run directory as ``prompts.jsonl`` and trained on as ``env=prompts`` (its ``prompt`` column, or
``env.prompt_column``); ``reward_funcs`` are callables of either signature (``fn(completion, row)`` or TRL's)
added to ``env.rewards``. A callable defined in the notebook or script itself lives in this process only: a run
whose Ray actors or data-parallel ranks must score too needs it in a module they can import.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.run.entry import DEFAULT_CONFIG


def train(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG, *, dataset: Any = None,
          reward_funcs: Iterable[Callable] = (), run_dir: str | Path | None = None, mode: str = "sync") -> Path:
    """Train (``mode``: ``sync`` as ``grpo.py``, ``async`` as ``grpo-async.py``); the run directory.
    ``run_dir``: where to write (default ``outputs/<date>/<time>``, as the command); with
    ``train.resume=auto`` in ``overrides`` an earlier run's directory continues that run."""
    from torchrl_grpo.run.entry import train_async, train_sync

    if mode not in ("sync", "async"):
        from torchrl_grpo.core.errors import ConfigError

        raise ConfigError(f"mode={mode!r}: use sync or async")
    overrides = [*(["mode=async"] if mode == "async" else []), *overrides]
    return _run("grpo" if mode == "sync" else "grpo-async", train_sync if mode == "sync" else train_async,
                overrides, config_name, dataset, reward_funcs, run_dir)


def evaluate(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG, *, dataset: Any = None,
             reward_funcs: Iterable[Callable] = (), run_dir: str | Path | None = None) -> Path:
    """Evaluate as ``evaluate.py`` does; the run directory (its ``eval_metrics.json`` holds the metrics). With a
    ``dataset``, every one of its prompts is evaluated (``env.part=all``)."""
    from torchrl_grpo.run.entry import evaluate as evaluate_run

    extra = ["env.part=all", "env.eval.part=all"] if dataset is not None else []
    return _run("evaluate", evaluate_run, [*extra, *overrides], config_name, dataset, reward_funcs, run_dir)


def _run(job: str, main: Callable, overrides: Sequence[str], config_name: str, dataset: Any,
         reward_funcs: Iterable[Callable], run_dir: str | Path | None) -> Path:
    from omegaconf import OmegaConf, open_dict

    from torchrl_grpo.config.command_line import check_overrides, compose_config
    from torchrl_grpo.core.console import quiet_libraries
    from torchrl_grpo.tasks import register_reward

    overrides = [overrides] if isinstance(overrides, str) else [str(o) for o in overrides]
    run_dir = _new_run_dir() if run_dir is None else Path(run_dir).resolve()
    prompts = run_dir / "prompts.jsonl"
    if dataset is not None:
        overrides = ["env=prompts", f"env.data_path={prompts}", *overrides]
    check_overrides(str(CONFIG_DIR), config_name, overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    if dataset is not None:
        _write_prompts(dataset, prompts)
    cfg = compose_config(str(CONFIG_DIR), config_name, overrides)
    entries = [register_reward(fn) for fn in reward_funcs]
    if entries:
        with open_dict(cfg):
            cfg.env.rewards = [*OmegaConf.to_container(cfg.env.rewards), *entries]
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), run_dir / ".hydra" / "overrides.yaml")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quiet_libraries(cfg.logging.verbose is True, log_file=str(run_dir / f"{job}.log"))
    try:
        main(cfg, run_dir)
    finally:
        for handler in root.handlers[len(handlers):]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    return run_dir


def _new_run_dir() -> Path:
    """``outputs/<date>/<time>`` as Hydra names it, with a suffix where a run of the same second has it."""
    base = Path("outputs").resolve() / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def _write_prompts(dataset: Any, path: Path) -> None:
    """A ``datasets.Dataset`` or a list of dicts as JSON lines (the run's record of them, and what Ray actors
    and data-parallel ranks read)."""
    from torchrl_grpo.core.errors import ConfigError

    if hasattr(dataset, "to_list"):
        dataset = dataset.to_list()
    if not isinstance(dataset, (list, tuple)) or not dataset or not all(isinstance(r, dict) for r in dataset):
        raise ConfigError("dataset: give a datasets.Dataset or a non-empty list of dicts (one row each)")
    with open(path, "w", encoding="utf-8") as f:
        for row in dataset:
            f.write(json.dumps(row, default=str) + "\n")
