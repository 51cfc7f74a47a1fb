"""Shared pytest fixtures and hooks. Each block below is owned by the module named in its header."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; set before transformers/huggingface_hub are imported

import pytest

from helpers import importable

# ===================================================================================================
# skip marks for optional stacks (tests/helpers.py: needs_vllm, needs_ray_and_vllm)
# ===================================================================================================


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*modules): skip unless every module imports (probed once, lazily)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        missing = [module for module in mark.args if not importable(module)]
        if missing:
            pytest.skip(f"{' and '.join(missing)} not importable here")


# ===================================================================================================
# rollout fixtures (torchrl_grpo/engines/base.py, tests/test_rollout.py): one vLLM engine per session
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
    """A float32 CPU VLLMEngine on the tiny model, shared by the session and closed at its end.

    Tests that push weights into it must push the original weights back before they return.
    """
    try:
        import vllm  # noqa: F401
    except Exception as e:  # missing, or a broken install
        pytest.skip(f"vllm is not importable here ({type(e).__name__}: {e})")
    from torchrl_grpo.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_model_path, dtype="float32", device="cpu", max_model_len=512, seed=0)
    yield engine
    engine.close()


# ===================================================================================================
# end of rollout fixtures
# ===================================================================================================
