"""The weight stream's protocol (torchrl_grpo/engines/weight_stream.py) against workers in real processes: every tensor
arrives bit for bit through buckets far smaller than the weights, at every worker, and a failure on either side
ends the push with an error instead of a hang. The vLLM engine's use of it: tests/engines/test_engine_process.py."""
import io
import multiprocessing
import os
import queue
import weakref

import pytest
import torch

from torchrl_grpo.engines import weight_stream
from torchrl_grpo.engines.weight_stream import ALIGN, WeightStream, bucket_size, plan_buckets, receive_weights

JOIN_S = 60


class FakeWorker:
    """What :func:`receive_weights` needs of a vLLM worker: a rank and a reload that consumes the weights."""

    def __init__(self, rank: int, fail_after: int | None):
        self.rank, self.fail_after, self.loaded = rank, fail_after, {}

    def reload_weights(self, weights_iterator):
        for name, tensor in weights_iterator:
            if self.fail_after is not None and len(self.loaded) == self.fail_after:
                raise RuntimeError("loader failed")
            self.loaded[name] = tensor


def _worker(wire: bytes, rank: int, fail_after: int | None, results) -> None:
    worker = FakeWorker(rank, fail_after)
    try:
        count = receive_weights(worker, wire)
        buf = io.BytesIO()  # bytes: tensors put on the queue would be shared through this process, about to exit
        torch.save(worker.loaded, buf)
        results.put((rank, count, buf.getvalue()))
    except Exception as e:
        results.put((rank, None, f"{type(e).__name__}: {e}"))


def _run_workers(wire: bytes, ranks: int, fail_after: int | None = None) -> dict:
    """Start ``ranks`` worker processes on the pickled channel ``wire``, wait for them, return each rank's
    (count, loaded)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(wire, r, fail_after, results)) for r in range(ranks)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, count, loaded = results.get(timeout=JOIN_S)
            out[rank] = (count, torch.load(io.BytesIO(loaded)) if count is not None else loaded)
    except queue.Empty:
        pytest.fail("a worker did not answer: the stream hangs")
    finally:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
    return out


def _weights(scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(scale)
    return [
        ("embed.weight", torch.randn(64 * scale, 33, generator=g)),  # larger than a bucket: a bucket of its own
        ("layers.0.q.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("layers.0.k.weight", torch.randn(5, 7, generator=g).t()),  # not contiguous
        ("layers.0.norm.weight", torch.randn(3, generator=g).to(torch.float16)),
        ("layers.0.scale", torch.tensor(2.5)),  # 0-d
        ("layers.0.steps", torch.arange(9, dtype=torch.int64)),
        ("head.weight", torch.randn(11, 13, generator=g)),
    ]


def test_plan_keeps_order_aligns_offsets_and_bounds_buckets():
    items = _weights()
    buckets = plan_buckets(items, bucket_bytes=1024)
    assert [e.name for b in buckets for e in b] == [name for name, _ in items]
    sizes = {name: t.numel() * t.element_size() for name, t in items}
    for bucket in buckets:
        assert bucket[0].offset == 0 and all(e.offset % ALIGN == 0 for e in bucket)
        ends = [e.offset + sizes[e.name] for e in bucket]
        assert all(end <= nxt.offset for end, nxt in zip(ends, bucket[1:]))  # no overlap
        assert bucket_size(bucket) == ends[-1]
        assert bucket_size(bucket) <= 1024 or len(bucket) == 1
    assert [e.name for e in buckets[0]] == ["embed.weight"]  # 8448 bytes alone
    assert len(buckets) > 2


def test_every_worker_gets_every_tensor_bit_for_bit_over_pushes(tmp_path):
    stream = WeightStream(str(tmp_path), workers=2, bucket_bytes=512)
    try:
        for scale in (1, 3, 2):  # the second push needs a larger buffer, the third fits the same one
            items = _weights(scale)
            got = stream.push(items, lambda wire: _run_workers(wire, 2))
            assert set(got) == {0, 1}
            for count, loaded in got.values():
                assert count == len(items) and list(loaded) == [name for name, _ in items]
                for name, tensor in items:
                    assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
        assert os.path.getsize(stream.buffer_path) == 64 * 3 * 33 * 4  # the largest bucket, never the weights
    finally:
        stream.close()


def test_the_feeder_thread_reads_on_the_callers_cuda_device(tmp_path, monkeypatch):
    """The feeder is a thread of its own, whose CUDA device would be 0: it takes the caller's (the trainer's)."""
    import threading

    seen = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((d, threading.current_thread().name)))
    stream = WeightStream(str(tmp_path), workers=1, bucket_bytes=512)
    try:
        stream.push(_weights(1), lambda wire: _run_workers(wire, 1))
    finally:
        stream.close()
    assert seen == [(2, "weight-stream")]


def test_streamed_weights_are_read_as_the_buckets_fill_never_all_held(tmp_path):
    """StreamedWeights (what the data-parallel trainer pushes): the plan from meta tensors, each tensor made
    only when the feeder reaches it and dropped once copied, so at most two live at once; a source out of the
    planned order fails the push."""
    items = _weights()
    specs = [(name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in items]
    made, most = [], 0

    def source(order):
        nonlocal most
        for name, tensor in order:
            tensor = tensor.clone()  # made now, as a gather from the shards would be
            made.append(weakref.ref(tensor))
            most = max(most, sum(ref() is not None for ref in made))
            yield name, tensor

    stream = WeightStream(str(tmp_path), workers=1, bucket_bytes=512)
    try:
        [(count, loaded)] = stream.push(specs, lambda wire: _run_workers(wire, 1), source=source(items)).values()
        assert count == len(items) and len(made) == len(items) and most == 2
        for name, tensor in items:
            assert torch.equal(loaded[name], tensor), name
        with pytest.raises(RuntimeError, match="weight stream: got layers.0.q.weight where embed.weight was planned"):
            stream.push(specs, lambda wire: _run_workers(wire, 1), source=source(items[1:]))
    finally:
        stream.close()


def test_a_push_in_the_engines_dtype_sends_floats_cast_and_half_the_bytes(tmp_path):
    """float32 master weights to a bf16 engine: the copy into the buffer casts the matrices, the workers get exactly
    the cast tensors (vectors, scalars and integers untouched: an engine may keep biases wider than its dtype), and
    the buffer is planned at the cast size."""
    items = _weights()
    plan = plan_buckets(items, 1 << 20, torch.bfloat16)
    assert [e.dtype for b in plan for e in b] == ["bfloat16"] * 3 + ["float16", "float32", "int64", "bfloat16"]
    assert bucket_size(plan[0]) < sum(t.numel() * t.element_size() for _, t in items) * 0.6
    stream = WeightStream(str(tmp_path), workers=1)
    try:
        [(count, loaded)] = stream.push(items, lambda wire: _run_workers(wire, 1), torch.bfloat16).values()
        assert count == len(items)
        for name, tensor in items:
            matrix = name in ("embed.weight", "layers.0.q.weight", "layers.0.k.weight", "head.weight")
            expected = tensor.to(torch.bfloat16) if matrix else tensor
            assert loaded[name].dtype == expected.dtype and torch.equal(loaded[name], expected), name
    finally:
        stream.close()


def test_a_trainer_failure_reaches_the_workers_and_the_next_push_works(tmp_path, monkeypatch):
    stream = WeightStream(str(tmp_path), workers=1, bucket_bytes=512)
    real_view, calls = weight_stream.entry_view, []

    def failing_view(buffer, entry):
        calls.append(entry.name)
        if entry.name == "layers.0.scale":
            raise ValueError("no such tensor")
        return real_view(buffer, entry)

    monkeypatch.setattr(weight_stream, "entry_view", failing_view)
    try:
        seen = {}
        with pytest.raises(ValueError, match="no such tensor"):
            stream.push(_weights(), lambda wire: seen.update(_run_workers(wire, 1)))
        assert seen[0][0] is None and "trainer failed" in seen[0][1]  # told, not left waiting

        def like_vllm(wire):  # collective_rpc raises a worker's error in an Exception of its own
            [(count, error)] = _run_workers(wire, 1).values()
            raise Exception(f"Call to collective_rpc method failed: Worker failed with error '{error}'")

        with pytest.raises(ValueError, match="no such tensor") as raised:  # the root cause, not the echo
            stream.push(_weights(), like_vllm)
        assert "Worker failed with error" in str(raised.value.__cause__)
        monkeypatch.setattr(weight_stream, "entry_view", real_view)
        [(count, loaded)] = stream.push(_weights(), lambda wire: _run_workers(wire, 1)).values()
        assert count == len(_weights()) and torch.equal(loaded["head.weight"], _weights()[-1][1])
    finally:
        stream.close()


def test_a_worker_failure_ends_the_push_and_the_next_push_works(tmp_path):
    stream = WeightStream(str(tmp_path), workers=1, bucket_bytes=512)
    try:
        [(count, error)] = stream.push(_weights(), lambda wire: _run_workers(wire, 1, fail_after=2)).values()
        assert count is None and "loader failed" in error  # and the feeder, left waiting, was released
        [(count, loaded)] = stream.push(_weights(2), lambda wire: _run_workers(wire, 1)).values()
        assert count == len(_weights()) and torch.equal(loaded["embed.weight"], _weights(2)[0][1])
    finally:
        stream.close()


def test_a_stopped_worker_stops_the_push_in_one_line_at_the_deadline(tmp_path):
    """The engine's process stopped (SIGSTOP: a hung GPU, a debugger) while the trainer streams: the push gives
    up when a bucket is not copied out within its deadline, in one line naming it, and leaves the workers' call
    behind instead of waiting for it forever."""
    import signal
    import time

    from torchrl_grpo.core.errors import RunError

    ctx = multiprocessing.get_context("spawn")
    results, procs = ctx.Queue(), []

    def stopped_worker(wire: bytes):
        proc = ctx.Process(target=_worker, args=(wire, 0, None, results))
        proc.start()
        procs.append(proc)
        os.kill(proc.pid, signal.SIGSTOP)
        return results.get(timeout=120)

    stream = WeightStream(str(tmp_path), workers=1, bucket_bytes=512, timeout_s=2)
    t0 = time.perf_counter()
    try:
        with pytest.raises(RunError, match=r"^weight push: the engine's worker 0 did not copy bucket 0 out of the "
                                           r"/dev/shm stream within inference_model.push_timeout_s=2 s \(the "
                                           r"engine's process is stalled or stopped\)$"):
            stream.push(_weights(1), stopped_worker)
        assert time.perf_counter() - t0 < 2 + 10
    finally:
        stream.close()
        for proc in procs:
            proc.kill()
            proc.join()
