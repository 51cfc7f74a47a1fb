"""What reaches the console: the run's own lines, not the ~20 lines of warnings and progress bars that vLLM,
torch, transformers and datasets print while they start (they tell a user nothing they can act on).

Library log records below ERROR go to the run's ``grpo.log`` only (Hydra's file handler), as do Python
warnings; the libraries' loading progress bars are off. ``logging.verbose=true`` shows everything on the
console as well. Call :func:`quiet_libraries` first thing in an entry point: vLLM reads
``VLLM_CONFIGURE_LOGGING`` when it is imported.
"""
from __future__ import annotations

import logging
import os

# logger names (and their children) whose records below ERROR stay out of the console
LIBRARIES = ("vllm", "torch", "transformers", "datasets", "huggingface_hub", "ray", "py.warnings", "filelock",
             "urllib3", "httpx", "peft", "torchrl", "tensordict", "matplotlib", "PIL")


class LibraryNoise(logging.Filter):
    """Drops library records below ERROR (a console handler's filter; the file handler keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not any(
            record.name == name or record.name.startswith(name + ".") for name in LIBRARIES)


def quiet_libraries(verbose: bool) -> None:
    """Route library logs and warnings through Python logging (so ``grpo.log`` has them) and, unless
    ``verbose``, keep them and the libraries' progress bars off the console."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's records reach Hydra's handlers, not its own
    logging.captureWarnings(True)
    logging.getLogger("vllm").setLevel(logging.INFO if verbose else logging.WARNING)  # INFO: one line per request
    if verbose:
        return
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.addFilter(LibraryNoise())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
