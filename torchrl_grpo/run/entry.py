"""What every Hydra command (``torchrl-grpo train | train-async | eval`` and the scripts grpo.py, grpo-async.py,
evaluate.py that call them) shares: Hydra over the shipped config tree with the command line checked first,
one-line errors, quiet libraries, and what each command runs.

The command line (:mod:`torchrl_grpo.run.cli`) calls ``apply_memory_settings()`` before anything imports torch (it
may re-run the process); this module imports neither torch nor transformers.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.config.command_line import checked_command_line
from torchrl_grpo.core.console import quiet_libraries
from torchrl_grpo.core.errors import exit_with_one_line
from torchrl_grpo.core.secrets import mask_output, secret_names

DEFAULT_CONFIG = "grpo_gsm8k"


def hydra_command(job: str, main: Callable[[DictConfig, Path], None], args: list[str],
                  follow_torchrun: bool = True) -> None:
    """Run ``main(cfg, run_dir)`` under Hydra with ``args`` as its command line (overrides, ``--multirun``,
    ``--config-name``, ...); ``job`` names the job and its log file (``grpo`` writes ``grpo.log``). Under
    torchrun, ranks above 0 follow rank 0 instead (``follow_torchrun``)."""
    if follow_torchrun and torchrun_follower():
        return
    sys.argv = [sys.argv[0], *_config_path_from_here(args)]
    _hydra_main(main, job)()


def _config_path_from_here(args: list[str]) -> list[str]:
    """``--config-path``/``-cp`` relative to the working directory (Hydra reads it relative to the module that
    declares the entry point, which is inside the package)."""
    out, path_next = [], False
    for arg in args:
        if path_next:
            arg, path_next = os.path.abspath(arg), False
        elif arg in ("--config-path", "-cp"):
            path_next = True
        elif arg.startswith("--config-path="):
            arg = "--config-path=" + os.path.abspath(arg.split("=", 1)[1])
        out.append(arg)
    return out


def _hydra_main(main: Callable[[DictConfig, Path], None], job: str) -> Callable[[], None]:
    """``main(cfg, run_dir)`` as a Hydra entry point over ``sys.argv``, the job named ``job``."""

    def task(cfg: DictConfig) -> None:
        quiet_libraries(cfg.logging.verbose is True)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        masks = mask_output(names=secret_names(cfg.get("env", {})))
        for written in (run_dir / ".hydra").glob("*.yaml"):  # Hydra wrote them before the masks were on
            masks.file(written)
        main(cfg, run_dir)

    task.__module__ = task.__qualname__ = job  # Hydra names the job after its task function's module

    hydra_main = hydra.main(config_path=str(CONFIG_DIR), config_name=DEFAULT_CONFIG, version_base="1.3")
    return checked_command_line(str(CONFIG_DIR), DEFAULT_CONFIG)(hydra_main(exit_with_one_line(task)))


def torchrun_follower() -> bool:
    """Under ``torchrun``, ranks above 0 follow rank 0 and return True here once the run ended. A plain process
    (and rank 0) imports nothing heavy here: a bad key is then refused without waiting for torch to load."""
    from torchrl_grpo.config.placement import torchrun_launch

    launch = torchrun_launch()
    if launch is None or launch.rank == 0:
        return False
    from torchrl_grpo.parallel.launcher import torchrun_follower as follow
    from torchrl_grpo.run.build import build_follower

    return follow(build_follower)


def check_keys_first(cfg: DictConfig) -> None:
    """Every key's kind, range and combination (:func:`validate`) before the trainer's heavy imports (seconds of
    them), so that a bad one is refused at once; ``read_inputs`` then resolves the rest. Under torchrun the
    ranks' devices are adopted into the config first: the checks wait for that."""
    from torchrl_grpo.config.placement import torchrun_launch
    from torchrl_grpo.config.validate import validate

    if torchrun_launch() is None:
        validate(cfg)


@contextlib.contextmanager
def on_this_machine(spec, run_dir: Path):
    """A run training on the CPU is listed as one of this machine's runs while it runs, and says at start when others
    share its cores (:mod:`~torchrl_grpo.core.machine_runs`)."""
    if spec.placement.train[0] != "cpu":
        yield
        return
    from torchrl_grpo.core.machine_runs import registered, sharing_warning

    with registered(run_dir) as others:
        if (line := sharing_warning(others, len(os.sched_getaffinity(0)))) is not None:
            print(line, file=sys.stderr, flush=True)
        yield


def train_sync(cfg: DictConfig, run_dir: Path) -> None:
    """grpo.py: collect, optimize, push; data-parallel ranks when ``train.strategy`` resolves to fsdp."""
    check_keys_first(cfg)
    from torchrl_grpo.parallel.launcher import data_parallel_ranks
    from torchrl_grpo.run.build import build_follower, build_sync, read_inputs
    from torchrl_grpo.run.loop import run_loop

    inputs = read_inputs(cfg, run_dir)  # before any other rank starts
    with on_this_machine(inputs.spec, run_dir), data_parallel_ranks(inputs.spec, run_dir, build_follower) as parallel:
        run = build_sync(cfg, inputs, parallel)  # rank 0; the others follow
        try:
            run_loop(run)
        finally:
            run.source.collector.engine.close()


def train_async(cfg: DictConfig, run_dir: Path) -> None:
    """grpo-async.py: Ray rollout actors collect while the trainer optimizes."""
    check_keys_first(cfg)
    from torchrl_grpo.parallel.launcher import data_parallel_ranks
    from torchrl_grpo.run.build import build_async, build_follower, read_inputs
    from torchrl_grpo.run.loop import run_loop

    inputs = read_inputs(cfg, run_dir)  # before any other rank starts
    with on_this_machine(inputs.spec, run_dir), data_parallel_ranks(inputs.spec, run_dir, build_follower) as parallel:
        run_loop(build_async(cfg, inputs, parallel))


def evaluate(cfg: DictConfig, run_dir: Path) -> None:
    """evaluate.py: generate on (or score given responses of) the task's evaluation split; write
    ``eval_responses.jsonl`` and ``eval_metrics.json``, print a table and the metrics as one JSON line."""
    from torchrl_grpo.config.spec import resolve_run

    spec = resolve_run(cfg, training=False)  # before the heavy imports: a bad key is refused at once
    from torchrl_grpo.run.build import build_eval_engine, build_eval_task, check_task_keys
    from torchrl_grpo.run.evaluation import evaluate_with_engine, format_table, read_responses, score_responses

    check_task_keys(spec)
    task, turns = build_eval_task(spec)
    if spec.eval.responses:
        metrics, records = score_responses(task, *read_responses(spec.eval.responses, task))
        source = spec.eval.responses
    else:
        engine, tokenizer = build_eval_engine(spec, task, turns)
        try:
            metrics, records = evaluate_with_engine(engine, task, tokenizer, spec.eval, turns)
        finally:
            engine.close()
        source = spec.model.name
    with open(run_dir / "eval_responses.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    (run_dir / "eval_metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"evaluation of {source} on {task.name}:\n{format_table(metrics)}")
    print(json.dumps(metrics), flush=True)
