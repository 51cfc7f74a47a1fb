"""``torchrl-grpo``: one command for training, evaluation, figures, configs and bug reports.

    torchrl-grpo train model=tiny env=gsm_symbolic     # = python grpo.py ...       (Hydra overrides as there)
    torchrl-grpo train-async env=gsm_symbolic          # = python grpo-async.py ...
    torchrl-grpo eval env=gsm_symbolic                 # = python evaluate.py ...
    torchrl-grpo plan model=tiny                       # each device's memory the run would take (train's args)
    torchrl-grpo plot outputs/<run>                    # = python plot.py ...
    torchrl-grpo export outputs/<run> my-model         # the trained policy as a Hugging Face folder, model card
    torchrl-grpo config grpo_gsm8k my_config           # copy the shipped config tree to edit, then
    torchrl-grpo train --config-path my_config --config-name grpo_gsm8k
    torchrl-grpo env                                   # versions, devices, precision support (for bug reports)

``python -m torchrl_grpo ...`` is the same command (``torchrun ... -m torchrl_grpo train ...`` for torchrun).
This module imports neither torch nor transformers: ``train`` may re-execute the process first (tcmalloc).
"""
from __future__ import annotations

import sys

from torchrl_grpo.core.errors import ConfigError, exit_with_one_line

USAGE = __doc__.split("\n\n")[1]


def _train(args: list[str]) -> None:
    from torchrl_grpo.run.entry import hydra_command, train_sync

    hydra_command("grpo", train_sync, args)


def with_override(args: list[str], override: str) -> list[str]:
    """``override`` among ``args``' overrides: Hydra's parser takes them as one run of arguments, so it goes before
    the first (options such as ``--config-name NAME`` may come before or after them), else last."""
    at = next((i for i, arg in enumerate(args) if "=" in arg and not arg.startswith("-")), len(args))
    return [*args[:at], override, *args[at:]]


def _train_async(args: list[str]) -> None:
    from torchrl_grpo.run.entry import hydra_command, train_async

    if not any(arg.startswith("mode=") for arg in args):
        args = with_override(args, "mode=async")
    hydra_command("grpo-async", train_async, args)


def _eval(args: list[str]) -> None:
    from torchrl_grpo.run.entry import evaluate, hydra_command

    hydra_command("evaluate", evaluate, args, follow_torchrun=False)


def _plan(args: list[str]) -> None:
    """The train command's config and overrides, composed as it composes them; nothing written (Hydra's run
    directory is a temporary one). Exit code 1 when a device cannot hold its roles."""
    import shutil
    import tempfile

    from torchrl_grpo.run.entry import hydra_command
    from torchrl_grpo.run.memory import plan_options, print_plan

    options, args = plan_options(args)
    status = []
    scratch = tempfile.mkdtemp(prefix="torchrl-grpo-plan-")
    # beside the user's overrides: Hydra's parser takes them in one run of positional arguments
    at = next((i for i, arg in enumerate(args) if "=" in arg and not arg.startswith("-")), len(args))
    args = [*args[:at], f"hydra.run.dir={scratch}", "hydra.output_subdir=null", *args[at:]]
    try:
        hydra_command("plan", lambda cfg, run_dir: status.append(print_plan(cfg, options)), args,
                      follow_torchrun=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if status and status[0]:
        raise SystemExit(status[0])


def _plot(args: list[str]) -> None:
    import argparse

    from torchrl_grpo.telemetry.plots import main as plot_runs

    parser = argparse.ArgumentParser(prog="torchrl-grpo plot", description="Figures of finished runs.")
    parser.add_argument("paths", nargs="+", help="run directories (with metrics.csv) or sweep directories")
    parser.add_argument("--out", help="where several runs' overlays and sweep.md go (default: the sweep directory, "
                                      "or the folder the runs share)")
    parsed = parser.parse_args(args)
    plot_runs(parsed.paths, parsed.out)


def _export(args: list[str]) -> None:
    import argparse

    from torchrl_grpo.run.export import DTYPES, export

    parser = argparse.ArgumentParser(prog="torchrl-grpo export", description="A run's policy as a Hugging Face folder "
                                     "(weights, tokenizer, model card) that transformers and vLLM load.")
    parser.add_argument("run_dir", help="the run directory (with checkpoints/)")
    parser.add_argument("dest", help="a new folder to write")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the last)")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run: the PEFT adapter alone, not merged")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="cast the weights (default: as trained; float32 master weights on a CPU)")
    parser.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this hub repo")
    parsed = parser.parse_args(args)
    dest = export(parsed.run_dir, parsed.dest, step=parsed.step, adapter=parsed.adapter, dtype=parsed.dtype,
                  push_to_hub=parsed.push_to_hub)
    print(f"exported to {dest}/ (model card: {dest / 'README.md'})"
          + (f"; uploaded to {parsed.push_to_hub}" if parsed.push_to_hub else ""))


def _config(args: list[str]) -> None:
    from torchrl_grpo.config.shipped import copy_recipe, shipped_recipes

    if not args:
        print("shipped configs (torchrl-grpo config NAME [DEST] copies one to edit):")
        for name in shipped_recipes():
            print(f"  {name}")
        return
    if len(args) > 2:
        raise ConfigError("config takes NAME and an optional DEST folder, "
                          "e.g. `torchrl-grpo config grpo_gsm8k my_config`")
    dest = copy_recipe(args[0], args[1] if len(args) == 2 else args[0])
    print(f"copied the config tree ({args[0]}.yaml, the configs it builds on, the groups) to {dest}/; edit it, then\n"
          f"  torchrl-grpo train --config-path {dest} --config-name {args[0]}")


def _env(args: list[str]) -> None:
    from torchrl_grpo.run.environment import report

    print(report())


COMMANDS = {"train": _train, "train-async": _train_async, "eval": _eval, "plan": _plan, "plot": _plot,
            "export": _export, "config": _config, "env": _env}
MEMORY_HUNGRY = {"train", "train-async", "eval"}  # run with tcmalloc and bounded kernel caches


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(f"usage: torchrl-grpo COMMAND [ARGS]\n\n{USAGE}")
        return
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        exit_with_one_line(_unknown)(name)
    if name in MEMORY_HUNGRY:
        from torchrl_grpo.core.allocator import apply_memory_settings

        apply_memory_settings()  # before torch is imported; may re-execute this very command
    exit_with_one_line(COMMANDS[name])(args)


def _unknown(name: str) -> None:
    raise ConfigError(f"unknown command {name!r}: use one of {', '.join(COMMANDS)} (torchrl-grpo --help)")
