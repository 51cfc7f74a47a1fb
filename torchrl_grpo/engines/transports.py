"""How a push reaches a vLLM engine's workers: one class per transport, chosen in one place (:func:`transport_for`).

Each transport's ``push(specs, tensors)`` loads ``tensors`` (an iterator of (name, tensor), read once, in the order
of ``specs``: the names and shapes to load) into the engine's workers; ``close()`` frees what it made. The engine
around it (:class:`~torchrl_grpo.engines.vllm.VLLMEngine`) wakes, drops a tied head and refreshes its caches.

- :class:`InPlace`: an engine in this process reads the tensors where they are (vLLM's ``reload_weights``).
- :class:`Collective`: an engine in its own process, over vLLM's weight-transfer API
  (:mod:`~torchrl_grpo.engines.weight_transfer`: vLLM's NCCL engine on GPUs, our gloo engine on CPUs).
- :class:`Stream`: an engine in its own process, through a bounded buffer in /dev/shm
  (:mod:`~torchrl_grpo.engines.weight_stream`), which each tensor-parallel worker reads.
- :class:`AdapterSlot`: a LoRA adapter (``train_model.lora.sync=adapter``) beside the base weights the engine keeps,
  through a folder of /dev/shm, in any process of this machine.

Pushes to Ray rollout actors are :mod:`torchrl_grpo.collect.actor_weights`' (the actor's engine receives them).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from torchrl_grpo.engines.weight_stream import WeightStream, receive_weights

PUSH_DIR_PREFIX = "torchrl_grpo_push_"  # + the pushing process id: a weight stream's folder in /dev/shm
ADAPTER_DIR_PREFIX = "torchrl_grpo_lora_"  # + the pushing process id: the adapters' folder in /dev/shm

Specs = Sequence[tuple[str, torch.Tensor]]
Tensors = Iterator[tuple[str, torch.Tensor]]


class Transport(Protocol):
    name: str  # for the console and tests: "in place", "collective" or "shm"

    def push(self, specs: Specs, tensors: Tensors) -> None: ...

    def close(self) -> None: ...


class InPlace:
    """An engine in this process: its workers read the tensors in place."""

    name = "in place"

    def __init__(self, llm):
        self.llm = llm

    def push(self, specs: Specs, tensors: Tensors) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})

    def close(self) -> None:
        pass


class Collective:
    """The trainer's side of vLLM's weight-transfer API into the engine's workers (``workers``: one per GPU of a
    tensor-parallel engine), formed at the first push and formed again for weights of other names or shapes;
    the tensors are cast to ``dtype`` (the engine's) on the way; ``timeout_s`` (``inference_model.push_timeout_s``):
    how long the workers may take to join the group, and to take each bucket."""

    name = "collective"

    def __init__(self, llm, devices: Sequence[torch.device], dtype: torch.dtype, timeout_s: float):
        self.llm, self.devices, self.dtype, self.timeout_s = llm, devices, dtype, timeout_s
        self.transfer, self.source = None, None

    def push(self, specs: Specs, tensors: Tensors) -> None:
        self._ready(specs).feed(tensors)
        try:
            self.transfer.send_weights()
        except BaseException:  # the group may hold a broadcast that never ends: the next push forms one
            self.close()
            raise

    def _ready(self, specs: Specs):
        from torchrl_grpo.engines import weight_transfer

        if self.transfer is not None and not self.source.matches(specs):
            self.close()
        if self.transfer is None:
            on_cpu = self.devices[0].type == "cpu"
            on = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
            backend = weight_transfer.backend_for(self.devices[0])
            self.llm.collective_rpc(weight_transfer.attach_in_worker, args=(backend,))
            self.source = weight_transfer.PushSource(list(specs), self.dtype, on)
            self.transfer = weight_transfer.trainer_engine(backend, weight_transfer.RpcClient(self.llm),
                                                           self.source, workers=len(self.devices),
                                                           timeout_s=self.timeout_s)
        return self.source

    def close(self) -> None:
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            transfer.shutdown()


class Stream:
    """A bounded buffer and FIFOs in a folder of /dev/shm named after this process, made at the first push; the
    tensors are cast to ``dtype`` (the engine's) on the way. ``workers``: how many read each bucket; ``timeout_s``
    (``inference_model.push_timeout_s``): how long they may take to copy one out."""

    name = "shm"

    def __init__(self, llm, dtype: torch.dtype, workers: int, timeout_s: float):
        self.llm, self.dtype, self.workers, self.timeout_s = llm, dtype, workers, timeout_s
        self.stream: WeightStream | None = None

    def push(self, specs: Specs, tensors: Tensors) -> None:
        counts = self._stream().push(specs, lambda wire: self.llm.collective_rpc(receive_weights, args=(wire,)),
                                     self.dtype, source=tensors)
        if any(count != len(specs) for count in counts):
            raise RuntimeError(f"weight push: the engine's workers loaded {counts} of {len(specs)} tensors")

    def _stream(self) -> WeightStream:
        if self.stream is None:
            self.stream = WeightStream(_shm_folder(PUSH_DIR_PREFIX), workers=self.workers, timeout_s=self.timeout_s)
        return self.stream

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()
            shutil.rmtree(stream.directory, ignore_errors=True)


def _shm_folder(prefix: str) -> str:
    """A new folder in /dev/shm (else the temporary folder) named after this process."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}_", dir=shm)


class AdapterSlot:
    """The adapter of an engine started with ``enable_lora``: each push is written in PEFT's format to a folder of
    /dev/shm that the engine's process reads (this one or its own), loaded under a new id, and the previous version
    removed, so that the engine holds one adapter and its prefix cache never mixes two. :attr:`request`: the
    ``LoRARequest`` generation passes (None before the first push: the base model, which a fresh adapter is)."""

    name = "adapter"

    def __init__(self, llm):
        self.llm, self.request, self.directory, self.pushes = llm, None, None, 0

    def push(self, adapter) -> None:
        from vllm.lora.request import LoRARequest

        if self.directory is None:
            self.directory = _shm_folder(ADAPTER_DIR_PREFIX)
        self.pushes += 1
        folder = os.path.join(self.directory, f"v{self.pushes}")
        adapter.save(folder)
        request = LoRARequest(f"policy-{self.pushes}", self.pushes, folder)
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"adapter push: the vLLM engine did not load the adapter from {folder}")
        old, self.request = self.request, request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        directory, self.directory = self.directory, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def transport_for(weight_transfer: str, llm, *, in_process: bool, devices: Sequence[torch.device],
                  dtype: torch.dtype, push_timeout_s: float) -> Transport:
    """The transport of an engine made by ``llm`` on ``devices``: in place in this process, else the one
    ``inference_model.weight_transfer`` names, as the run spec resolved it (``collective`` or ``shm``:
    :func:`~torchrl_grpo.config.spec.with_weight_transfer`)."""
    if in_process:
        return InPlace(llm)
    if weight_transfer == "collective":
        return Collective(llm, devices, dtype, push_timeout_s)
    if weight_transfer != "shm":
        raise ValueError(f"weight_transfer={weight_transfer!r} for an engine in its own process: give collective or "
                         "shm (a run's spec resolves inference_model.weight_transfer: config.spec.resolve_run)")
    on_cpu = devices[0].type == "cpu"
    return Stream(llm, dtype, workers=1 if on_cpu else len(devices), timeout_s=push_timeout_s)
