"""The trainer's weights to a rollout actor over a collective (``inference_model.weight_transfer``: auto or
collective), with no copy in Ray's object store: a gloo group of the trainer (rank 0, a
:class:`~torchrl_grpo.engines.weight_transfer.GlooSender`) and the workers of the actor's engine, which join and
receive through vLLM's weight-transfer API (``init_weight_transfer_engine``, ``update_weights``) with our gloo
engine. On GPUs too the weights travel through host memory: vLLM's NCCL engine is not wired for actors.

The actor's calls are made from the trainer's main thread, in the order of its other calls: the join right after
the actor starts, a push's :meth:`RolloutActor.receive_push` when the push is made, so that it lands after the
collect the actor is running and before the next one, as a ``ray.put`` push does. The broadcast that feeds it
runs in a thread of the trainer, one per actor, from the snapshot of the weights it was handed: the trainer never
waits for an actor to finish its collect.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch

from torchrl_grpo.engines.weight_check import Probe
from torchrl_grpo.engines.weight_stream import wire_dtype


class ActorLink:
    """One actor's weight link. ``host``: the trainer's address as the actor sees it; ``dtype``: the engine's
    (the snapshot's floating-point matrices already are); ``timeout_s``: how long the group waits for the actor
    to join or to receive (``ray.collect_timeout_s``: it does so after the collect it is running)."""

    def __init__(self, ray, actor, dtype: torch.dtype, host: str, timeout_s: float):
        from torchrl_grpo.engines.weight_transfer import GLOO, GlooSender

        self.ray, self.actor, self.dtype = ray, actor, dtype
        self.sender = GlooSender(host, workers=1, timeout_s=timeout_s)
        self.joined = actor.join_weight_transfer.remote(GLOO, self.sender.worker_info)  # -> its tied_embeddings
        self.tied: bool | None = None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        # a daemon: a thread left waiting on an actor that never answers must not hold the interpreter's exit
        self.thread = threading.Thread(target=self._run, name="actor-weights", daemon=True)
        self.thread.start()

    def submit(self, weights: dict[str, torch.Tensor], version: int, probe: Probe | None) -> Future:
        """Push ``weights`` (a snapshot nobody changes) as policy ``version``: the actor's call now, the broadcast
        in the link's thread after the pushes submitted before. The future resolves to the actor's weight sync
        gap, or the push's error."""
        done: Future = Future()
        try:
            if self.tied is None:  # a tied engine does not load lm_head.weight: it is not sent
                self.tied = bool(self.ray.get(self.joined))
        except Exception as err:  # the actor died, or could not join
            done.set_exception(err)
            return done
        specs = [(name, t) for name, t in weights.items() if not (self.tied and name == "lm_head.weight")]
        params = [(name, wire_dtype(t, self.dtype), tuple(t.shape)) for name, t in specs]
        buckets, update_info = self.sender.plan(params)
        received = self.actor.receive_push.remote(update_info, version, probe)
        self.jobs.put((buckets, specs, received, done))
        return done

    def _run(self) -> None:
        try:
            self.sender.connect()  # waits for the actor's join
        except BaseException as err:
            failed = err
        else:
            failed = None
        while (job := self.jobs.get()) is not None:
            buckets, specs, received, done = job
            if failed is not None:
                done.set_exception(failed)
                continue
            try:
                self.sender.send(buckets, iter(specs), lambda: bool(self.ray.wait([received], timeout=0)[0]))
                done.set_result(self.ray.get(received))
            except BaseException as err:  # the group is broken: every later push fails too
                failed = self._failure(received, err)
                done.set_exception(failed)

    def _failure(self, received, err: BaseException) -> BaseException:
        """The actor's own error when its call ended in one (it failed or died first), else ``err``."""
        ready, _ = self.ray.wait([received], timeout=0)
        if ready:
            try:
                self.ray.get(received)
            except Exception as actor_err:
                return actor_err
        return err

    def close(self) -> None:
        """Stop after the push being sent (its broadcast aborted, should the actor be gone)."""
        self.jobs.put(None)
        self.sender.close()

