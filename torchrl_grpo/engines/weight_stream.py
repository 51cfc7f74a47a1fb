"""Weights to an engine in another process, streamed through one bounded shared buffer (issue "Performance",
point 4).

The trainer copies the tensors into a buffer file in /dev/shm a bucket at a time; vLLM's worker, inside one
``reload_weights`` call, copies each bucket out as it arrives and hands its tensors to the model's loaders.
A push thus holds one bucket beyond the weights on each side, whatever the model's size; the safetensors file
it replaces held two more full copies (the trainer's contiguous clone and the file). The worker copies a
bucket out because vLLM's layer-wise reload keeps a layer's tensors until the layer is complete, which may be
in the next bucket. Two FIFOs per worker (one per tensor-parallel rank) beside the buffer say "bucket k is ready"
and "bucket k is copied out"; while the workers load bucket k the trainer fills bucket k+1.

Pinned by tests/engines/test_weight_stream.py (the protocol, against a worker in a real process) and
tests/engines/test_engine_process.py (vLLM's engine in its own process).
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

import torch

from torchrl_grpo.config.precision import dtype_name
from torchrl_grpo.core.errors import RunError

BUCKET_BYTES = 128 * 2 ** 20  # a bucket never splits a tensor: a larger tensor gets a bucket of its own size
ALIGN = 64  # offsets in the buffer, so that every dtype's view of it is aligned
WORKER_WAIT_S = 300.0  # the worker gives up when the trainer sends nothing for this long
_TICK_S = 0.2  # how often the trainer's feeder looks whether the push already ended
_ABORT = -1
_MESSAGE = struct.Struct("<qq")  # (push number, bucket index or _ABORT): 16 bytes, written atomically to a FIFO


@dataclass(frozen=True)
class StreamedWeights:
    """Weights a push reads as it goes, for an engine: ``specs`` gives every tensor's name, whole shape and dtype
    up front (meta tensors do), :meth:`items` the tensors themselves in that order, once. A push that copies
    each into its buffer as it comes never holds them all: the data-parallel trainer gathers each from the
    shards only when the push reaches it (a 70B policy is 282 GB in float32)."""
    specs: list[tuple[str, torch.Tensor]]
    tensors: Iterator[tuple[str, torch.Tensor]]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.tensors


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in the buffer."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Channel:
    """What the workers need for one push: the buffer, each worker's FIFOs and every bucket's entries."""
    buffer: str
    size: int
    ready: tuple[str, ...]
    done: tuple[str, ...]
    push: int
    buckets: tuple[tuple[Entry, ...], ...]


def wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` travels in to an engine whose weights are ``dtype``: floating-point matrices cast to it (the
    engine rounds them so on load anyway); vectors (biases, norms) as they are, for they weigh nothing and an engine
    may hold some wider than its dtype (vLLM's AMX kernels on CPU keep small layers' biases in float32)."""
    return dtype if dtype is not None and t.is_floating_point() and t.dim() >= 2 else t.dtype


def plan_buckets(items: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int,
                 dtype: torch.dtype | None = None) -> list[list[Entry]]:
    """Cut ``items`` in order into buckets of at most ``bucket_bytes`` (one tensor larger than that gets a bucket
    of its own), each tensor at an aligned offset from its bucket's start; floating-point matrices as ``dtype``
    (the engine's) when given (:func:`wire_dtype`): the copy into the buffer casts them."""
    buckets, bucket, used = [], [], 0
    for name, t in items:
        offset = -(-used // ALIGN) * ALIGN
        kind = wire_dtype(t, dtype)
        nbytes = t.numel() * kind.itemsize
        if bucket and offset + nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, offset = [], 0
        bucket.append(Entry(name, dtype_name(kind), tuple(t.shape), offset))
        used = offset + nbytes
    if bucket:
        buckets.append(bucket)
    return buckets


def bucket_size(bucket: Sequence[Entry]) -> int:
    last = bucket[-1]
    return last.offset + _nbytes(last)


def _nbytes(entry: Entry) -> int:
    numel = 1
    for n in entry.shape:
        numel *= n
    return numel * getattr(torch, entry.dtype).itemsize


def entry_view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    return buffer[entry.offset:entry.offset + _nbytes(entry)].view(getattr(torch, entry.dtype)).view(entry.shape)


def _fifo(path: str) -> int:
    """Open a FIFO read-write: neither side's open waits for the other, and the pipe lives while one holds it."""
    if not os.path.exists(path):
        os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDWR)


def _receive(fd: int, timeout: float) -> tuple[int, int] | None:
    ready, _, _ = select.select([fd], [], [], timeout)
    return _MESSAGE.unpack(os.read(fd, _MESSAGE.size)) if ready else None


class WeightStream:
    """The trainer's side: a buffer file and two FIFOs for each of ``workers`` in ``directory`` (kept across
    pushes; :meth:`close`). ``timeout_s`` (``inference_model.push_timeout_s``): how long the workers may take to
    copy a bucket out; past it the push is a one-line RunError, the workers' call left behind (a stalled or
    stopped engine process never answers it)."""

    def __init__(self, directory: str, workers: int = 1, bucket_bytes: int | None = None,
                 timeout_s: float = WORKER_WAIT_S):
        self.directory, self.bucket_bytes, self.pushes = directory, bucket_bytes or BUCKET_BYTES, 0
        self.timeout_s = timeout_s
        self.buffer_path = os.path.join(directory, "weights.buffer")
        self.ready_paths = tuple(os.path.join(directory, f"ready.{rank}.fifo") for rank in range(workers))
        self.done_paths = tuple(os.path.join(directory, f"done.{rank}.fifo") for rank in range(workers))
        self._ready, self._done = [_fifo(p) for p in self.ready_paths], [_fifo(p) for p in self.done_paths]
        self._buffer, self._size = None, 0

    def push(self, items: Sequence[tuple[str, torch.Tensor]], call_worker: Callable[[bytes], object],
             dtype: torch.dtype | None = None, source: Iterator[tuple[str, torch.Tensor]] | None = None) -> object:
        """Stream ``items`` (name, tensor on any device; floating point sent as ``dtype`` when given) while
        ``call_worker(wire)`` runs the workers' side, :func:`receive_weights` given ``wire`` (through vLLM's
        ``collective_rpc``); returns what it returns. ``source``: the tensors, in ``items``' order, read as the
        buckets fill (``items`` then only gives the shapes and dtypes: :class:`StreamedWeights`)."""
        buckets = plan_buckets(items, self.bucket_bytes, dtype)
        self._ensure_buffer(max(bucket_size(b) for b in buckets))
        self._drain()  # a push that failed half-way may have left messages behind
        self.pushes += 1
        tensors = iter(items) if source is None else source
        channel = Channel(self.buffer_path, self._size, self.ready_paths, self.done_paths, self.pushes,
                          tuple(tuple(b) for b in buckets))
        ended, failure = threading.Event(), []
        # a thread's CUDA device is its own: the feeder reads the trainer's tensors on the caller's
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def feed() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                for k, bucket in enumerate(channel.buckets):
                    if k and not self._wait_copied(k - 1, ended):
                        return
                    for entry in bucket:
                        name, tensor = next(tensors)
                        if name != entry.name:
                            raise RuntimeError(f"weight stream: got {name} where {entry.name} was planned")
                        entry_view(self._buffer, entry).copy_(tensor)
                    self._tell(channel.push, k)
                self._wait_copied(len(channel.buckets) - 1, ended)
            except BaseException as e:  # the workers are told, so they raise instead of waiting
                failure.append(e)
                self._tell(channel.push, _ABORT)

        feeder = threading.Thread(target=feed, name="weight-stream", daemon=True)
        feeder.start()
        calling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-stream-call")
        call = calling.submit(call_worker, pickle.dumps(channel))
        result, worker_error = None, None
        try:  # the workers' call, or the feeder's verdict that they stopped copying
            while not (wait_for([call], timeout=_TICK_S).done or failure and isinstance(failure[0], RunError)):
                pass
            if call.done():
                worker_error = call.exception()
                result = None if worker_error is not None else call.result()
        finally:
            ended.set()
            feeder.join()
            calling.shutdown(wait=False)
        if failure:  # the root cause: the workers raised only because the feeder told them to
            raise failure[0] from worker_error
        if worker_error is not None:
            raise worker_error
        return result

    def _tell(self, push: int, k: int) -> None:
        for fd in self._ready:
            os.write(fd, _MESSAGE.pack(push, k))

    def _wait_copied(self, k: int, ended: threading.Event) -> bool:
        """Wait until every worker has copied bucket ``k`` out; False when the push ended meanwhile, a RunError
        past :attr:`timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        for rank, fd in enumerate(self._done):
            while (message := _receive(fd, _TICK_S)) is None:
                if ended.is_set():
                    return False
                if time.monotonic() > deadline:
                    raise RunError(f"weight push: the engine's worker {rank} did not copy bucket {k} out of the "
                                   f"/dev/shm stream within inference_model.push_timeout_s={self.timeout_s:g} s "
                                   "(the engine's process is stalled or stopped)")
            if message != (self.pushes, k):
                raise RuntimeError(f"weight stream out of step: expected {(self.pushes, k)}, got {message}")
        return True

    def _ensure_buffer(self, size: int) -> None:
        if size <= self._size:
            return
        tmp = self.buffer_path + ".tmp"
        with open(tmp, "wb") as f:
            f.truncate(size)
        os.replace(tmp, self.buffer_path)  # a new file: whoever still maps the old one keeps it intact
        self._buffer = torch.from_file(self.buffer_path, shared=True, size=size, dtype=torch.uint8)
        self._size = size

    def _drain(self) -> None:
        for fd in self._ready + self._done:
            while _receive(fd, 0) is not None:
                pass

    def close(self) -> None:
        """Close the FIFOs and drop the buffer mapping (the caller removes ``directory``). Idempotent."""
        for fd in self._ready + self._done:
            os.close(fd)
        self._ready, self._done, self._buffer = [], [], None


def read_buckets(channel: Channel, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Worker ``rank``'s side: each bucket's tensors, copied out of the buffer once the trainer says it is full."""
    buffer = torch.from_file(channel.buffer, shared=True, size=channel.size, dtype=torch.uint8)
    ready, done = _fifo(channel.ready[rank]), _fifo(channel.done[rank])
    try:
        for k, bucket in enumerate(channel.buckets):
            message = _receive(ready, WORKER_WAIT_S)
            if message is None:
                raise TimeoutError(f"weight stream: bucket {k} did not arrive within {WORKER_WAIT_S:.0f} s")
            if message == (channel.push, _ABORT):
                raise RuntimeError("weight stream: the trainer failed while filling the buffer")
            if message != (channel.push, k):
                raise RuntimeError(f"weight stream out of step: expected {(channel.push, k)}, got {message}")
            copies = [(entry.name, entry_view(buffer, entry).clone()) for entry in bucket]
            os.write(done, _MESSAGE.pack(channel.push, k))
            yield from copies
    finally:
        os.close(ready)
        os.close(done)


def receive_weights(worker, wire: bytes) -> int:
    """Runs in vLLM's worker (``collective_rpc``): one in-place reload fed by the stream; the tensor count.
    ``wire`` is the pickled :class:`Channel` (vLLM's rpc would turn a dataclass argument into a dict)."""
    channel, count = pickle.loads(wire), 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for item in read_buckets(channel, worker.rank):
            count += 1
            yield item

    worker.reload_weights(weights_iterator=counted())
    return count
