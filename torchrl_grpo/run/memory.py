"""``torchrl-grpo plan``: what a run would hold on each device, from the model's config.json and the run spec,
before any weight is loaded (:mod:`torchrl_grpo.config.memory_plan` does the arithmetic; here are the inputs it
needs from this machine: the model's shape, each device's memory, the engine's KV cache)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from torchrl_grpo.config.memory_plan import FIXES, Device, Engine, GiB, ModelShape, micro_batch, plan_memory, table
from torchrl_grpo.config.spec import RunSpec, resolve_run
from torchrl_grpo.core.errors import ConfigError


def device_memory(device: str, given_gib: float | None = None) -> int | None:
    """``device``'s memory in bytes: ``given_gib`` if set, a GPU's total from torch (None without one), the
    machine's RAM for the CPU."""
    if given_gib is not None:
        return int(given_gib * GiB)
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory


def longest_prompt(spec: RunSpec) -> int:
    """The longest prompt a row may have: what ``inference_model.max_model_len`` leaves beside the completion."""
    return max(1, spec.collect.max_model_len - spec.plan.max_tokens)


def run_memory_plan(spec: RunSpec, prompt_tokens: int | None = None,
                    device_gib: float | None = None) -> tuple[list[Device], int]:
    """The plan's devices for ``spec`` with prompts of ``prompt_tokens`` (default :func:`longest_prompt`), GPUs of
    ``device_gib`` GiB where given; and the prompt length used."""
    from torchrl_grpo.engines.factory import kv_cache_tokens
    from torchrl_grpo.models.sources import model_config

    trust = spec.model.trust_remote_code
    shape = ModelShape.from_config(model_config(spec.model.name, trust))
    critic = None
    if spec.critic.enabled and spec.critic.model is not None:
        critic = ModelShape.from_config(model_config(spec.critic.model, trust))
    prompt = longest_prompt(spec) if prompt_tokens is None else prompt_tokens
    placement = spec.placement
    names = {*placement.train, *placement.ref, *placement.inference}
    capacities = {d: device_memory(d, None if d == "cpu" else device_gib) for d in names}
    devices = plan_memory(shape, spec, micro_batch(spec, prompt), capacities, Engine(kv_cache_tokens(spec.engine)),
                          critic)
    return devices, prompt


def print_plan(cfg: DictConfig, prompt_tokens: int | None, device_gib: float | None) -> int:
    """Print the plan of ``cfg``; 1 when a device cannot hold its roles, else 0."""
    from torchrl_grpo.run.build import with_sleep

    spec = with_sleep(resolve_run(cfg))
    devices, prompt = run_memory_plan(spec, prompt_tokens, device_gib)
    print(f"memory plan of model.name={spec.model.name}, micro-batches of prompts up to {prompt} tokens + "
          f"{spec.plan.max_tokens} completion tokens (--prompt-tokens N for your prompts' length):")
    print(table(devices, FIXES))
    return 0 if all(d.fits for d in devices) else 1


def plan_command(args: list[str]) -> None:
    """``torchrl-grpo plan [--prompt-tokens N] [--device-memory GIB] <overrides>``: the train command's config and
    overrides, composed as it composes them; nothing written (Hydra's run directory is a temporary one)."""
    from torchrl_grpo.run.entry import hydra_command

    options = {"--prompt-tokens": None, "--device-memory": None}
    rest, it = [], iter(args)
    for arg in it:
        name, _, value = arg.partition("=")
        if name in options:
            value = value or next(it, "")
            try:
                options[name] = float(value)
            except ValueError:
                raise ConfigError(f"{name} {value!r}: give a number") from None
        else:
            rest.append(arg)
    prompt = options["--prompt-tokens"]
    status = []
    scratch = tempfile.mkdtemp(prefix="torchrl-grpo-plan-")
    try:
        hydra_command("plan", lambda cfg, run_dir: status.append(print_plan(
            cfg, None if prompt is None else int(prompt), options["--device-memory"])),
            [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", *rest], follow_torchrun=False)
    finally:
        shutil.rmtree(Path(scratch), ignore_errors=True)
    if status and status[0]:
        raise SystemExit(status[0])
