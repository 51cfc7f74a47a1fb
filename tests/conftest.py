"""Shared pytest fixtures. Each block below is owned by the module named in its header."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; set before transformers/huggingface_hub are imported

import pytest


# ===================================================================================================
# rollout fixtures (torchrl_grpo/rollout.py, tests/test_rollout.py): one vLLM engine per session
# ===================================================================================================


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The tiny random Qwen2 (model_sources.resolve_model("tiny")), built once into the model cache."""
    from torchrl_grpo.model_sources import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_path):
    """A float32 CPU VLLMEngine on the tiny model, shared by the session and closed at its end.

    Tests that push weights into it must push the original weights back before they return.
    """
    try:
        import vllm  # noqa: F401
    except Exception as e:  # missing, or a broken install
        pytest.skip(f"vllm is not importable here ({type(e).__name__}: {e})")
    from torchrl_grpo.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_path, dtype="float32", device="cpu", max_model_len=512, seed=0)
    yield engine
    engine.close()


# ===================================================================================================
# end of rollout fixtures
# ===================================================================================================
