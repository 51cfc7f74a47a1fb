"""vLLM's engine in a process of its own (``inference_model.engine_process=own``), on CPU: the topology GPUs
use, where weights reach the engine streamed through a bounded buffer in /dev/shm and vLLM functions through
pickled rpc. One engine serves the module's engine tests (it takes 20-30 s to start on 2 cores) and the last of them
closes it; then grpo.py runs two steps with its engine in its own process.

It runs on a variant of the tiny model with tied embeddings, the case where a push that leaves the head's
packed weights alone would go unnoticed (see ``vllm_cpu_fixes.redispatch_cpu_gemm``). The references are
the trainer's log-probs (helpers.trainer_logprobs) of the same tokens under the weights the engine should hold.
"""
import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from helpers import (
    LOGPROB_TOL,
    VLLM_DEVICE,
    check_completions,
    finite,
    max_logprob_gap,
    metric_rows,
    needs_vllm,
    perturb,
    processes_with_env,
    run,
)
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.engines import transports, vllm_process, weight_stream
from torchrl_grpo.engines.vllm import VLLMEngine
from torchrl_grpo.engines.vllm_process import MULTIPROCESSING_ENV, wants_own_process
from torchrl_grpo.models.loading import load_policy, merged_state_dict

# one xdist worker runs them in order: the tests on the `own` engine follow one another (the close test checks
# what the push test made), and the engine starts once
pytestmark = pytest.mark.xdist_group("own_engine")
SHM = "/dev/shm"
PUSH_PREFIX = "torchrl_grpo_push_"
QUESTIONS = ["Ana has 5 apples.", "Each box holds 3 eggs. There are 12 boxes. How many eggs are there in total?"]


def _shm() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def _push_dirs() -> set[str]:
    return {name for name in _shm() if name.startswith(PUSH_PREFIX)}


def _shm_held_by(pids) -> set[str]:
    """The /dev/shm entries that processes ``pids`` have mapped or open (vLLM's shared-memory queues and
    semaphores): theirs, unlike whatever else appears there meanwhile (other processes use /dev/shm too)."""
    paths = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths.update(line.split(maxsplit=5)[-1].strip() for line in f if len(line.split()) == 6)
            fd_dir = f"/proc/{pid}/fd"
            paths.update(os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir))
        except OSError:  # gone meanwhile
            pass
    return {os.path.basename(path) for path in paths if path.startswith(SHM + "/") and not path.endswith("(deleted)")}


def _engine_children() -> list:
    """This process's descendants, less multiprocessing's resource tracker (one per process, for good)."""
    import psutil

    kids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if not any("resource_tracker" in part for part in p.cmdline()):
                kids.append(p)
        except psutil.NoSuchProcess:
            pass
    return kids


def _policy(path):
    return load_policy(path, dtype=torch.float32, device="cpu", trainable=False)


@pytest.fixture(scope="module")
def tied_model_path(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with its head tied to the embedding (its checkpoint then has no lm_head.weight)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny_tied")
    shutil.copytree(tiny_model_path, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def own(tied_model_path):
    """The module's engine in its own process, with what the process looked like before it started."""
    env_before, set_num_threads = os.environ.get(MULTIPROCESSING_ENV), torch.set_num_threads
    children_before, held_before = {p.pid for p in _engine_children()}, _shm_held_by([os.getpid()])
    torch.manual_seed(3)
    expected_rand = torch.rand(4)
    torch.manual_seed(3)
    engine = VLLMEngine(tied_model_path, dtype="float32", device=VLLM_DEVICE, max_model_len=512, seed=0,
                        engine_process="own")
    state = SimpleNamespace(
        engine=engine, default_transport=engine.transport.name, env_before=env_before,
        set_num_threads=set_num_threads, expected_rand=expected_rand,
        caller_rand=torch.rand(4), held_here=_shm_held_by([os.getpid()]) - held_before,
        children=[p for p in _engine_children() if p.pid not in children_before],
    )
    yield state
    engine.close()


@pytest.fixture(scope="module")
def prompts(tied_model_path):
    from torchrl_grpo.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tied_model_path)
    return tokenizer, [tokenizer(q)["input_ids"] for q in QUESTIONS]


@needs_vllm
def test_own_process_engine_runs_elsewhere_and_leaves_this_process_alone(own):
    names = sorted(p.name() for p in own.children)
    assert names == ["VLLM::EngineCore", "VLLM::Worker"], names
    assert own.engine.tied_embeddings
    # the topology was this engine's choice: the next engine started here reads the environment it found
    assert os.environ.get(MULTIPROCESSING_ENV) == own.env_before
    assert torch.set_num_threads is own.set_num_threads  # only an in-process vLLM worker replaces it
    assert torch.equal(own.caller_rand, own.expected_rand)  # starting it left the caller's RNG stream alone


@needs_vllm
def test_own_process_worker_has_the_cpu_fixes(own):
    """The eager rank count and the reload-warnings filter are patched into the worker, where sampling runs."""
    def probe(worker):  # nested: pickled by value, so the worker needs no import of this module
        import logging

        import vllm.v1.sample.sampler as sampler

        from torchrl_grpo.engines import vllm_cpu_fixes as fixes

        filters = logging.getLogger(fixes.RELOAD_LOGGER).filters
        return (sampler.batched_count_greater_than is fixes.eager_rank_count, os.getpid(),
                any(isinstance(f, fixes.ExpectedReloadWarnings) for f in filters))

    [(eager, pid, quiet)] = own.engine.llm.collective_rpc(probe)
    assert pid in {p.pid for p in own.children} and eager and quiet


@needs_vllm
def test_own_process_generates_g_completions_with_trainers_logprobs(own, tied_model_path, prompts):
    tokenizer, ids = prompts
    model = _policy(tied_model_path)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    completions = own.engine.generate(ids, n=4, max_tokens=16, temperature=1.0)
    assert torch.equal(torch.rand(4), expected)  # sampling happened in the worker, not on our RNG
    check_completions(completions, len(ids), 4, 16, tokenizer)
    assert len({tuple(c.token_ids) for c in completions[:4]}) > 1  # G distinct draws of one prompt
    assert max_logprob_gap(model, ids, completions, 1.0) < LOGPROB_TOL
    cold = own.engine.generate(ids, n=2, max_tokens=16, temperature=0.7)
    assert max_logprob_gap(model, ids, cold, 0.7) < LOGPROB_TOL


@needs_vllm
def test_own_process_samples_follow_its_sampling_state(own, prompts):
    """The engine core batches requests as they arrive, so draws from one shared generator went to other
    requests from run to run; each request now carries a seed drawn from the engine's seed and count of calls.
    Loading a saved state samples again what followed it (what a resumed run relies on); another seed does not."""
    _, ids = prompts

    def sample():
        return [tuple(c.token_ids) for c in own.engine.generate(ids, n=4, max_tokens=16, temperature=1.0)]

    saved = own.engine.sampling_state()
    first, second = sample(), sample()
    assert first != second and len(set(first[:4])) > 1  # each call, and each of a prompt's n samples, draws anew
    own.engine.load_sampling_state(saved)
    assert sample() == first and sample() == second
    own.engine.load_sampling_state({**saved, "seed": saved["seed"] + 1})
    assert sample() != first


@needs_vllm
def test_own_process_push_streams_through_shm_and_the_engine_then_holds_the_new_weights(
        own, tied_model_path, prompts, monkeypatch):
    _, ids = prompts
    old, new = _policy(tied_model_path), _policy(tied_model_path)
    perturb(new, scale=0.2)  # the tied head moves with the embedding: a stale head is off by far more than TOL
    weights = merged_state_dict(new)
    largest = max(t.numel() * t.element_size() for t in weights.values())
    # buckets of at most 16 KiB: most of a decoder layer's tensors arrive in different buckets
    monkeypatch.setattr(weight_stream, "BUCKET_BYTES", 16 * 1024)
    # the engine's transport from here on: its close must take the stream's folder with it
    own.engine.transport = transports.Stream(own.engine.llm, own.engine.dtype, workers=1, timeout_s=300.0)
    before = _push_dirs()
    own.engine.push_weights(weights)
    made = sorted(_push_dirs() - before)
    assert len(made) == 1
    push_dir = os.path.join(SHM, made[0])
    assert sorted(os.listdir(push_dir)) == ["done.0.fifo", "ready.0.fifo", "weights.buffer"]
    assert os.path.getsize(os.path.join(push_dir, "weights.buffer")) <= max(largest, 16 * 1024) < sum(
        t.numel() * t.element_size() for t in weights.values()) / 4  # never a copy of the weights
    own.push_dirs = made
    completions = own.engine.generate(ids, n=3, max_tokens=16, temperature=1.0)
    assert max_logprob_gap(new, ids, completions, 1.0) < LOGPROB_TOL
    assert max_logprob_gap(old, ids, completions, 1.0) > 100 * LOGPROB_TOL  # a push that did nothing fails here
    own.engine.push_weights(merged_state_dict(old))  # a second push reuses the same buffer
    assert sorted(_push_dirs() - before) == made
    again = own.engine.generate(ids, n=3, max_tokens=16, temperature=1.0)
    assert max_logprob_gap(old, ids, again, 1.0) < LOGPROB_TOL


@needs_vllm
def test_own_process_push_over_vllms_weight_transfer_api_with_our_gloo_engine(own, tied_model_path, prompts,
                                                                             monkeypatch):
    """The default transport (inference_model.weight_transfer=auto): vLLM's weight-transfer API, its worker given
    our gloo engine by vLLM's factory; broadcast in buckets of at most 16 KiB here. Nothing goes through /dev/shm;
    the engine holds each push's weights. A push whose weights fail to arrive half-way raises on both sides
    instead of hanging, and the next push loads whole."""
    from torchrl_grpo.engines import weight_transfer

    _, ids = prompts
    old, new = _policy(tied_model_path), _policy(tied_model_path)
    perturb(new, scale=0.2)
    monkeypatch.setattr(weight_transfer, "TRANSFER_BUCKET_BYTES", 16 * 1024)
    assert own.default_transport == "collective"
    collective = transports.Collective(own.engine.llm, own.engine.devices, own.engine.dtype, 300.0)
    monkeypatch.setattr(own.engine, "transport", collective)
    before = _push_dirs()
    own.engine.push_weights(merged_state_dict(new))
    assert _push_dirs() == before
    [attached] = own.engine.llm.collective_rpc(weight_transfer.attach_in_worker, args=("gloo",))
    assert attached == "GlooWeightTransferEngine"
    completions = own.engine.generate(ids, n=3, max_tokens=16, temperature=1.0)
    assert max_logprob_gap(new, ids, completions, 1.0) < LOGPROB_TOL
    assert max_logprob_gap(old, ids, completions, 1.0) > 100 * LOGPROB_TOL  # a push that did nothing fails here

    def failing():  # the trainer's side fails while the workers wait for the fourth tensor's bucket
        for i, item in enumerate(merged_state_dict(old).items()):
            if i == 3:
                raise OSError("gather failed")
            yield item

    names = list(merged_state_dict(old).items())
    with pytest.raises(OSError, match="gather failed"):
        own.engine.push_weights(weight_stream.StreamedWeights(names, failing()))
    own.engine.push_weights(merged_state_dict(old))
    again = own.engine.generate(ids, n=3, max_tokens=16, temperature=1.0)
    assert max_logprob_gap(old, ids, again, 1.0) < LOGPROB_TOL
    collective.close()


@needs_vllm
def test_own_process_close_leaves_no_process_and_nothing_in_shm(own):
    import psutil

    assert own.children and all(p.is_running() for p in own.children)
    assert getattr(own, "push_dirs", None), "the push test must run first"
    held = own.held_here | _shm_held_by(p.pid for p in own.children)
    assert any(name.startswith("psm_") for name in held), held  # vLLM's queues: the check below checks something
    own.engine.close()
    _, alive = psutil.wait_procs(own.children, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    left = _shm()
    assert not [name for name in own.push_dirs if name in left]
    # what vLLM made in /dev/shm for its processes (shared-memory queues, semaphores) went with them
    assert not held & left, held & left
    own.engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        own.engine.generate([[1, 2]], n=1, max_tokens=2)


@needs_vllm
def test_an_engine_that_does_not_start_in_time_is_killed_and_says_so_in_one_line(tied_model_path):
    """An engine process whose start runs past inference_model.start_timeout_s (here every start does: 2 s) has its
    processes killed and fails in one line, soon after the deadline, leaving nothing behind."""
    import psutil

    before = {p.pid for p in _engine_children()}
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"^the vLLM engine on cpu did not start within inference_model."
                                       r"start_timeout_s=2 s and was killed \("):
        VLLMEngine(tied_model_path, dtype="float32", device=VLLM_DEVICE, max_model_len=512, seed=0,
                   engine_process="own", start_timeout_s=2)
    assert time.perf_counter() - t0 < 60
    new = [p for p in _engine_children() if p.pid not in before]
    _, alive = psutil.wait_procs(new, timeout=20)
    assert not alive, [(p.pid, p.name()) for p in alive]


@needs_vllm
def test_grpo_py_with_its_engine_in_its_own_process(own_engine_run, tmp_path):
    """Two steps of grpo.py with engine_process=own: the step-2 batch was sampled after a push through /dev/shm,
    and its engine log-probs agree with the trainer's updated weights; no engine process outlives the run.
    Resumed from its step-1 checkpoint, step 2 samples and trains again what it did (the engine's sampling state
    is in the checkpoint). The run is conftest.py's own_engine_run (tests/parallel/test_data_parallel.py compares
    torchrun's step 1 with it)."""
    done, run_dir, tag = own_engine_run.done, own_engine_run.run_dir, own_engine_run.tag
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in rows] == [1, 2]
    for key in ("reward", "loss_objective", "entropy", "grad_norm", "engine_trainer_logp_gap_max"):
        assert all(finite(r[key]) for r in rows), key
    assert float(rows[0]["grad_norm"]) > 0  # the entropy bonus moves the weights even where rewards tie
    gaps = [float(r["engine_trainer_logp_gap_max"]) for r in rows]
    assert max(gaps) < LOGPROB_TOL, gaps  # a push that did nothing fails here (step 2)
    # the engine process's start-up lines go to the run's log, as an in-process engine's do, not the console
    assert "Enforce eager set" not in done.stdout + done.stderr and "FutureWarning" not in done.stderr
    assert "][vllm.v1.worker.cpu_worker][" in (run_dir / "grpo.log").read_text()  # the engine process's worker
    again = run([*own_engine_run.args, f"hydra.run.dir={tmp_path / 'again'}",
                 f"train.resume={run_dir}/checkpoints/step_000001"], cwd=tmp_path,
                env_extra={"TORCHRL_GRPO_TEST_RUN": tag})
    assert again.returncode == 0, again.stderr[-3000:]
    [resumed] = metric_rows(tmp_path / "again")
    assert int(float(resumed["step"])) == 2
    for key in ("reward", "loss", "entropy", "grad_norm"):  # the same samples: the trainer's numbers bit for bit
        assert resumed[key] == rows[1][key], (key, resumed[key], rows[1][key])
    deadline = time.time() + 10
    while processes_with_env(f"TORCHRL_GRPO_TEST_RUN={tag}") and time.time() < deadline:
        time.sleep(0.2)
    assert not processes_with_env(f"TORCHRL_GRPO_TEST_RUN={tag}")
    # the runs' push folders (named after the process that pushes) went with their engines
    ours = (f"{PUSH_PREFIX}{done.pid}_", f"{PUSH_PREFIX}{again.pid}_")
    assert not [name for name in _push_dirs() if name.startswith(ours)]


def test_engine_process_choice(monkeypatch):
    """auto keeps what vLLM did before the key existed: the environment variable where set, else this process
    on CPU and vLLM's own on a GPU; same and own override the variable."""
    monkeypatch.setattr(vllm_process, "IN_PROCESS_ENGINES", set())  # as if no engine ran in this process
    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    assert [wants_own_process("auto", on_cpu) for on_cpu in (True, False)] == [False, True]
    for value, own in (("1", True), ("0", False)):
        monkeypatch.setenv(MULTIPROCESSING_ENV, value)
        assert [wants_own_process("auto", on_cpu) for on_cpu in (True, False)] == [own, own]
        assert wants_own_process("own", True) and not wants_own_process("same", False)
    with pytest.raises(ConfigError, match=r"^inference_model.engine_process='both': choose one of auto, same, own$"):
        wants_own_process("both", True)


def test_a_second_engine_in_this_process_gets_its_own(monkeypatch):
    """Two engines in one process share vLLM's global parallel state: closing one broke the other's next
    generate. With one running here, auto gives the next its own process and same is refused."""
    monkeypatch.setattr(vllm_process, "IN_PROCESS_ENGINES", {1234})
    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    assert wants_own_process("auto", True) and wants_own_process("own", True)
    with pytest.raises(ConfigError, match=r"^inference_model.engine_process=same: a vLLM engine already runs"):
        wants_own_process("same", True)


@needs_vllm
def test_the_update_info_given_to_an_actor_beforehand_is_what_each_backend_sends():
    """A rollout actor's push is sent its workers' update info before the broadcast (collect/actor_weights.py);
    the trainer-side engine then checks it sends the same. vLLM's NCCL engine sends names, dtype names and shapes
    (its send_weights, vLLM 0.32; 0.26 adds its packing settings); ours the buckets of _gloo_plan."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    from torchrl_grpo.engines import weight_transfer

    params = [ParamMeta("a.weight", torch.bfloat16, (2, 3)), ParamMeta("a.bias", torch.float32, (4,))]
    nccl = weight_transfer.update_info("nccl", params)
    assert {key: nccl[key] for key in ("names", "dtype_names", "shapes")} == {
        "names": ["a.weight", "a.bias"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]}
    [bucket] = weight_transfer.update_info("gloo", params)["buckets"]
    assert [(name, dtype, shape) for name, dtype, shape, _ in bucket] == [
        ("a.weight", "bfloat16", [2, 3]), ("a.bias", "float32", [4])]
    offsets = [offset for *_, offset in bucket]
    assert offsets[0] == 0 and offsets[1] >= 2 * 3 * 2  # packed one after the other in one buffer
