"""The trainer's time per step, planned from the model FLOP/s measured for the same model shape on a GPU kind.

A step's update costs :func:`torchrl_grpo.models.flops.update_flops` over its rows; the trainer's measured FLOP/s
(``bench/train_throughput.py``: the ``grpo_gsm8k`` recipe, full fine-tuning in bf16 with gradient checkpointing and
chunked log-probs; docs/benchmarks.md) turn that into seconds. FLOP/s grow with the row length (longer rows, larger
matmuls), so they are interpolated between the measured lengths (log-linear) and held at the ends: below the
shortest the time is a lower bound. Only shapes measured are planned: MFU differs too much between models to carry
one model's figure to another.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torchrl_grpo.config.memory_plan import ModelShape
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.models import flops


@dataclass(frozen=True)
class Measured:
    """The trainer's model FLOP/s at rows of ``row_tokens`` tokens on a ``gpu`` (a word of its torch name) for the
    shape named, recognised by its hidden size, layers and MLP width."""

    gpu: str
    name: str
    hidden: int
    layers: int
    intermediate: int
    row_tokens: int
    flops_per_s: float
    checkpointing: bool = True  # train_model.gradient_checkpointing


# bench/gpu_long_rows.sh on one H200 (docs/benchmarks.md, "The trainer on a GPU"): the chunked rows; checkpointing
# off from its MFU (23.3% and 48.0% of 989 TFLOP/s, whole logits: 3.7% faster than chunks at 16k tokens)
MEASURED = (
    Measured("H200", "Qwen3-0.6B", 1024, 28, 3072, 2048, 179.4e12),
    Measured("H200", "Qwen3-0.6B", 1024, 28, 3072, 16384, 369.4e12),
    Measured("H200", "Qwen2.5-1.5B", 1536, 28, 8960, 2048, 315.2e12),
    Measured("H200", "Qwen2.5-1.5B", 1536, 28, 8960, 16384, 409.1e12),
    Measured("H200", "Qwen3-0.6B", 1024, 28, 3072, 2048, 230.4e12, checkpointing=False),
    Measured("H200", "Qwen3-0.6B", 1024, 28, 3072, 16384, 474.7e12, checkpointing=False),
)


def measured_for(shape: ModelShape, gpu: str | None = None, checkpointing: bool = True) -> list[Measured]:
    """The measurements of ``shape`` on the GPU named ``gpu`` (any GPU kind when None) with ``checkpointing``,
    shortest rows first."""
    rows = [m for m in MEASURED if (m.hidden, m.layers, m.intermediate) == (shape.hidden, shape.layers,
                                                                           shape.intermediate)
            and (gpu is None or m.gpu in gpu) and m.checkpointing == checkpointing]
    return sorted(rows, key=lambda m: m.row_tokens)


def flops_per_s(measured: list[Measured], row_tokens: int) -> float:
    """The measured FLOP/s at rows of ``row_tokens``: log-linear between two measured lengths, held beyond them."""
    below = [m for m in measured if m.row_tokens <= row_tokens] or measured[:1]
    above = [m for m in measured if m.row_tokens >= row_tokens] or measured[-1:]
    low, high = below[-1], above[0]
    if low.row_tokens == high.row_tokens:
        return low.flops_per_s
    share = math.log(row_tokens / low.row_tokens) / math.log(high.row_tokens / low.row_tokens)
    return low.flops_per_s + share * (high.flops_per_s - low.flops_per_s)


def step_flops(shape: ModelShape, spec: RunSpec, row_tokens: int) -> int:
    """The model FLOPs of one step's updates on one data-parallel rank: every completion of the step, ``train.epochs``
    times, each a row of ``row_tokens`` tokens, forward and backward (:func:`torchrl_grpo.models.flops.update_flops`
    of one row)."""
    matmul = shape.parameters - (0 if shape.tied else shape.embedding)  # the input embedding is a lookup
    row = flops.update_flops([flops.ModelShape(matmul, shape.layers, shape.heads, shape.head_dim)], [row_tokens],
                             backward=True)
    plan = spec.plan
    return int(plan.completions_per_step * plan.epochs / spec.placement.ranks * row)


def update_seconds(shape: ModelShape, spec: RunSpec, row_tokens: int, measured: list[Measured]) -> dict[str, float]:
    """Seconds of a step's updates with rows of ``row_tokens``, per GPU kind ``measured``."""
    total = step_flops(shape, spec, row_tokens)
    return {kind: total / flops_per_s([m for m in measured if m.gpu == kind], row_tokens)
            for kind in sorted({m.gpu for m in measured})}


def checkpointing_line(shape: ModelShape, spec: RunSpec, prompt_tokens: int, gpu: str | None) -> str | None:
    """For ``torchrl-grpo plan`` where auto chose checkpointing: a step's updates with it on and off, where this
    shape was measured both ways on this GPU kind (None elsewhere)."""
    row = prompt_tokens + spec.plan.max_tokens
    ways = {on: measured_for(shape, gpu, on) for on in (False, True)}
    if not spec.placement.train[0].startswith("cuda") or not all(ways.values()):
        return None
    times = {on: update_seconds(shape, spec, row, measured) for on, measured in ways.items()}
    kinds = sorted(times[False].keys() & times[True].keys())
    if not kinds:
        return None
    return "  step time, the trainer's updates: " + "; ".join(
        f"gradient checkpointing off {times[False][kind]:.1f} s, on {times[True][kind]:.1f} s on an {kind}"
        for kind in kinds)


def step_time_line(shape: ModelShape, spec: RunSpec, prompt_tokens: int, gpu: str | None) -> str:
    """One line for the plan: the trainer's update time per step where this shape was measured on this GPU kind
    (``gpu``: torch's name of the trainer's GPU; None where the machine that plans has none, then each kind
    measured), or why it is not planned."""
    row = prompt_tokens + spec.plan.max_tokens
    if not spec.placement.train[0].startswith("cuda"):
        return ("step time: not planned on a CPU (machines differ): bench/train_throughput.py measures this one's "
                "tokens/s")
    checkpointing = spec.model.gradient_checkpointing
    measured = measured_for(shape, gpu, checkpointing) or measured_for(shape, gpu)
    if not measured:
        shapes = sorted({f"{m.name} on an {m.gpu}" for m in MEASURED})
        return (f"step time: not planned, this model's shape was not measured{f' on {gpu}' if gpu else ''} "
                f"(measured: {', '.join(shapes)}); bench/train_throughput.py measures it")
    total = step_flops(shape, spec, row)
    # rows shorter than the shortest measured keep its FLOP/s, which shorter rows do not reach: a lower bound
    bound = "at least" if row < measured[0].row_tokens else "about"
    parts = [f"{seconds:.1f} s on an {kind}" for kind, seconds in update_seconds(shape, spec, row, measured).items()]
    differs = [note for note, differs in (("LoRA", spec.model.lora is not None),
                                          ("gradient checkpointing off", measured[0].checkpointing != checkpointing))
               if differs]
    caveat = ""
    if differs:
        caveat = f"; measured with full fine-tuning and checkpointing, this run has {' and '.join(differs)}"
    return (f"step time: the trainer's updates {bound} {', '.join(parts)} a step, with rows of {row} tokens "
            f"({total / 1e12:.0f} TFLOP a rank; generation and the reference's pass not counted{caveat})")
