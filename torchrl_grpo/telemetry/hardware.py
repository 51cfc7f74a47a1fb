"""Memory per step: how much each model's devices hold, and this process's resident set.

Read once per step by the loop (:class:`MemoryProbe`), after the step's update, weight push and evaluation. The
trainer's GPUs (``memory/train/*``, and ``memory/ref/*`` for a reference on GPUs of its own; a reference on the
train GPUs is in ``memory/train/*``) report torch's allocator: what tensors take, what it reserved, and the peak of
the tensors since the previous step. The engine's GPUs (``memory/inference/used_gib``) report what the device has
in use, all processes together: vLLM usually runs in a process of its own. A vLLM engine in this process on the
train GPUs allocates through the same torch allocator: what it held once started (weights, KV cache) is taken off the
trainer's figures, which then count the trainer's tensors and the engine's transient ones. Every figure of a role is
summed over its GPUs (the layers of a model split over several). On every machine, the process's current and peak
resident set (``memory/rss_gib``, ``memory/peak_rss_gib``): on a CPU, where the models live. These are allocator
counters and OS figures: reading them waits for no GPU work.
"""
from __future__ import annotations

import resource
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

GIB = 2**30
STATUS = Path("/proc/self/status")  # Linux: VmRSS and VmHWM, the current and peak resident set


def cuda_devices(*models: torch.nn.Module | None) -> list[torch.device]:
    """The GPUs the parameters of ``models`` (None: no such model) live on, in order of first use."""
    found = (p.device for model in models if model is not None for p in model.parameters())
    return list(dict.fromkeys(d for d in found if d.type == "cuda"))


class MemoryProbe:
    """The memory metrics of a step (module docstring) for the trained and reference models on these GPUs and an
    engine on these devices (its GPUs count; an engine on the CPU is in its process's resident set).
    ``engine_held``: the bytes an engine in this process holds on each GPU (taken off the trainer's figures)."""

    def __init__(self, train: list[torch.device], ref: list[torch.device], inference: Sequence[torch.device | str],
                 engine_held: Mapping[torch.device, int] | None = None):
        self.roles = {"train": train, "ref": [d for d in ref if d not in train]}
        self.engine_held = {torch.device(d): n for d, n in (engine_held or {}).items()}
        self.inference = [d for d in map(torch.device, inference) if d.type == "cuda"]
        for device in [*train, *self.roles["ref"]]:  # the first step's peak: from here on
            torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> dict[str, float]:
        """This step's figures, in GiB; the allocator peaks start again from here."""
        metrics = process_memory()
        for role, devices in self.roles.items():
            if devices:
                held = sum(self.engine_held.get(d, 0) for d in devices) if role == "train" else 0
                for kind, read in (("allocated", torch.cuda.memory_allocated), ("reserved", torch.cuda.memory_reserved),
                                   ("peak", torch.cuda.max_memory_allocated)):
                    metrics[f"memory/{role}/{kind}_gib"] = (sum(map(read, devices)) - held) / GIB
                for device in devices:
                    torch.cuda.reset_peak_memory_stats(device)
        if self.inference:
            metrics["memory/inference/used_gib"] = sum(total - free for free, total in
                                                       map(torch.cuda.mem_get_info, self.inference)) / GIB
        return metrics


def process_memory(status: Path = STATUS) -> dict[str, float]:
    """This process's current and peak resident set, GiB; where there is no ``/proc`` (macOS), the peak alone, from
    ``getrusage`` (kilobytes, bytes on macOS)."""
    if status.exists():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        kib = {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}  # "123456 kB"
        return {"memory/rss_gib": kib["VmRSS"] * 1024 / GIB, "memory/peak_rss_gib": kib["VmHWM"] * 1024 / GIB}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"memory/peak_rss_gib": peak * (1 if sys.platform == "darwin" else 1024) / GIB}
