"""grpo.py's batch source when its engine's process dies (run/sources.py LocalSource), with stand-ins for the
collector, the engine and the weight sync: a new engine takes the dead one's place with the trainer's weights, the
lost batch's prompts are drawn again (also a batch prefetched with ``train.sync_iter=false``), other errors go on
up untouched, and once the restarts are used up a RunError stops the run. tests/run/test_engine_death.py kills a
real vLLM engine's process."""
from types import SimpleNamespace

import pytest

from torchrl_grpo.collect.prefetch import Prefetch
from torchrl_grpo.core.errors import RunError
from torchrl_grpo.run.sources import LocalSource


class EngineDeadError(Exception):
    """Named as vLLM's: what the source recognises a dead engine by."""


class Engine:
    def __init__(self, name, dies_at=()):
        self.name, self.dies_at, self.calls, self.closed = name, set(dies_at), 0, False

    def generate(self):
        self.calls += 1
        if self.calls in self.dies_at:
            raise EngineDeadError("EngineCore encountered an issue")

    def sleep(self):
        pass

    def close(self):
        self.closed = True


class Collector:
    """Draws two prompt indices a batch from ``sampler`` (an integer position), then generates."""

    def __init__(self, engine):
        self.engine, self.sampler = engine, 0
        self.task, self.tokenizer = SimpleNamespace(reward_names=["r"]), None

    def sample_groups(self):
        prompts = [self.sampler, self.sampler + 1]
        self.sampler += 2
        self.engine.generate()
        return prompts, {}

    def collect(self, version, sampled=None):
        prompts, metrics = sampled or self.sample_groups()
        return prompts, dict(metrics), []


class Weights:
    fault = None

    def __init__(self, engine):
        self.engine, self.resent = engine, []

    def push(self, step):
        return {}

    def resend(self):
        self.resent.append(self.engine.name)
        return {"weight_sync_gap": 1e-7}


def source_over(first: Engine, later: list[Engine], max_restarts=3, overlap=False):
    collector = Collector(first)
    made = []

    def new_engine(restart, step):
        made.append((restart, step))
        return later[len(made) - 1]

    source = LocalSource(collector, Weights(first), overlap=overlap, new_engine=new_engine, max_restarts=max_restarts)
    return source, made


def test_a_dead_engine_is_replaced_and_its_batchs_prompts_drawn_again(capsys):
    dead, fresh = Engine("first", dies_at=[2]), Engine("second")
    source, made = source_over(dead, [fresh])
    assert source.take(1).batch == [0, 1]
    delivery = source.take(2)  # its engine dies generating: drawn by the new one
    assert delivery.metrics == {"weight_sync_gap": 1e-7}  # the new engine's check
    assert source.finish(2, delivery, False)["engine_restarts"] == 1
    assert made == [(1, 2)] and dead.closed and source.collector.engine is fresh and source.weights.engine is fresh
    assert source.weights.resent == ["second"] and source.exact_engine is fresh
    assert source.take(3).batch == [4, 5]  # step 2's prompts were 2 and 3, drawn again: none lost, none twice
    err = capsys.readouterr().err
    assert err.count("warning: the vLLM engine's process died (vLLM's EngineDeadError); started a new one with the "
                     "trainer's weights (restart 1 of inference_model.max_engine_restarts=3)") == 1


def test_a_batch_prefetched_by_a_dead_engine_is_drawn_again_by_the_new_one():
    dead, fresh = Engine("first", dies_at=[2]), Engine("second")
    source, made = source_over(dead, [fresh], overlap=True)
    source.prefetch, source.total_steps = Prefetch(source.collector, version=0), 3
    try:
        delivery = source.take(1)  # and step 2's batch starts generating in the background: its engine dies
        assert delivery.batch == [0, 1]
        metrics = source.finish(1, delivery, False)
        assert made == [(1, 1)] and metrics["engine_restarts"] == 1 and metrics["weight_sync_gap"] == 1e-7
        assert source.take(2).batch == [2, 3]  # generated now, by the new engine
    finally:
        source.prefetch.close()


def test_other_errors_go_on_up_untouched():
    class Broken(Engine):
        def generate(self):
            raise ValueError("a reward function's bug")

    source, made = source_over(Broken("first"), [])
    with pytest.raises(ValueError, match="a reward function's bug"):
        source.take(1)
    assert made == [] and source.collector.sampler == 2  # no restart; the prompts were drawn as usual


def test_restarts_run_out_in_one_line():
    source, made = source_over(Engine("first", dies_at=[1]), [Engine("second", dies_at=[1])], max_restarts=1)
    with pytest.raises(RunError, match=r"^the vLLM engine's process died \(vLLM's EngineDeadError\); "
                                       r"inference_model.max_engine_restarts=1 restart\(s\) used up$"):
        source.take(1)
    assert made == [(1, 1)]
