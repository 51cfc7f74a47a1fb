"""Shared pytest fixtures and hooks. Each block below is owned by the module named in its header."""
import atexit
import os
import shutil
import uuid
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; set before transformers/huggingface_hub are imported
# the runs the tests start list themselves in a registry of this session's own (torchrl_grpo/core/machine_runs.py):
# the two workers' runs, side by side on purpose, would otherwise each warn of the other
if "TORCHRL_GRPO_RUNS" not in os.environ:
    os.environ["TORCHRL_GRPO_RUNS"] = f"/tmp/torchrl_grpo_runs-test-{os.getpid()}"
    atexit.register(shutil.rmtree, os.environ["TORCHRL_GRPO_RUNS"], ignore_errors=True)
if worker := os.environ.get("PYTEST_XDIST_WORKER"):  # pytest.ini: one worker per core
    # one OpenMP thread per process, and each worker's vLLM engines on a core of their own: torch's threads
    # spinning on the core the other worker computes on made compute-bound tests up to six times slower
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker.removeprefix("gw")) % len(cores)]))

import pytest

from helpers import FLOAT32, SMALL, VLLM_DEVICE, importable, run, skip_unless_ci

# ===================================================================================================
# skip marks for optional stacks (tests/helpers.py: needs_vllm, needs_ray_and_vllm)
# ===================================================================================================


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*modules): skip unless every module imports (probed once, lazily); "
                            "under CI fail instead")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group marks into the tests' ids
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (pytest.ini: two workers, --dist loadgroup) the tests that start Ray run one after the
    other on one worker: each ends by checking that no Ray daemon is left on the machine, and the SLURM script
    stops every Ray of the machine at its end. They come first: the scheduler hands out work in this order, and
    the group (minutes of tests in a row) started last would hold the suite's end while the other worker idles.
    Other groups (a module's tests that share one engine in order) come first too, for the same reason."""
    for item in items:
        if any("ray" in mark.args for mark in item.iter_markers("needs")):
            item.add_marker(pytest.mark.xdist_group("ray"))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: the rest keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        missing = [module for module in mark.args if not importable(module)]
        if missing:
            skip_unless_ci(f"{' and '.join(missing)} not importable here")


# ===================================================================================================
# rollout fixtures (torchrl_grpo/engines/base.py, tests/engines/test_rollout.py): one vLLM engine per session
# ===================================================================================================


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The tiny random Qwen2 (model_sources.resolve_model("tiny")), built once into the model cache."""
    from torchrl_grpo.models.sources import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    """The tiny model's tokenizer (nothing mutates it: shared by the session)."""
    from torchrl_grpo.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_path):
    """A float32 VLLMEngine on the tiny model (on the CPU, or GPU 0 with a CUDA build of vLLM), shared by the
    session and closed at its end.

    Tests that push weights into it must push the original weights back before they return.
    """
    if not importable("vllm"):  # missing, broken, or its CUDA build on a machine without a GPU
        skip_unless_ci("no vLLM engine can start here")
    from torchrl_grpo.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_model_path, dtype="float32", device=VLLM_DEVICE, max_model_len=512, seed=0)
    yield engine
    engine.close()


# ===================================================================================================
# end of rollout fixtures
# ===================================================================================================


# ===================================================================================================
# grpo.py with its engine in its own process (tests/engines/test_engine_process.py, and the one-process reference of
# tests/parallel/test_data_parallel.py's torchrun step): the same run, made once per session
# ===================================================================================================

OWN_ENGINE_RUN = ["train.total_dialog_turns=16", "inference_model.engine_process=own", "loss.old_log_probs=trainer",
                  "train.entropy_coeff=0.01", "logging.checkpoint_frequency=1"]


@pytest.fixture(scope="session")
def own_engine_run(tmp_path_factory):
    """Two steps of grpo.py (float32) with engine_process=own, its engine's sampling seeded per request; ``tag``
    is in the environment of the run and of every process it starts."""
    cwd = tmp_path_factory.mktemp("own_engine_run")
    tag, args = uuid.uuid4().hex, [*SMALL, *FLOAT32, *OWN_ENGINE_RUN]
    done = run([*args, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd, env_extra={"TORCHRL_GRPO_TEST_RUN": tag})
    return SimpleNamespace(args=args, cwd=cwd, run_dir=cwd / "run", done=done, tag=tag)


# ===================================================================================================
# end of the engine process run
# ===================================================================================================
