"""A collective push never waits forever: workers that never join the weight group, or join and never take the
weights (a stalled or stopped engine process), stop the push in one line naming the deadline's key, within it.
The trainer's side is real (TCP store, gloo group, broadcasts); the engine's, a stand-in that stalls on purpose."""
import threading
import time

import pytest
import torch

from torchrl_grpo.core.errors import RunError

pytestmark = pytest.mark.needs("vllm")  # weight_transfer registers itself with vLLM's factories
DEADLINE_S = 2.0


class StalledEngine:
    """A client of the engine's workers that answers no call until released; ``joins``: its worker joins the group
    first (then stalls before the weights)."""

    def __init__(self, joins: bool):
        self.joins, self.release, self.group = joins, threading.Event(), None

    def init_weight_transfer_engine(self, info: dict) -> None:
        from torchrl_grpo.engines import weight_transfer

        if self.joins:
            self.group, _ = weight_transfer._gloo_group(info["master_address"], info["master_port"], 1,
                                                        info["world_size"], timeout_s=info["timeout_s"])
        else:
            self.release.wait()

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, info: dict) -> None:
        self.release.wait()

    def finish_weight_update(self) -> None:
        pass


def _source():
    from torchrl_grpo.engines.weight_transfer import PushSource

    source = PushSource([("w", torch.zeros(512, 64))], torch.float32, torch.device("cpu"))
    source.feed(iter([("w", torch.ones(512, 64))]))
    return source


def test_workers_that_never_join_stop_the_push_at_the_deadline():
    from torchrl_grpo.engines.weight_transfer import trainer_engine

    engine = StalledEngine(joins=False)
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"^weight push: the engine's 1 worker\(s\) did not join the weight group at "
                                       r"127\.0\.0\.1:\d+ within inference_model.push_timeout_s=2 s \(the engine's "
                                       r"process is stalled or stopped\)$"):
        trainer_engine("gloo", engine, _source(), workers=1, timeout_s=DEADLINE_S)
    assert DEADLINE_S - 0.5 < time.perf_counter() - t0 < DEADLINE_S + 5
    engine.release.set()


def test_workers_that_stop_taking_the_weights_stop_the_push_at_the_deadline():
    from torchrl_grpo.engines.weight_transfer import trainer_engine

    engine = StalledEngine(joins=True)
    transfer = trainer_engine("gloo", engine, _source(), workers=1, timeout_s=DEADLINE_S,
                              timeout_key="ray.collect_timeout_s")
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"^weight push: the engine's workers did not take the weights within "
                                       r"ray.collect_timeout_s=2 s \(the engine's process is stalled or stopped\)$"):
        transfer.send_weights()
    assert time.perf_counter() - t0 < DEADLINE_S + 5
    engine.release.set()
    transfer.shutdown()
