"""An actor's weight link (collect/actor_weights.py) on the trainer's side: its thread stages NCCL pushes on the
trainer's GPU, not on device 0, and forms the group only once the actor's engine is up, with a deadline that names
the stage. Ray and CUDA are stand-ins here: what is checked is the order of the calls and the device."""
import threading

import pytest
import torch
from ray.exceptions import GetTimeoutError

from torchrl_grpo.collect import actor_weights
from torchrl_grpo.collect.actor_weights import ActorLink


class Remote:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def remote(self, *args):
        self.log.append(("call", self.name))
        return self.name


class FakeActor:
    def __init__(self, log):
        self.ready = Remote("ready", log)
        self.join_weight_transfer = Remote("join", log)
        self.receive_push = Remote("receive", log)


class FakeRay:
    """``get`` answers ``ready`` after ``start_s`` of pretend start-up, or times out where the deadline is shorter."""

    def __init__(self, log, start_s):
        self.log, self.start_s = log, start_s

    def get(self, ref, timeout=None):
        if ref == "ready" and timeout is not None and timeout < self.start_s:
            raise GetTimeoutError("timed out")
        self.log.append(("got", ref))
        return True


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda.set_device recorded with the thread that called it; the trainer-side engine recorded too."""
    log = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: log.append(("set_device", str(d),
                                                                      threading.current_thread().name)))

    def trainer_engine(backend, client, source, workers, host, timeout_s, timeout_key):
        assert timeout_key == "ray.collect_timeout_s"
        log.append(("group", backend, str(source.device), threading.current_thread().name))
        return type("Transfer", (), {"shutdown": lambda self: None})()

    monkeypatch.setattr("torchrl_grpo.engines.weight_transfer.trainer_engine", trainer_engine)
    return log


def run_link(log, ray, backend, device=None):
    link = ActorLink(ray, FakeActor(log), backend, torch.float32, "127.0.0.1", 1, timeout_s=5, tied=True,
                     trainer_device=device, index=3)
    link.close()
    link.thread.join(5)
    return link


def test_the_links_thread_sets_the_trainers_gpu_and_forms_the_group_after_the_engine_is_up(cuda_calls):
    run_link(cuda_calls, FakeRay(cuda_calls, start_s=1), "nccl", torch.device("cuda", 2))
    assert cuda_calls == [("set_device", "cuda:2", "actor-weights"), ("call", "ready"), ("got", "ready"),
                          ("group", "nccl", "cuda:2", "actor-weights")]


def test_a_gloo_link_touches_no_gpu(cuda_calls):
    run_link(cuda_calls, FakeRay(cuda_calls, start_s=1), "gloo", torch.device("cuda", 2))
    assert [c[0] for c in cuda_calls] == ["call", "got", "group"] and cuda_calls[-1][2] == "cpu"


def test_an_engine_that_does_not_start_in_time_fails_its_pushes_naming_the_stage(cuda_calls):
    log = []
    link = ActorLink(FakeRay(log, start_s=10), FakeActor(log), "gloo", torch.float32, "127.0.0.1", 1, timeout_s=5,
                     tied=True, index=3)
    link.client.joined.set()
    pushed = link.submit({"w": torch.zeros(2)}, 1, None)
    link.close()
    link.thread.join(5)
    with pytest.raises(RuntimeError, match=r"^weight transfer: rollout actor 3's engine did not start within "
                                           r"ray.collect_timeout_s=5 s, so its weight group never formed$"):
        pushed.result(timeout=5)
    assert not any(c[0] == "group" for c in cuda_calls)


def test_the_pool_hands_its_links_the_trainers_device(monkeypatch):
    made = []
    monkeypatch.setattr(actor_weights, "ActorLink", lambda *args: made.append(args) or type(
        "L", (), {"close": lambda self: None, "tied": None})())
    pushes = actor_weights.LinkPushes(object(), torch.bfloat16, 0.5, "127.0.0.1", 30, torch.device("cuda", 1))
    pushes.add(0, object())
    assert made[0][-2:] == (torch.device("cuda", 1), 0)
