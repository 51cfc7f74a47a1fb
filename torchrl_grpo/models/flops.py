"""The model FLOPs of a training update, and the GPU peak ``mfu`` divides them by.

Model FLOPs, not hardware FLOPs: what the update needs, not what the GPU runs. The forward of a row of ``T``
tokens costs ``2 N T + 4 L H Q T^2`` (PaLM, appendix B): ``N`` the parameters that take part in matmuls, ``L``
layers of ``H`` attention heads of dimension ``Q``. The attention term counts the whole ``T x T`` score matrix,
not half of it for the causal mask. A forward with a backward counts 3 forwards (the backward computes the
gradients of the activations and of the weights: twice the forward), the usual ``6 N`` per token; the recompute of
``train_model.gradient_checkpointing`` is not counted, nor is the cheaper backward of LoRA, whose frozen base
weights need no weight gradient: the ``6 N`` convention is kept, so that runs compare.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FORWARD_AND_BACKWARD = 3  # forwards' worth of FLOPs in a forward with its backward

# Dense (no 2:4 sparsity) bf16 tensor-core FLOP/s of one GPU, from the vendor's datasheets. A GPU matches the
# first entry whose words are all in its name (torch.cuda.get_device_name): the variants come before their family.
BF16_DENSE_PEAK = (
    (("H100", "PCIE"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H200", "NVL"), 835e12),
    (("H100",), 989e12),  # SXM
    (("H200",), 989e12),  # SXM
    (("GH200",), 989e12),
    (("GB200",), 2500e12),
    (("B200",), 2250e12),
    (("A100",), 312e12),
    (("A10",), 125e12),
    (("L40S",), 362e12),
    (("L4",), 121e12),
)


@dataclass(frozen=True)
class ModelShape:
    """What a transformer's FLOPs depend on: ``N``, ``L``, ``H`` and ``Q`` of the module docstring."""

    matmul_params: int
    layers: int
    heads: int
    head_dim: int

    def forward_flops(self, lengths: list[int]) -> int:
        """The forward FLOPs of rows of these token counts (each row's from its attention mask)."""
        return sum(2 * self.matmul_params * t + 4 * self.layers * self.heads * self.head_dim * t * t for t in lengths)


def model_shape(model: torch.nn.Module) -> ModelShape | None:
    """The shape of a transformers model (LoRA-wrapped, sharded by FSDP2, or with a value head) from its config and
    its parameters; None for a model without a transformers config naming its layers and heads.

    ``N`` is every parameter but the input embedding, whose lookup is no matmul; tied to the output head, the
    embedding counts once, as the head. LoRA adapters count beside the base weights. A sharded parameter (a DTensor)
    counts whole."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, heads, hidden = (getattr(text, key, None) for key in ("num_hidden_layers", "num_attention_heads",
                                                                  "hidden_size"))
    if not (layers and heads and hidden):
        return None
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    params = sum(p.numel() for p in model.parameters() if p is not embedding)
    if head is not None and head.weight is embedding:
        params += embedding.numel()
    return ModelShape(params, layers, heads, getattr(text, "head_dim", None) or hidden // heads)


def update_flops(shapes: list[ModelShape], lengths: list[int], backward: bool) -> int:
    """The model FLOPs of one micro-batch of rows of these token counts through each model of ``shapes`` (the policy,
    and a critic): its forward, times :data:`FORWARD_AND_BACKWARD` when a backward follows."""
    return sum(shape.forward_flops(lengths) for shape in shapes) * (FORWARD_AND_BACKWARD if backward else 1)


def bf16_peak_flops(gpu_name: str) -> float | None:
    """The dense bf16 FLOP/s of the GPU named ``gpu_name`` (:data:`BF16_DENSE_PEAK`); None for one not listed."""
    words = set(re.findall(r"[A-Z0-9]+", gpu_name.upper()))
    return next((peak for wanted, peak in BF16_DENSE_PEAK if set(wanted) <= words), None)


def training_peak_flops(policy: torch.nn.Module, device: torch.device, bf16_compute: bool, ranks: int) -> float | None:
    """What ``mfu`` divides by: the dense bf16 peak of the GPUs ``policy`` trains on, all ``ranks``' (data-parallel),
    when its matmuls run in bf16 (``bf16_compute``: autocast, or bf16 weights); None elsewhere (a CPU, float32, a GPU
    not in the table)."""
    if device.type != "cuda":
        return None
    if not (bf16_compute or policy.get_input_embeddings().weight.dtype == torch.bfloat16):
        return None
    peak = bf16_peak_flops(torch.cuda.get_device_name(device))
    return None if peak is None else peak * len({p.device for p in policy.parameters()}) * ranks
