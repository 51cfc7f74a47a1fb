"""The trainer's weights to Ray rollout actors: one transport class per way, chosen in one place
(:func:`actor_transport`), each with the same calls (:class:`ActorTransport`) so that the pool
(:class:`~torchrl_grpo.collect.rollout_actors.ActorPool`) holds no if/else over them.

:class:`StorePushes` (``inference_model.weight_transfer=shm``, or the transformers backend): one ``ray.put`` of the
weights as numpy arrays (:func:`as_arrays`), which each actor reads from Ray's object store.

:class:`LinkPushes` (``auto`` or ``collective``): over a collective, with no copy in Ray's object store: vLLM's
weight-transfer API between the trainer (rank 0, a trainer-side engine of :mod:`torchrl_grpo.engines.weight_transfer`)
and the workers of the actor's engine, over vLLM's NCCL engine where both are on GPUs, else over our gloo engine.
A push is one actor call, :meth:`RolloutActor.receive_push` (vLLM's start, update and finish, then the weight
sync check), made from the trainer's main thread when the push is made, in the order of its other calls to the
actor: it lands after the collect the actor is running and before the next one, as a ``ray.put`` push does. The
broadcast that feeds it runs in a thread of the trainer, one per actor (:class:`ActorLink`, on the trainer's GPU),
from the snapshot of the weights it was handed: the trainer never waits for an actor to finish its collect. The
group forms once the actor's engine is up (its join is its first call but a collect).
"""
from __future__ import annotations

import queue
import threading
import warnings
from concurrent import futures
from concurrent.futures import Future
from typing import Protocol

import numpy as np
import torch

from torchrl_grpo.config.precision import dtype_name
from torchrl_grpo.core.errors import one_line
from torchrl_grpo.engines.weight_check import Probe


class ActorClient:
    """vLLM's ``VLLMWeightSyncClient`` for a rollout actor: joining is the actor's
    :meth:`~torchrl_grpo.collect.rollout_actors.RolloutActor.join_weight_transfer` (:attr:`joined` is set once it
    is asked); a push's start, update and finish are the one actor call made beforehand (:attr:`push`: the update
    info it was given and its reference), which ``update_weights`` waits for; its weight sync gap is :attr:`gap`."""

    def __init__(self, ray, actor, backend: str):
        self.ray, self.actor, self.backend = ray, actor, backend
        self.joined, self.join = threading.Event(), None
        self.push, self.gap = None, None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.join = self.actor.join_weight_transfer.remote(self.backend, init_info)
        self.joined.set()
        self.ray.get(self.join)

    def start_weight_update(self) -> None:  # the actor's receive_push call does it
        pass

    def update_weights(self, update_info: dict) -> None:
        sent, received = self.push
        if update_info != sent:
            raise RuntimeError("weight transfer to a rollout actor: the trainer-side engine sends another plan than "
                               "the actor was given (a vLLM version whose update info differs)")
        self.gap = self.ray.get(received)

    def finish_weight_update(self, weight_version: str | None = None) -> None:  # done by receive_push
        pass

    def shutdown_weight_transfer_engine(self) -> None:
        pass


class ActorLink:
    """One actor's weight link: its thread forms the group (the actor asked to join) and then sends each push
    :meth:`submit` hands it, in order. ``host``: the trainer's address as the actor sees it; ``dtype``: the
    engine's (the snapshot's floating-point matrices already are); ``workers``: the engine's (one per GPU of a
    tensor-parallel engine); ``timeout_s``: how long a gloo group waits for the actor to join or to receive
    (``ray.collect_timeout_s``: it does so after the collect it is running); ``tied``: whether the engine leaves
    ``lm_head.weight`` out, when known (else its join says)."""

    def __init__(self, ray, actor, backend: str, dtype: torch.dtype, host: str, workers: int, timeout_s: float,
                 tied: bool | None = None, trainer_device: torch.device | None = None, index: int = 0):
        from torchrl_grpo.engines.weight_transfer import PushSource

        self.ray, self.actor, self.backend, self.index = ray, actor, backend, index
        self.client = ActorClient(ray, actor, backend)
        # NCCL sends from the trainer's GPU: a thread's CUDA device is its own (device 0 unless set), so the link's
        # thread sets it before anything touches CUDA
        self.device = (trainer_device or torch.device("cuda", 0)) if backend == "nccl" else torch.device("cpu")
        self.source = PushSource([], dtype, self.device)  # its weights are declared at the first push
        self.tied = tied
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.transfer = None
        # a daemon: a thread left waiting on an actor that never answers must not hold the interpreter's exit
        self.thread = threading.Thread(target=self._run, args=(host, workers, timeout_s), name="actor-weights",
                                       daemon=True)
        self.thread.start()

    def submit(self, weights: dict[str, torch.Tensor], version: int, probe: Probe | None) -> Future:
        """Push ``weights`` (a snapshot nobody changes) as policy ``version``: the actor's call now, the broadcast
        in the link's thread after the pushes submitted before. The future resolves to the actor's weight sync
        gap, or the push's error."""
        from torchrl_grpo.engines.weight_transfer import update_info

        done: Future = Future()
        try:
            self.client.joined.wait()  # the join goes to the actor before any push
            if self.tied is None:
                self.tied = bool(self.ray.get(self.client.join))
            specs = [(name, t) for name, t in weights.items() if not (self.tied and name == "lm_head.weight")]
            if not self.source.params:
                self.source.declare(specs)
            elif not self.source.matches(specs):
                raise RuntimeError("weight transfer to a rollout actor: the weights' names or shapes changed")
        except Exception as err:  # the actor died, or could not join
            done.set_exception(err)
            return done
        sent = update_info(self.backend, self.source.params)
        self.jobs.put((specs, sent, self.actor.receive_push.remote(sent, version, probe), done))
        return done

    def _run(self, host: str, workers: int, timeout_s: float) -> None:
        from torchrl_grpo.engines.weight_transfer import trainer_engine

        failed = None
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._wait_started(timeout_s)
            self.transfer = trainer_engine(self.backend, self.client, self.source, workers, host, timeout_s,
                                           timeout_key="ray.collect_timeout_s")
        except BaseException as err:
            failed = err
        while (job := self.jobs.get()) is not None:
            specs, sent, received, done = job
            if failed is not None:
                done.set_exception(failed)
                continue
            try:
                self.client.push = (sent, received)
                self.source.feed(iter(specs))
                self.transfer.send_weights()
                done.set_result(self.client.gap)
            except BaseException as err:  # the group is broken: every later push fails too
                failed = err
                done.set_exception(err)

    def _wait_started(self, timeout_s: float) -> None:
        """The group forms once the actor's engine is up: a rendezvous begun while the actor still loads its model
        would time out on its own clock (vLLM's NCCL one waits 300 s) for a model that loads slowly."""
        from ray.exceptions import GetTimeoutError, RayError

        try:
            self.ray.get(self.actor.ready.remote(), timeout=timeout_s)
        except GetTimeoutError:
            raise RuntimeError(f"weight transfer: rollout actor {self.index}'s engine did not start within "
                               f"ray.collect_timeout_s={timeout_s:g} s, so its weight group never formed") from None
        except RayError as err:
            raise RuntimeError(f"weight transfer: rollout actor {self.index} failed while starting its engine "
                               f"({one_line(getattr(err, 'cause', None) or err)})") from None

    def close(self) -> None:
        """Stop after the push being sent (its broadcast aborted, should the actor be gone)."""
        self.jobs.put(None)
        if self.transfer is not None:
            self.transfer.shutdown()


def as_arrays(weights: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """CPU tensors as (numpy array, torch dtype) for ``ray.put``: Ray hands numpy arrays to actors straight from its
    object store, while pickled tensors are copied and unpickled in every actor, which took seconds for SmolLM2
    while the trainer computed (bench/scheduler.py). bfloat16, which numpy lacks, travels as int16."""
    def array(t: torch.Tensor) -> np.ndarray:
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()

    return {name: (array(t.detach()), dtype_name(t.dtype)) for name, t in weights.items()}


def from_arrays(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    """:func:`as_arrays` undone, without a copy (the tensors are read-only views of Ray's object store)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(a).view(getattr(torch, dtype)) for name, (a, dtype) in arrays.items()}


class ActorTransport(Protocol):
    """How the pool's pushes reach its actors. A push's handle (a Ray reference or a future) resolves to the actor's
    weight sync gap (None without the check), or raises the push's error."""

    name: str  # for the console: how pushes travel

    def add(self, i: int, actor) -> None:
        """Actor ``i`` started: whatever its pushes need is made (a new one replaces a dead one's)."""

    def send(self, actors: list, weights: dict[str, torch.Tensor], version: int, probe: Probe | None) -> dict:
        """``weights`` (a snapshot nobody changes) to every actor as policy ``version``: {handle: actor index}."""

    def resend(self, i: int, actor, version: int, probe: Probe | None) -> dict:
        """The last weights sent to restarted actor ``i`` (none sent yet: nothing): {handle: i}."""

    def settle(self, pushes: dict) -> None:
        """Wait for ``pushes`` where a push's errors would otherwise come only after the first collect."""

    def finished(self, pushes: dict) -> list:
        """The handles of ``pushes`` that are done."""

    def gap(self, handle) -> float | None:
        """A finished push's weight sync gap, or its error."""

    def close(self) -> None: ...


class StorePushes:
    """Pushes through Ray's object store: the actor's calls run in order, so a push lands before its next collect.
    With ``adapter`` each push is a LoRA adapter (:class:`~torchrl_grpo.models.adapter.Adapter`: its config and
    arrays), which the actor's engine loads beside its base weights."""

    def __init__(self, ray, adapter: bool = False):
        self.ray, self.ref, self.adapter = ray, None, adapter
        self.name = "(the LoRA adapter) through Ray's object store" if adapter else "through Ray's object store"

    def add(self, i: int, actor) -> None:
        pass

    def send(self, actors: list, weights, version: int, probe: Probe | None) -> dict:
        self.ref = self.ray.put((weights.config, as_arrays(weights.tensors)) if self.adapter else as_arrays(weights))
        return {self._call(a, version, probe): i for i, a in enumerate(actors)}

    def resend(self, i: int, actor, version: int, probe: Probe | None) -> dict:
        return {} if self.ref is None else {self._call(actor, version, probe): i}

    def _call(self, actor, version: int, probe: Probe | None):
        return (actor.push_adapter if self.adapter else actor.push_weights).remote(self.ref, version, probe)

    def settle(self, pushes: dict) -> None:
        pass

    def finished(self, pushes: dict) -> list:
        if not pushes:
            return []
        return self.ray.wait(list(pushes), num_returns=len(pushes), timeout=0)[0]

    def gap(self, handle) -> float | None:
        return self.ray.get(handle)

    def close(self) -> None:
        pass


class LinkPushes:
    """Pushes over each actor's :class:`ActorLink`: vLLM's NCCL engine where the actors' engines are on GPUs
    (``actor_num_gpus``) and this process sees one, else our gloo engine; ``host``: the trainer's address as the
    actors see it; ``timeout_s``: ``ray.collect_timeout_s``."""

    def __init__(self, ray, dtype: torch.dtype, actor_num_gpus: float, host: str, timeout_s: float,
                 trainer_device: torch.device | None = None):
        self.ray, self.dtype, self.host, self.timeout_s = ray, dtype, host, timeout_s
        self.trainer_device = trainer_device
        self.backend = "nccl" if actor_num_gpus > 0 and torch.cuda.is_available() else "gloo"
        self.workers = max(1, int(actor_num_gpus))
        self.name = f"over {self.backend}"
        self.links: dict[int, ActorLink] = {}
        self.snapshot = None

    def add(self, i: int, actor) -> None:
        old = self.links.pop(i, None)
        if old is not None:
            old.close()
        # a restarted actor runs the same model: its tie is known, no wait for its answer
        self.links[i] = ActorLink(self.ray, actor, self.backend, self.dtype, self.host, self.workers, self.timeout_s,
                                  None if old is None else old.tied, self.trainer_device, i)

    def send(self, actors: list, weights: dict[str, torch.Tensor], version: int, probe: Probe | None) -> dict:
        self.snapshot = weights
        return {self.links[i].submit(weights, version, probe): i for i in range(len(actors))}

    def resend(self, i: int, actor, version: int, probe: Probe | None) -> dict:
        return {} if self.snapshot is None else {self.links[i].submit(self.snapshot, version, probe): i}

    def settle(self, pushes: dict) -> None:
        futures.wait(list(pushes))

    def finished(self, pushes: dict) -> list:
        return [push for push in pushes if push.done()]

    def gap(self, handle) -> float | None:
        return handle.result()

    def close(self) -> None:
        for link in self.links.values():
            link.close()


def actor_transport(ray, backend: str, weight_transfer: str, dtype: torch.dtype, actor_num_gpus: float,
                    timeout_s: float, adapter: bool = False, trainer_device: torch.device | None = None
                    ) -> ActorTransport:
    """The one place the actors' transport is chosen: with ``adapter`` (``train_model.lora.sync=adapter``) the
    adapter through the object store; else a collective for vLLM engines unless ``inference_model.weight_transfer=shm``;
    the object store otherwise (and for the transformers backend)."""
    if adapter:
        return StorePushes(ray, adapter=True)
    if backend == "vllm" and weight_transfer != "shm":
        return LinkPushes(ray, dtype, actor_num_gpus, ray.util.get_node_ip_address(), timeout_s, trainer_device)
    return StorePushes(ray)
