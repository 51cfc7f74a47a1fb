"""``torchrl-grpo plan``: what a run would hold on each device, from the model's config.json and the run spec,
before any weight is loaded (:mod:`torchrl_grpo.config.memory_plan` does the arithmetic; here are the inputs it
needs from this machine: the model's shape, each device's memory, the engine's KV cache)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from torchrl_grpo.config.auto_settings import Choice, Settings, budgets, choose
from torchrl_grpo.config.memory_plan import Device, Engine, GiB, ModelShape, fixes, micro_batch, plan_memory, table
from torchrl_grpo.config.spec import RunSpec, resolve_run
from torchrl_grpo.config.validate import CHECKPOINTING, UNSETTLED_ENGINE_SHARE
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines.factory import kv_cache_tokens
from torchrl_grpo.models.sources import model_config
from torchrl_grpo.run.step_time import checkpointing_line, step_time_line


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


def model_shape(spec: RunSpec, model_path: str | None = None) -> ModelShape:
    """The policy's shape from ``model_path``'s config.json (resolved) or ``model.name``'s (local, cached or
    shipped)."""
    if model_path:
        return ModelShape.from_config(json.loads((Path(model_path) / "config.json").read_text()))
    return ModelShape.from_config(model_config(spec.model.name, spec.model.trust_remote_code))


def run_memory_plan(spec: RunSpec, prompt_tokens: int | None = None, device_gib: float | None = None,
                    shape: ModelShape | None = None) -> tuple[list[Device], int]:
    """The plan's devices for ``spec`` with prompts of ``prompt_tokens`` (default :func:`longest_prompt`), GPUs of
    ``device_gib`` GiB where given, the model's ``shape`` (default: :func:`model_shape`); and the prompt length
    used."""
    shape = shape or model_shape(spec)
    critic = None
    if spec.critic.enabled and spec.critic.model is not None:
        critic = ModelShape.from_config(model_config(spec.critic.model, spec.model.trust_remote_code))
    prompt = longest_prompt(spec) if prompt_tokens is None else prompt_tokens
    placement = spec.placement
    names = {*placement.train, *placement.ref, *(placement.inference if placement.actors is None else
                                                   [d for d in placement.actors.devices if d != "cuda"])}
    capacities = {d: device_memory(d, None if d == "cpu" else device_gib) for d in names}
    devices = plan_memory(shape, spec, micro_batch(spec, prompt), capacities, Engine(kv_cache_tokens(spec.engine)),
                          critic)
    return devices, prompt


def free_memory() -> int:
    """Bytes of this machine's memory free for a new run (``MemAvailable``; the total where /proc says nothing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def settle_auto(cfg: DictConfig, spec: RunSpec, model_path: str | None = None, prompt_tokens: int | None = None,
                device_gib: float | None = None, gpu_count: int | None = None) -> tuple[RunSpec, Choice | None]:
    """The keys ``spec`` left to auto chosen (:func:`~torchrl_grpo.config.auto_settings.choose`, on the plan of the
    model at ``model_path`` (default: ``model.name``'s config.json) with prompts of ``prompt_tokens`` and GPUs of
    ``device_gib``), written into ``cfg`` and the spec resolved again from it: what checkpoints record, and what
    data-parallel ranks receive, is the chosen value. Without a plan (a config.json it cannot read) the memory-lean
    values stay, and the spec says so."""
    if not spec.auto:
        return spec, None
    try:
        shape = model_shape(spec, model_path)
    except ConfigError as err:
        lean = Settings(True, None, None, spec.engine.sleep, UNSETTLED_ENGINE_SHARE)
        kept = ", ".join(lean.describe(key) for key in spec.auto)
        return dataclasses.replace(spec, auto_chosen=f"auto: the memory plan is not available ({err}); the "
                                   f"memory-lean values kept: {kept}"), None
    choice = choose(spec, lambda s: run_memory_plan(s, prompt_tokens, device_gib, shape=shape)[0],
                    budgets(spec.train.auto_cpu_memory_share, free_memory()), shape.vocab)
    for key, value in choice.overrides().items():
        OmegaConf.update(cfg, key, value)
    settled = resolve_run(cfg, gpu_count=gpu_count)
    return dataclasses.replace(settled, auto_chosen=choice.line()), choice


def print_plan(cfg: DictConfig, options: PlanOptions) -> int:
    """Print the plan of ``cfg`` (the settings left to auto chosen first); 1 when a device cannot hold its roles,
    else 0."""
    spec = resolve_run(cfg, gpu_count=options.gpus)
    shape = model_shape(spec)
    spec, choice = settle_auto(cfg, spec, None, options.prompt_tokens, options.device_gib, options.gpus)
    devices, prompt = run_memory_plan(spec, options.prompt_tokens, options.device_gib, shape=shape)
    print(f"memory plan of model.name={spec.model.name}, micro-batches of prompts up to {prompt} tokens + "
          f"{spec.plan.max_tokens} completion tokens (--prompt-tokens N for your prompts' length):")
    gpu = None if options.gpus else gpu_name(spec.placement.train[0])
    if choice is not None:
        print(choice.table())
        if CHECKPOINTING in choice.keys and (line := checkpointing_line(shape, spec, prompt, gpu)):
            print(line)
    print(table(devices, fixes(spec)))
    print(step_time_line(shape, spec, prompt, gpu))
    return 0 if all(d.fits for d in devices) else 1


def gpu_name(device: str) -> str | None:
    """torch's name of ``device`` where it is a GPU of this machine, else None."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.device(device).index or 0)


def check_memory(spec: RunSpec, model_path: str) -> None:
    """At a run's start: each device's planned total in one line; a one-line ConfigError naming the keys that would
    make it fit when a device cannot hold its roles even with the shortest prompts (``train.check_memory=false``
    starts anyway), a warning when it may not with the longest prompts ``inference_model.max_model_len`` admits."""
    if spec.auto_chosen:
        print(spec.auto_chosen, flush=True)
    try:
        shape = model_shape(spec, model_path)
        devices, prompt = run_memory_plan(spec, shape=shape)
    except ConfigError as err:  # a model whose config.json the plan cannot read: the run goes on without it
        print(f"memory plan: not available ({err})", flush=True)
        return
    print("memory plan: " + "; ".join(summary(d) for d in devices) + " (torchrl-grpo plan shows the parts)",
          flush=True)
    if all(d.fits for d in devices):
        return
    short = [d for d in run_memory_plan(spec, prompt_tokens=1, shape=shape)[0] if not d.fits]
    if short and spec.train.check_memory:
        d = short[0]
        raise ConfigError(f"memory plan: {d.name} needs {d.total / GiB:.1f} GiB even with 1-token prompts but has "
                          f"{d.capacity / GiB:.1f} GiB; {fixes(spec)}; or train.check_memory=false to start anyway")
    print(f"warning: the memory plan does not fit with prompts of {prompt} tokens (the longest "
          "inference_model.max_model_len admits); shorter ones may fit", flush=True)


def summary(device: Device) -> str:
    """``cpu 2.9 of 23.5 GiB (process 0.6, trainer 2.0, engine 0.3)``."""
    capacity = "" if device.capacity is None else f" of {device.capacity / GiB:.1f}"
    parts = ", ".join(f"{r.name} {r.bytes / GiB:.1f}" for r in device.roles)
    return f"{device.name} {device.total / GiB:.1f}{capacity} GiB ({parts})"


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """``torchrl-grpo plan``'s own options: prompts of ``--prompt-tokens N`` (None: the longest admitted), GPUs of
    ``--device-memory GIB``, and ``--gpus N`` for a machine with N GPUs (a cluster's node planned from a laptop)."""

    prompt_tokens: int | None = None
    device_gib: float | None = None
    gpus: int | None = None


def plan_options(args: list[str]) -> tuple[PlanOptions, list[str]]:
    """``torchrl-grpo plan``'s own options out of its arguments, and the Hydra overrides."""
    options: dict[str, float | None] = {"--prompt-tokens": None, "--device-memory": None, "--gpus": None}
    rest, it = [], iter(args)
    for arg in it:
        name, _, value = arg.partition("=")
        if name not in options:
            rest.append(arg)
            continue
        value = value or next(it, "")
        try:
            options[name] = float(value)
        except ValueError:
            raise ConfigError(f"{name} {value!r}: give a number") from None
    prompt, gpus, gib = options["--prompt-tokens"], options["--gpus"], options["--device-memory"]
    if gpus is not None and gib is None:
        raise ConfigError(f"--gpus {gpus:g}: give each GPU's memory too, e.g. --device-memory 80")
    return PlanOptions(None if prompt is None else int(prompt), gib, None if gpus is None else int(gpus)), rest
