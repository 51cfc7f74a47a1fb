"""Policy loading: tokenizer, causal LM (optionally LoRA-wrapped, or frozen as the reference), and the
merged HF-named weights the inference engine reloads."""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from torchrl_grpo.config.validate import check_lora
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.parallel.ranks import full_tensor

log = logging.getLogger(__name__)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer with a pad token (eos when it has none) and right padding, as the trainer batches.
    ``trust_remote_code`` (``model.trust_remote_code``) is passed explicitly, as to every loader here."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
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
    trust_remote_code: bool = False,
    value_head: bool = False,
):
    """A causal LM from `path` in `dtype` on `device`, optionally LoRA-wrapped; with `value_head` the same body under
    one scalar output per position instead of the LM head (``AutoModelForTokenClassification``, one label: a
    critic), the head fresh unless `path` is a critic saved so.

    `lora` is the config's ``train_model.lora`` (enabled, r, alpha, dropout, target_modules).
    `trainable=False` gives a frozen model in eval mode (the reference model). Gradient checkpointing
    turns the KV cache off (it is useless in training and conflicts with recomputation). Several GPUs
    (a list) split the layers over them (transformers' ``device_map``, naive model parallelism: inputs
    go to the first device, logits come from the last).
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    kwargs = {"trust_remote_code": trust_remote_code}
    auto_class = AutoModelForCausalLM
    if value_head:
        auto_class, kwargs["num_labels"] = AutoModelForTokenClassification, 1
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    devices = [torch.device(d) for d in ([device] if isinstance(device, (str, torch.device)) else device)]
    if len(devices) > 1:
        memory = {d.index: torch.cuda.get_device_properties(d.index).total_memory for d in devices}
        with _errors_only() if value_head else contextlib.nullcontext():
            model = auto_class.from_pretrained(path, dtype=dtype, device_map="auto", max_memory=memory, **kwargs)
    else:
        with _errors_only() if value_head else contextlib.nullcontext():
            model = auto_class.from_pretrained(path, dtype=dtype, **kwargs)
        model.to(devices[0])
    if value_head:  # its dropout (0.1 by default, before the head) would make the values random
        without_dropout(model)
        value_head_in_float32(model)
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


def without_dropout(model: torch.nn.Module) -> None:
    """Every dropout of ``model`` off: the loss's log-probs (and a critic's values) must be those of the weights."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


@contextlib.contextmanager
def _errors_only():
    """transformers' messages below errors left out within: a critic's load leaves out the LM head and adds a fresh
    value head, which transformers reports in a table of missing and unexpected keys, expected (errors still raise)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def value_head_in_float32(model) -> None:
    """The value head's output in float32 under bf16 autocast: a value of -20 in bf16 is exact to 0.125 only, which
    a value loss then cannot resolve. The head's one output per position costs nothing to recompute so."""
    head = getattr(model, "score", None) or model.classifier

    def in_float32(module, args, output):
        with torch.autocast(args[0].device.type, enabled=False):
            bias = None if module.bias is None else module.bias.float()
            return torch.nn.functional.linear(args[0].float(), module.weight.float(), bias)

    head.register_forward_hook(in_float32)


def sparse_tied_embedding_gradient(model) -> bool:
    """Have the input embedding's backward give only the rows of the batch's tokens, where its weight is also the
    output head's (tied: SmolLM2, small Qwen2.5) and trained. Its dense backward built a second full-vocabulary
    gradient (113 MB for SmolLM2-135M in float32) only to add it to the head's; now autograd adds the rows into
    the head's dense gradient in place, so the weight's ``.grad`` stays dense (clipping and fused Adam need
    that). Untied, a sparse gradient would become ``.grad`` itself: left dense. Returns whether it is on."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = isinstance(embedding, torch.nn.Embedding) and head is not None and head.weight is embedding.weight
    embedding.sparse = bool(tied and embedding.weight.requires_grad)
    return embedding.sparse


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """HF-named weights of the base model with any active LoRA merged in, for the inference engine:
    :func:`merged_weights` as one dict."""
    return dict(merged_weights(model))


def merged_weights(model, shapes_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of the base model's weights with any active LoRA merged in, one at a time.

    The model is not modified: merged weights are new tensors, the others alias the live parameters
    (detached, no copy). Only `named_parameters()` is walked, so tied embeddings appear once (no
    separate lm_head.weight), which is what vLLM's weight reload expects (DESIGN.md section 5). A model
    sharded with FSDP2 gives each weight gathered whole when it is reached, so that a consumer that does
    not keep them (a push into an engine) never holds two full copies; every rank must then iterate in step.
    ``shapes_only``: meta tensors of each weight's whole shape and dtype instead, without gathering anything.
    """

    def whole(p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=p.dtype, device="meta") if shapes_only else full_tensor(p.detach())

    model = unwrap(model)
    try:
        from peft import PeftModel
    except ImportError:  # peft absent: no model can be a PEFT model
        PeftModel = None
    if PeftModel is None or not isinstance(model, PeftModel):
        for name, p in model.named_parameters():
            yield name, whole(p)
        return
    base = model.get_base_model()
    layers = _lora_layers(base)
    for name, p in base.named_parameters():
        parts = name.split(".")
        if any(s.startswith("lora_") for s in parts) or "original_module" in parts:
            continue
        yield _hf_name(name), whole(p) if shapes_only else _merged(whole(p), layers.get(name))


# ---------------------------------------------------------------------------------------------------
# LoRA


def _wrap_lora(model, lora: Mapping[str, Any]):
    """PEFT LoRA with the config's knobs (:func:`check_lora`)."""
    from peft import LoraConfig, get_peft_model

    knobs = check_lora(lora)
    targets = knobs["target_modules"]
    cfg = LoraConfig(
        r=knobs["r"], lora_alpha=knobs["alpha"], lora_dropout=knobs["dropout"], target_modules=targets,
        use_rslora=knobs["rslora"], modules_to_save=knobs["modules_to_save"], task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:  # e.g. target modules not found in the model
        raise ConfigError(f"train_model.lora.target_modules={targets!r}: {str(e).splitlines()[0]}") from None


def _lora_layers(base) -> dict[str, tuple[str, torch.nn.Module]]:
    """{param name of a LoRA layer's base weight: (layer name, layer)} for the layers whose adapters are
    active and unmerged."""
    layers = {}
    for mname, module in base.named_modules():
        if not hasattr(module, "get_delta_weight") or not hasattr(module, "base_layer"):
            continue
        if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
            continue  # adapters off, or already merged into the base weight
        layers[f"{mname}.base_layer.weight"] = (mname, module)
    return layers


@torch.no_grad()
def _merged(weight: torch.Tensor, layer: tuple[str, torch.nn.Module] | None) -> torch.Tensor:
    """``weight`` plus the sum of ``layer``'s active adapters' deltas (gathered whole when sharded)."""
    if layer is None:
        return weight
    mname, module = layer
    delta = None
    for adapter in module.active_adapters:
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        if getattr(module, "lora_variant", {}).get(adapter) is not None:
            raise NotImplementedError(f"{mname}: LoRA variants (e.g. DoRA) are not supported for weight sync")
        d = module.get_delta_weight(adapter)
        delta = d if delta is None else delta + d
    return weight if delta is None else weight + full_tensor(delta).to(weight.dtype)


def _hf_name(name: str) -> str:
    """A PEFT-wrapped parameter name back to the plain HF name."""
    name = name.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def unwrap(model):
    """Strip torch.compile and (Distributed)DataParallel wrappers, whose names would prefix every key."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model
