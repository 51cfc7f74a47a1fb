"""The memory a run needs on each device, from the model's shape and the run spec, before anything is loaded.

Pure arithmetic over :class:`ModelShape` (a model's ``config.json``) and :class:`~torchrl_grpo.config.spec.RunSpec`:
what each role holds on its device (the trainer's weights, gradients, optimizer state, activations at the planned
micro-batch and the chunked head's logits; the reference's and a critic's weights; the engine's weights and KV
cache), against the device's memory. The caller (``torchrl-grpo plan``, a run's start) reads the config.json and
the devices' memory. The activation counts are the tensors autograd keeps in a Llama/Qwen decoder layer as
transformers runs it (module :func:`layer_activation_bytes`); docs/memory-plan.md compares them with measured peaks.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrl_grpo.config.precision import dtype_name
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.config.validate import check_lora
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.objective.log_probs import CHUNK_BYTES, GPU_SHARE

GiB = 1 << 30
FLOAT32 = 4
# a process's resident set before it holds any tensor: python, torch, transformers, tokenizers and this package
# imported (measured on CPU: docs/memory-plan.md); each data-parallel rank on the CPU is a process of its own
CPU_PROCESS_BASELINE = int(0.6 * GiB)
# a vLLM CPU engine's memory beyond its weights and KV cache: this much, and its weights' size once more (two whole
# runs' peaks against the plan, docs/memory-plan.md: the tiny model's gives the constant, SmolLM2's the rest)
VLLM_CPU_WORKING = int(0.3 * GiB)
LOGITS_CHUNKS_LIVE = 4  # a chunk's float32 logits, their log-softmax, its gradient and the logits' gradient
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "SGD": 0}  # tensors of state per trained parameter (SGD: no momentum key)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT's all-linear


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape as its config.json gives it (Llama, Mistral, Qwen2, Qwen3 and their kin)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool            # tie_word_embeddings: the head's weight is the input embedding's
    qkv_bias: bool        # q, k, v projections with a bias (Qwen2; attention_bias elsewhere)
    o_bias: bool          # o_proj with a bias too (attention_bias; Qwen2's has none)
    qk_norm: bool = False  # an RMSNorm over each head's q and k (Qwen3)
    mlp_bias: bool = False
    model_type: str = "llama"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a config.json's dict (a multimodal one's ``text_config``)."""
        config = config.get("text_config", config)
        model_type = str(config.get("model_type", "llama"))
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(vocab=int(config["vocab_size"]), hidden=hidden, intermediate=int(config["intermediate_size"]),
                       layers=int(config["num_hidden_layers"]), heads=heads,
                       kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       tied=bool(config.get("tie_word_embeddings", False)),
                       qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
                       o_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
                       qk_norm=model_type.startswith("qwen3"), mlp_bias=bool(config.get("mlp_bias", False)),
                       model_type=model_type)
        except KeyError as missing:
            raise ConfigError(f"model.name: its config.json has no {missing.args[0]}; the memory plan needs a "
                              "decoder's shape (hidden_size, num_hidden_layers, ...)") from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.name: its config.json gives a decoder's shape the memory plan cannot read "
                              f"({err})") from None

    @property
    def attention(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear layers as (in, out) features."""
        h, a, kv, i = self.hidden, self.attention, self.kv, self.intermediate
        return {"q_proj": (h, a), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (a, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_parameters(self) -> int:
        h, a, kv, i = self.hidden, self.attention, self.kv, self.intermediate
        weights = sum(fan_in * fan_out for fan_in, fan_out in self.linear_shapes().values())
        biases = (a + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0) + (2 * i + h if self.mlp_bias else 0)
        return weights + biases + 2 * h + (2 * self.head_dim if self.qk_norm else 0)  # two RMSNorms

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """What ``sum(p.numel() for p in model.parameters())`` gives for the causal LM."""
        head = 0 if self.tied else self.embedding
        return self.embedding + self.layers * self.layer_parameters() + self.hidden + head

    @property
    def critic_parameters(self) -> int:
        """The same body under a value head (one output and its bias per position) instead of the LM head."""
        return self.embedding + self.layers * self.layer_parameters() + self.hidden + self.hidden + 1

    def lora_parameters(self, lora: Mapping[str, Any], share: LayerShare | None = None) -> int:
        """Trainable parameters of ``train_model.lora``: r x (in + out) per targeted linear layer, and the whole
        ``modules_to_save`` (the head or the embedding); of the layers and modules a device holds with ``share``."""
        share = share or LayerShare(0, self.layers)
        knobs = check_lora(lora)
        per_layer = sum(knobs["r"] * (fan_in + fan_out) for fan_in, fan_out in self.lora_targets(lora))
        saved = knobs["modules_to_save"] or []
        held = {"embed_tokens": share.first, "lm_head": share.last}
        return share.layers * per_layer + sum(self.embedding for m in saved if held.get(m))

    def parameters_of(self, share: LayerShare) -> int:
        """The parameters a device holds with ``share`` of the layers: the embedding on the first (with a tied head),
        the final norm and an untied head on the last."""
        head = 0 if self.tied else self.embedding
        return (share.layers * self.layer_parameters() + (self.embedding if share.first else 0)
                + (self.hidden + head if share.last else 0))

    def lora_targets(self, lora: Mapping[str, Any]) -> list[tuple[int, int]]:
        """The (in, out) features of each decoder layer's linear layers ``train_model.lora.target_modules`` names."""
        targets = check_lora(lora)["target_modules"]
        names = LINEARS if targets == "all-linear" else [targets] if isinstance(targets, str) else targets
        shapes = self.linear_shapes()
        return [shapes[n] for n in names if n in shapes]

    def merged_lora_weights(self, lora: Mapping[str, Any]) -> int:
        """Elements of the merged weights a push builds (base + adapter), one per targeted layer's weight."""
        return self.layers * sum(fan_in * fan_out for fan_in, fan_out in self.lora_targets(lora))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """A key and a value per layer and KV head."""
        return 2 * self.layers * self.kv * dtype.itemsize


def layer_activation_bytes(shape: ModelShape, compute: torch.dtype, norms: torch.dtype, casts: int) -> int:
    """Bytes autograd keeps per token for one decoder layer's backward: each RMSNorm's input and output
    (``norms``: float32, as transformers' RMSNorm upcasts), ``casts`` bf16 copies of the hidden state that autocast
    makes for the q/k/v and gate/up projections, the attention's q, k and v (K and V repeated to every head, as
    with a padding mask), its output and the o_proj input (a contiguous copy), and the MLP's gate, SiLU, up and
    product (``compute``)."""
    h, a, i = shape.hidden, shape.attention, shape.intermediate
    return 4 * h * norms.itemsize + casts * h * 2 + (3 * a + 2 * a + 4 * i) * compute.itemsize


@dataclass(frozen=True)
class Item:
    """One thing a role holds; ``transient`` ones only while it trains (activations, logits, gradients: zeroed to
    None after each update), freed between steps."""

    name: str
    bytes: int
    note: str = ""
    transient: bool = False


@dataclass(frozen=True)
class Role:
    """What one role holds on one device; ``released`` of it is freed while another role runs there (vLLM's
    sleep), ``processes`` the role's processes there (data-parallel ranks on a CPU each hold their share);
    ``wants`` what it needs to run at full speed (a GPU engine: a step's sequences in its KV cache at once)."""

    name: str
    device: str
    items: tuple[Item, ...]
    processes: int = 1
    released: int = 0
    wants: int = 0

    @property
    def bytes(self) -> int:
        return self.processes * sum(item.bytes for item in self.items)

    @property
    def resident(self) -> int:
        """What the role keeps between steps."""
        return self.processes * sum(item.bytes for item in self.items if not item.transient)


@dataclass(frozen=True)
class Device:
    """A device's roles against its memory (``capacity``, bytes; None: unknown)."""

    name: str
    capacity: int | None
    roles: list[Role] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The peak: every role's bytes; with a sleeping engine the larger of its two phases: the others training
        while it sleeps, and it generating beside what the others keep between steps (the trainer gives its cached
        GPU memory back before the engine wakes: :class:`~torchrl_grpo.run.sources.LocalSource`)."""
        whole = sum(r.bytes for r in self.roles)
        released = sum(r.released for r in self.roles)
        if not released:
            return whole
        generating = sum(r.bytes if r.released else r.resident for r in self.roles)
        return max(whole - released, generating)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


@dataclass(frozen=True)
class Batch:
    """The tokens of a micro-batch as the trainer reads them: ``tokens`` in all (rows x padded length, or packed),
    ``completion`` of them the head scores."""

    tokens: int
    completion: int
    describe: str


@dataclass(frozen=True)
class LayerShare:
    """What one GPU holds of a model whose layers one process splits over several (``train.strategy=layer_split``,
    transformers' ``device_map``): ``layers`` decoder layers from ``start``, the input embedding on the first
    device, the final norm and the head on the last (where the logits are computed)."""

    start: int
    layers: int
    first: bool = True
    last: bool = True


def layer_shares(layers: int, devices: int) -> list[LayerShare]:
    """Even shares of ``layers`` over ``devices``, the first ones a layer more where they do not divide (transformers'
    balanced map gives about this; the embedding may move its cut by a layer)."""
    counts = [layers // devices + (i < layers % devices) for i in range(devices)]
    starts = [sum(counts[:i]) for i in range(devices)]
    return [LayerShare(start, count, i == 0, i == devices - 1) for i, (start, count) in enumerate(zip(starts, counts))]


def micro_batch(spec: RunSpec, prompt_tokens: int) -> Batch:
    """A rank's share of the planned micro-batch with prompts of ``prompt_tokens`` tokens: of
    ``train.optim_batch_size`` rows of prompt + ``inference_model.max_tokens`` each data-parallel rank takes an equal
    share; ``train.micro_batch_tokens`` packed is each rank's budget."""
    plan, ranks = spec.plan, spec.placement.ranks
    row = prompt_tokens + plan.max_tokens
    if plan.micro_batch_tokens is not None:
        tokens = plan.micro_batch_tokens
        return Batch(tokens, tokens * plan.max_tokens // row, f"{tokens} tokens packed")
    rows = -(-plan.micro_batch // ranks)
    return Batch(rows * row, rows * plan.max_tokens,
                 f"{rows} rows x {row} tokens" + (f" (a rank's share of {plan.micro_batch})" if ranks > 1 else ""))


def activation_bytes(shape: ModelShape, spec: RunSpec, batch: Batch, checkpointing: bool,
                     layers: int | None = None) -> int:
    """The trainer's activations at the peak of a micro-batch's backward, over ``layers`` of the model's layers
    (default: all). Without checkpointing every layer's (:func:`layer_activation_bytes`); with it each layer's input
    and one layer recomputed at a time. Both add the final norm's and the hidden-state gradients flowing back (three
    hidden states per token in float32)."""
    layers = shape.layers if layers is None else layers
    precision = spec.precision
    compute = torch.bfloat16 if precision.autocast_bf16 else precision.train_weights
    casts = 2 if precision.autocast_bf16 and precision.train_weights.itemsize > 2 else 0
    residual = precision.train_weights.itemsize  # the residual stream stays in the weights' dtype
    layer = layer_activation_bytes(shape, compute, torch.float32, casts)
    kept = shape.hidden * residual * layers + layer if checkpointing else layer * layers
    return batch.tokens * (kept + 3 * shape.hidden * FLOAT32)


def chunk_tokens(shape: ModelShape, device: str, capacity: int | None, chunk: int | None = None) -> int:
    """Tokens of one chunk of the head's float32 logits: ``chunk`` bytes (``train.log_prob_chunk_mib``) or the
    device's default (:func:`torchrl_grpo.objective.log_probs.chunk_bytes`)."""
    budget = CHUNK_BYTES
    if device.startswith("cuda") and capacity:
        budget = max(CHUNK_BYTES, capacity // GPU_SHARE)
    return max(1, (chunk or budget) // (FLOAT32 * shape.vocab))


def logits_bytes(shape: ModelShape, batch: Batch, device: str, capacity: int | None, chunk: int | None = None) -> int:
    """The chunked head's peak: :data:`LOGITS_CHUNKS_LIVE` float32 [tokens, vocab] tensors of one chunk (or of the
    micro-batch's completion tokens, when they fit one)."""
    tokens = min(batch.completion, chunk_tokens(shape, device, capacity, chunk))
    return LOGITS_CHUNKS_LIVE * tokens * shape.vocab * FLOAT32


@dataclass(frozen=True)
class Engine:
    """What the run's engine holds, as the caller resolved it: ``kv_tokens`` for a CPU engine
    (:func:`torchrl_grpo.engines.factory.kv_cache_tokens`)."""

    kv_tokens: int


def trainer_role(shape: ModelShape, spec: RunSpec, batch: Batch, capacity: int | None, device: str | None = None,
                 share: LayerShare | None = None) -> Role:
    """The trained policy's bytes per process on ``device`` (default: the first train device): weights, gradients
    and optimizer state (sharded over the FSDP2 ranks, each with one layer and the root's parameters gathered),
    activations and the logits chunk; of the ``share`` of its layers the device holds in a layer split."""
    precision, ranks = spec.precision, spec.placement.ranks
    device = device or spec.placement.train[0]
    whole = share is None
    share = share or LayerShare(0, shape.layers)
    checkpointing = spec.model.gradient_checkpointing
    weight = precision.train_weights.itemsize
    total = shape.parameters_of(share)
    trained = total if spec.model.lora is None else shape.lora_parameters(spec.model.lora, share)
    adapter = 0 if spec.model.lora is None else trained * FLOAT32  # PEFT keeps adapters in float32
    weights = total * weight + adapter
    grad_bytes = trained * (FLOAT32 if spec.model.lora is not None else weight)
    states = OPTIMIZER_STATES[spec.optimizer.name] * grad_bytes
    layers = "" if whole else f" (layers {share.start}-{share.start + share.layers - 1})"
    items = [Item("weights", weights // ranks, f"{total / 1e6:.1f}M x {dtype_name(precision.train_weights)}"
                  + (f" + LoRA {trained / 1e6:.2f}M float32" if spec.model.lora is not None else "") + layers),
             Item("gradients", grad_bytes // ranks, f"{trained / 1e6:.1f}M trained", transient=True),
             Item("optimizer state", states // ranks, f"{spec.optimizer.name}: "
                  f"{OPTIMIZER_STATES[spec.optimizer.name]} per trained parameter")]
    if spec.model.lora is not None and spec.engine.backend == "vllm" and spec.engine.lora_rank is None:
        merged = shape.merged_lora_weights(spec.model.lora) * share.layers // shape.layers * weight
        items.append(Item("merged weights for a push", merged, "LoRA merged into each targeted weight, all at once",
                          transient=True))
    if ranks > 1:
        gathered = (shape.layer_parameters() + shape.embedding * (1 if shape.tied else 2))
        gathered_bytes = gathered * (2 if precision.autocast_bf16 else weight) * 2
        items.append(Item("FSDP2 gathered", gathered_bytes, "one layer and the root, weights and gradients",
                          transient=True))
    other = activation_bytes(shape, spec, batch, not checkpointing, share.layers)
    on = "on" if checkpointing else "off"
    items.append(Item("activations", activation_bytes(shape, spec, batch, checkpointing, share.layers),
                      f"{batch.describe}, gradient checkpointing {on} (turned "
                      f"{'off' if checkpointing else 'on'}: {other / GiB:.2f} GiB)", transient=True))
    if share.last:
        chunk = min(batch.completion, chunk_tokens(shape, device, capacity, spec.plan.chunk_bytes))
        items.append(Item("logits chunk", logits_bytes(shape, batch, device, capacity, spec.plan.chunk_bytes),
                          f"{LOGITS_CHUNKS_LIVE} x {chunk} tokens x {shape.vocab} vocab float32", transient=True))
    return Role("trainer", device, tuple(items), processes=ranks if device == "cpu" else 1)


def plan_memory(shape: ModelShape, spec: RunSpec, batch: Batch, capacities: Mapping[str, int | None],
                engine: Engine, critic: ModelShape | None = None, baseline: int = CPU_PROCESS_BASELINE) -> list[Device]:
    """Each device the run uses, with its roles, at the micro-batch ``batch`` (:func:`micro_batch`).
    ``capacities``: each device's memory in bytes (None: unknown); ``baseline``: a CPU process's resident set before
    any tensor (counted once per process on the CPU)."""
    placement, precision = spec.placement, spec.precision
    devices: dict[str, Device] = {}

    def add(role: Role) -> None:
        devices.setdefault(role.device, Device(role.device, capacities.get(role.device))).roles.append(role)

    train_on = placement.train[0]
    if train_on == "cpu":
        add(Role("process", "cpu", (Item("python, torch, transformers", baseline, "measured, per process"),),
                 processes=placement.ranks))
    # data-parallel ranks on GPUs: each its own GPU, all alike; one process splitting the layers: a share on each
    gpus = len(placement.train) if train_on.startswith("cuda") else 1
    ranks_on = placement.train if gpus > 1 and placement.ranks > 1 else [train_on]
    if gpus > 1 and placement.ranks == 1:
        trainers = list(zip(placement.train, layer_shares(shape.layers, gpus)))
    else:
        trainers = [(rank_on, None) for rank_on in ranks_on]
    for device, share in trainers:
        add(trainer_role(shape, spec, batch, capacities.get(device), device, share))
    for rank_on in ranks_on:
        if spec.train.reference and spec.model.lora is None:
            ref = shape.parameters * precision.reference.itemsize // placement.ranks
            ref_on = rank_on if len(ranks_on) > 1 else placement.ref[0]
            add(Role("reference", ref_on, (Item("weights", ref, dtype_name(precision.reference)),),
                     processes=placement.ranks if ref_on == "cpu" else 1))
        if spec.critic.enabled:
            add(critic_role(critic or shape, spec, batch, rank_on))
    if placement.actors is not None:  # grpo-async.py: each rollout actor's engine where Ray would put it
        shards = max(1, int(placement.actors.per_actor))
        for i, engine_on in enumerate(placement.actors.engines):
            for device in engine_on:
                add(engine_role(shape, spec, engine, device, capacities.get(device), baseline, shards,
                                name=f"rollout actor {i}'s engine"))
        return list(devices.values())
    for device in placement.inference if placement.inference[0].startswith("cuda") else placement.inference[:1]:
        add(engine_role(shape, spec, engine, device, capacities.get(device), baseline))
    return list(devices.values())


def critic_role(shape: ModelShape, spec: RunSpec, batch: Batch, device: str | None = None) -> Role:
    """An actor-critic run's value model: the policy's body (or ``critic.model``'s) trained in full, no logits."""
    precision, ranks = spec.precision, spec.placement.ranks
    params = shape.critic_parameters
    weight = precision.train_weights.itemsize
    items = (Item("weights", params * weight // ranks, f"{params / 1e6:.1f}M x {dtype_name(precision.train_weights)}"),
             Item("gradients", params * weight // ranks, transient=True),
             Item("optimizer state", OPTIMIZER_STATES[spec.optimizer.name] * params * weight // ranks),
             Item("activations", activation_bytes(shape, spec, batch, spec.model.gradient_checkpointing),
                  transient=True))
    device = device or spec.placement.train[0]
    return Role("critic", device, items, processes=ranks if device == "cpu" else 1)


def engine_role(shape: ModelShape, spec: RunSpec, engine: Engine, device: str, capacity: int | None,
                baseline: int = CPU_PROCESS_BASELINE, shards: int | None = None, name: str = "engine") -> Role:
    """The rollout engine: the transformers backend samples with the trained policy (its KV cache only); vLLM on a
    GPU reserves ``inference_model.gpu_memory_utilization`` of it (weights, KV cache, its activations) and frees
    all of it while the trainer trains when asleep (``inference_model.sleep`` 1 or 2); vLLM on the CPU holds its
    weights, a KV cache of ``kv_tokens`` and its working memory (:data:`VLLM_CPU_WORKING`), in processes of its own
    (vLLM's engine core and worker: ``baseline`` twice more) beside data-parallel ranks or with
    ``inference_model.engine_process=own``. On GPUs an engine over several (``inference_model.num_devices``) holds a
    tensor-parallel share of the weights and KV cache on each (``device``: one of them; ``shards``: how many, by
    default the inference model's devices). A rollout actor's engine (``name``) is a Ray process of its own, which
    takes its share of ``gpu_memory_utilization`` (:class:`~torchrl_grpo.config.settings.EngineSettings`)."""
    settings = spec.engine
    shards = shards or len(spec.placement.inference)
    actor = spec.placement.actors is not None
    dtype = spec.precision.engine
    kv_token = shape.kv_bytes_per_token(dtype) // (shards if device.startswith("cuda") else 1)
    weights = shape.parameters * dtype.itemsize // (shards if device.startswith("cuda") else 1)
    if settings.backend == "transformers":
        tokens = settings.completions_per_step * settings.max_model_len
        return Role("engine", spec.placement.train[0],
                    (Item("KV cache", tokens * kv_token, f"{tokens} tokens, the trained policy's weights"),))
    if device.startswith("cuda"):
        reserved = int(settings.gpu_memory_utilization * capacity) if capacity else weights
        level = settings.sleep if isinstance(settings.sleep, int) else 0
        released = reserved if level else 0  # level 1 moves its weights to the CPU's memory, 2 drops them
        split = f", 1/{shards} of them (tensor parallel)" if shards > 1 else ""
        step_kv = engine.kv_tokens * kv_token
        # its working memory beside the KV cache as measured on the CPU (VLLM_CPU_WORKING): not measured on a GPU
        wants = weights + step_kv + VLLM_CPU_WORKING + weights
        return Role(name, device,
                    (Item("weights", weights, f"vLLM, {dtype_name(dtype)}{split}"),
                     Item("KV cache and activations", max(reserved - weights, 0),
                          f"inference_model.gpu_memory_utilization={settings.gpu_memory_utilization:.2f}; a step "
                          f"needs {step_kv / GiB:.2f} GiB of KV cache")), released=released, wants=wants)
    items = [Item("weights", weights, f"vLLM, {dtype_name(dtype)}"),
             Item("KV cache", engine.kv_tokens * kv_token, f"{engine.kv_tokens} tokens"),
             Item("working memory", VLLM_CPU_WORKING + weights, "measured: 0.3 GiB and its weights once more")]
    if actor:
        items.append(Item("its process", baseline, "a Ray actor"))
    elif spec.placement.ranks > 1 or settings.engine_process == "own":
        items.append(Item("its processes", 2 * baseline, "vLLM's engine core and its worker"))
    return Role(name, device, tuple(items))


def table(devices: list[Device], fixes: str = "") -> str:
    """The plan as the console prints it: per device, each role's items in GiB, the total against the memory."""
    lines = []
    for device in devices:
        memory = "unknown memory" if device.capacity is None else f"{device.capacity / GiB:.1f} GiB"
        lines.append(f"{device.name} ({memory}):")
        for role in device.roles:
            times = f" (x {role.processes} processes)" if role.processes > 1 else ""
            lines.append(f"  {role.name}{times}")
            for item in role.items:
                note = f"  {item.note}" if item.note else ""
                lines.append(f"    {item.name:<30}{item.bytes / GiB:>8.2f} GiB{note}")
        verdict = "" if device.capacity is None else (
            f" of {device.capacity / GiB:.1f} GiB: fits" if device.fits else
            f" of {device.capacity / GiB:.1f} GiB: does not fit")
        asleep = " (the engine asleep while training)" if any(r.released for r in device.roles) else ""
        lines.append(f"  {'total':<32}{device.total / GiB:>8.2f} GiB{verdict}{asleep}")
    if fixes and not all(d.fits for d in devices):
        lines.append(fixes)
    return "\n".join(lines)


def fixes(spec: RunSpec) -> str:
    """The keys that would make a run fit, in the order Troubleshooting gives them, less those ``spec`` already set."""
    keys = ["a smaller train.optim_batch_size or train.micro_batch_tokens",
            None if spec.model.gradient_checkpointing else "train_model.gradient_checkpointing=true",
            None if spec.model.lora is not None else "train_model.lora.enabled=true",
            "more train_model.num_devices (FSDP2 shards)",
            "a lower inference_model.gpu_memory_utilization" if spec.engine.backend == "vllm" else None]
    return "to fit: " + ", ".join(k for k in keys if k)
