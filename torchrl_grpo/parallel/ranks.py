"""Data-parallel training over torch.distributed ranks with FSDP2 (``fully_shard``): what a rank needs
besides the one-process :class:`torchrl_grpo.training.trainer.Trainer`.

N ranks must take exactly the update one process takes on the same batch. Every rank holds the whole
prepared batch (advantages computed over whole groups first); each micro-batch of the one-process order is
cut into N contiguous shares, one per rank (:meth:`DataParallel.share`), so an optimizer step sees the same
completions whatever N. Each rank scales its share's loss by its accumulation weight over the sum of the
weights of ALL ranks' micro-batches of the step (:meth:`DataParallel.sum`), and FSDP *sums* the gradients
over ranks (:func:`shard_model` turns its default average off): the sum of the scaled per-rank gradients is
then the one-process gradient, for any world size (scaling the loss by N would round for N not a power of
two). On the CPU the ranks talk gloo, on GPUs nccl.

Either every rank runs the same program (tests/parallel/test_data_parallel.py), or only rank 0 runs the loop
(engine, collector, metrics, checkpoints: ``grpo.py``) and the other ranks *follow*: the trainer on rank 0
announces each of its calls that holds a collective (prepare, optimize, the weights gather, the
probe, the checkpoint), with its arguments, and each follower makes the same call on its own trainer
(:meth:`DataParallel.follow`), so that every rank's collectives match; so does the transformers engine, which
samples with the sharded policy (each rank a share of the rows: :meth:`TransformersEngine.sample_share`).
``grpo.py`` starts the followers itself (one machine), or ``torchrun`` starts every rank (:func:`torchrun_launch`,
several machines); either way rank 0 sends them its run spec (:meth:`DataParallel.broadcast_run`).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.core.errors import RunError, one_line
from torchrl_grpo.objective.loss import MAX_METRICS


@dataclass(frozen=True)
class DataParallel:
    """This rank's place in the process group, and the collectives the trainer needs."""

    rank: int
    world_size: int
    device: torch.device  # where collective tensors live (the rank's GPU with nccl, the CPU with gloo)
    followed: bool = False  # only rank 0 runs the loop; the other ranks follow its announcements

    @property
    def leads(self) -> bool:
        """Rank 0 when followed: runs the loop and announces its trainer's calls to the followers."""
        return self.followed and self.rank == 0

    def announce(self, call: str | None, *args, **kwargs) -> None:
        """Rank 0: the followers make this :func:`collective` call (a trainer's or an engine's) next, with these
        arguments (``None``: stop following)."""
        dist.broadcast_object_list([(call, args, kwargs)], src=0, device=self.device)

    def follow(self, *targets) -> None:
        """A follower rank: make rank 0's announced calls, each on the first of ``targets`` (its trainer, its
        engine) whose class declares that method :func:`collective`, until rank 0 announces the end."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, device=self.device)
            call, args, kwargs = box[0]
            if call is None:
                return
            target = next(t for t in targets if getattr(getattr(type(t), call, None), "collective", False))
            getattr(target, call)(*args, **kwargs)

    def broadcast_run(self, spec: RunSpec | None) -> RunSpec:
        """Rank 0's run spec (given there, ``None`` elsewhere) on every rank: the followers build the same
        trainer, with the precisions rank 0 resolved, without composing a config of their own."""
        box = [spec]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def share(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (the config makes ``world_size`` divide ``n``; a batch
        that breaks it stops the run rather than dropping rows)."""
        if n % self.world_size:
            raise RunError(f"{n} completions cannot be shared equally by {self.world_size} data-parallel ranks")
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def sum(self, value: float) -> float:
        """``value`` summed over ranks, in float64 (accumulation weights are counts: exact)."""
        total = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return total.item()

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        value = torch.tensor(int(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def gather_objects(self, obj) -> list | None:
        """Every rank's ``obj`` in rank order on rank 0 (None on the others)."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def sum_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``rows`` (each rank filled its own, the rest 0), summed: the whole tensor, exactly."""
        total = rows.to(self.device).contiguous()
        dist.all_reduce(total)
        return total.to(rows.device)

    def global_history(self, history: dict[str, list[float]], weights: list[float]) -> dict[str, list[float]]:
        """Per-micro-batch metrics of this rank's shares -> those of the whole micro-batches: each value
        averaged over ranks weighted by the shares' accumulation ``weights`` (plain mean where every weight
        is 0), which makes the ``loss_*`` terms exactly the whole micro-batch's; :data:`MAX_METRICS` the max
        over ranks. Per-step entries (``grad_norm``, ``critic_grad_norm``) are already global and kept."""
        keys = [k for k, v in history.items()
                if len(v) == len(weights) and not k.endswith("grad_norm") and k not in MAX_METRICS]
        w = torch.tensor(weights, dtype=torch.float64, device=self.device)
        values = torch.tensor([history[k] for k in keys], dtype=torch.float64, device=self.device)
        values = values.reshape(len(keys), -1)
        packed = torch.cat([values * w, values, w.unsqueeze(0)])
        dist.all_reduce(packed)
        weighted, plain, total = packed[: len(keys)], packed[len(keys): 2 * len(keys)], packed[-1]
        merged = torch.where(total > 0, weighted / total.clamp(min=1e-300), plain / self.world_size)
        out = dict(history)
        out.update({k: merged[i].tolist() for i, k in enumerate(keys)})
        for key in (k for k in MAX_METRICS if k in history):
            top = torch.tensor(history[key], dtype=torch.float64, device=self.device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            out[key] = top.tolist()
        return out


def collective(method: Callable) -> Callable:
    """Declare a method that every data-parallel rank must call together (it holds collectives), on an object
    that keeps its ranks in ``self.parallel`` (None: one process). On the leading rank (:attr:`DataParallel.leads`)
    a call first announces itself with its arguments, and the followers make the same call on their own object
    (:meth:`DataParallel.follow`): no method is named by a string, and only declared ones can be called so."""

    @functools.wraps(method)
    def announced(self, *args, **kwargs):
        if self.parallel is not None and self.parallel.leads:
            self.parallel.announce(method.__name__, *args, **kwargs)
        return method(self, *args, **kwargs)

    announced.collective = True
    return announced


@contextlib.contextmanager
def process_group(rank: int, world_size: int, init_method: str, timeout_s: float = 300.0,
                  followed: bool = False) -> Iterator[DataParallel]:
    """Join the process group (gloo on the CPU, nccl with GPUs: rank ``LOCAL_RANK`` takes that GPU) and leave
    it on exit, even on error. ``timeout_s`` bounds the rendezvous (ranks that never join are a one-line RunError)
    and every collective: a dead rank stops the others. ``followed``: the ranks other than 0 follow rank 0's
    trainer (module docstring)."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cpu")
    if on_gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:  # torch's "Wait timeout" / DistStoreError: a rank never came
        raise RunError(f"data-parallel rank {rank}: not all {world_size} ranks joined the process group within "
                       f"{timeout_s:g} s (a rank that failed to start says why in its output; "
                       f"{one_line(err)})") from None
    try:
        yield DataParallel(rank, world_size, device, followed)
    finally:
        dist.destroy_process_group()


def shard_model(model: torch.nn.Module, mixed_precision: bool = False) -> torch.nn.Module:
    """FSDP2 over the process group: each decoder layer (the classes the HF model names in
    ``_no_split_modules``) is one shard group, the rest (embeddings, final norm, head) the root's. Gradients
    are summed over ranks, not averaged (module docstring); the weights are rank 0's. Every group, the root
    too, reshards after its forward: by default the root stays gathered, and after a no-grad forward (the
    log-probs of :meth:`Trainer.prepare`) the next backward then left the root's parameters without
    gradients (torch 2.13, gloo). In place; returns ``model``. Build the optimizer after this: the
    parameters become DTensors.

    ``mixed_precision`` (``train.mixed_precision`` resolved): FSDP2's policy, the shards cast to bf16 before
    they are gathered (half the bytes, and a gathered layer takes half the memory), gradients reduced in
    float32 into the float32 shards the optimizer steps; the trainer's bf16 autocast still runs the
    log-softmax in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layer_classes = set(getattr(hf_model(model), "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise RunError(f"{type(hf_model(model)).__name__} names no decoder layer class (_no_split_modules): "
                       "cannot shard it layer by layer")
    with torch.no_grad():  # every rank starts from rank 0's weights (a LoRA initialisation is random)
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if mixed_precision else {}
    for module in [*layers, model]:
        fully_shard(module, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(**bf16))
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def save_optimizer(model: torch.nn.Module, optimizer, directory) -> None:
    """The optimizer state as the ranks hold it, sharded (torch.distributed.checkpoint), into ``directory``: no
    rank gathers it whole. A collective: every rank calls it with the same ``directory``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(directory))


def load_optimizer(model: torch.nn.Module, optimizer, directory) -> None:
    """:func:`save_optimizer`'s state back into ``optimizer`` (each rank reads its shards). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the structure to read into
    dcp.load(state, checkpoint_id=str(directory))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def gathered(items: Iterator[tuple[str, torch.Tensor]], keep: bool) -> dict[str, torch.Tensor]:
    """``(name, tensor)`` items gathered whole one at a time (every rank iterates in step); kept in the dict
    only where ``keep`` (rank 0), in host memory, so that no rank's device ever holds more than one whole
    tensor beside its shards (a 70B policy does not fit one GPU whole)."""
    return {name: tensor.cpu() for name, tensor in ((n, full_tensor(t)) for n, t in items) if keep}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered whole (a collective: every rank must call it), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
