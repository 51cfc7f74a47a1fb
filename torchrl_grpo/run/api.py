"""The Python API, for scripts and notebooks: ``from torchrl_grpo import train, evaluate, export``.

    run = train(model="tiny", optimizer={"lr": 1e-5}, train={"total_dialog_turns": 64},
                dataset=[{"prompt": "Say hi"}, ...], reward_funcs=[reward_len])
    run.metrics                 # metrics.csv as a pandas DataFrame
    run.generate("Say hi")      # the trained policy's greedy reply

Each call composes the shipped config (``config_name``) as the command line does. Settings come as keyword
arguments, one per section of the config: a dict of its keys (nested as the config nests them), or, for a config
group (``model``, ``env``, ``loss``, ...), the name of its choice; or as override strings (``overrides``, as on the
command line); both may be mixed. Bad input raises :class:`~torchrl_grpo.core.errors.ConfigError` with the one line
the command would print, naming the key. ``dataset`` (a ``datasets.Dataset`` or a list of dicts) is written to the
run directory as ``prompts.jsonl`` and trained on as ``env=prompts`` (its ``prompt`` column, or
``env.prompt_column``); ``reward_funcs`` are callables of either signature (``fn(completion, row)`` or TRL's)
added to ``env.rewards``. A callable defined in the notebook or script itself lives in this process only: a run
whose Ray actors or data-parallel ranks must score too needs it in a module they can import.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.config.command_line import apply_settings, check_overrides, compose_config, group_choices
from torchrl_grpo.core.checkpoint import list_checkpoints
from torchrl_grpo.core.console import quiet_libraries
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.models.loading import load_tokenizer
from torchrl_grpo.models.sources import resolve_model
from torchrl_grpo.run.entry import DEFAULT_CONFIG, train_async, train_sync
from torchrl_grpo.run.entry import evaluate as evaluate_run
from torchrl_grpo.run.export import checkpoint_dir, export, run_config
from torchrl_grpo.tasks import register_reward


class Run(os.PathLike):
    """A finished training run: its directory (usable as a path: ``run / "metrics.csv"``, ``str(run)``), its
    metrics, its last checkpoint, and the trained policy to load, ask or export."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def __fspath__(self) -> str:
        return str(self.run_dir)

    def __truediv__(self, other) -> Path:
        return self.run_dir / other

    def __str__(self) -> str:
        return str(self.run_dir)

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r})"

    @property
    def metrics(self):
        """metrics.csv as a pandas DataFrame, one row per step (step 0: the evaluation before training)."""
        import pandas as pd

        path = self.run_dir / "metrics.csv"
        return pd.read_csv(path) if path.is_file() else pd.DataFrame()

    @property
    def checkpoint(self) -> Path | None:
        """The last checkpoint's folder (the policy in Hugging Face's format, or its LoRA adapter), if any."""
        found = list_checkpoints(checkpoint_dir(self.run_dir, run_config(self.run_dir)))
        return found[-1] if found else None

    def load_policy(self):
        """(model, tokenizer) of the last checkpoint on the CPU in float32, LoRA merged: for generation."""
        from transformers import AutoModelForCausalLM

        checkpoint = self.checkpoint
        if checkpoint is None:
            raise ConfigError(f"{self.run_dir}: the run saved no checkpoint to load")
        path = resolve_model(str(checkpoint))
        return AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval(), load_tokenizer(path)

    def generate(self, prompt: str, max_new_tokens: int = 64) -> str:
        """The trained policy's greedy reply to ``prompt``, asked as a user's chat turn."""
        import torch

        model, tokenizer = self.load_policy()
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    def export(self, dest: str | Path, **kwargs) -> Path:
        """:func:`torchrl_grpo.run.export.export` of this run."""
        return export(self.run_dir, dest, **kwargs)


def train(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG, *, dataset: Any = None,
          reward_funcs: Iterable[Callable] = (), run_dir: str | Path | None = None, mode: str = "sync",
          **settings: Any) -> Run:
    """Train (``mode``: ``sync`` as ``grpo.py``, ``async`` as ``grpo-async.py``); the finished :class:`Run`.
    ``run_dir``: where to write (default ``outputs/<date>/<time>``, as the command); with
    ``train.resume=auto`` an earlier run's directory continues that run. ``settings``: the module docstring."""
    if mode not in ("sync", "async"):
        raise ConfigError(f"mode={mode!r}: use sync or async")
    overrides = [*(["mode=async"] if mode == "async" else []), *_as_list(overrides)]
    return Run(_run("grpo" if mode == "sync" else "grpo-async", train_sync if mode == "sync" else train_async,
                    overrides, config_name, dataset, reward_funcs, run_dir, settings))


def evaluate(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG, *, dataset: Any = None,
             reward_funcs: Iterable[Callable] = (), run_dir: str | Path | None = None, **settings: Any) -> Path:
    """Evaluate as ``evaluate.py`` does; the run directory (its ``eval_metrics.json`` holds the metrics). With a
    ``dataset``, every one of its prompts is evaluated (``env.part=all``)."""
    extra = ["env.part=all", "env.eval.part=all"] if dataset is not None else []
    return _run("evaluate", evaluate_run, [*extra, *_as_list(overrides)], config_name, dataset, reward_funcs, run_dir,
                settings)


def _as_list(overrides: str | Sequence[str]) -> list[str]:
    return [overrides] if isinstance(overrides, str) else [str(o) for o in overrides]


def _run(job: str, main: Callable, overrides: list[str], config_name: str, dataset: Any,
         reward_funcs: Iterable[Callable], run_dir: str | Path | None, settings: Mapping[str, Any]) -> Path:
    from omegaconf import OmegaConf, open_dict

    choices, values = group_choices(str(CONFIG_DIR), settings)
    run_dir = _new_run_dir() if run_dir is None else Path(run_dir).resolve()
    prompts = run_dir / "prompts.jsonl"
    if dataset is not None:
        overrides = ["env=prompts", f"env.data_path={prompts}", *overrides]
    overrides = [*choices, *overrides]
    check_overrides(str(CONFIG_DIR), config_name, overrides)
    cfg = compose_config(str(CONFIG_DIR), config_name, overrides)
    apply_settings(cfg, values)
    run_dir.mkdir(parents=True, exist_ok=True)
    if dataset is not None:
        _write_prompts(dataset, prompts)
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
    if hasattr(dataset, "to_list"):
        dataset = dataset.to_list()
    if not isinstance(dataset, (list, tuple)) or not dataset or not all(isinstance(r, dict) for r in dataset):
        raise ConfigError("dataset: give a datasets.Dataset or a non-empty list of dicts (one row each)")
    with open(path, "w", encoding="utf-8") as f:
        for row in dataset:
            f.write(json.dumps(row, default=str) + "\n")
