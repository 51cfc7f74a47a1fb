"""What reaches the console: the run's own lines, not the ~20 lines of warnings and progress bars that vLLM,
torch, transformers and datasets print while they start (they tell a user nothing they can act on).

Library log records below ERROR go to the run's ``grpo.log`` only (Hydra's file handler; a rollout actor's
to ``rollout_actor_<i>.log``), as do Python warnings; the libraries' loading progress bars are off.
``logging.verbose=true`` shows everything on the console as well. Call :func:`quiet_libraries` first thing
in an entry point: vLLM reads ``VLLM_CONFIGURE_LOGGING`` when it is imported.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

_quiet: list[bool] = []  # [True] once quiet_libraries() kept the libraries off the console

# logger names (and their children) whose records below ERROR stay out of the console
LIBRARIES = ("vllm", "torch", "transformers", "datasets", "huggingface_hub", "ray", "py.warnings", "filelock",
             "urllib3", "httpx", "peft", "torchrl", "tensordict", "matplotlib", "PIL")


class LibraryNoise(logging.Filter):
    """Drops library records below ERROR (a console handler's filter; the file handler keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not any(
            record.name == name or record.name.startswith(name + ".") for name in LIBRARIES)


def quiet_libraries(verbose: bool, log_file: str | None = None) -> None:
    """Route library logs and warnings through Python logging (so the run's log has them) and, unless
    ``verbose``, keep them and the libraries' progress bars off the console. In a process without Hydra's
    handlers (a Ray rollout actor), ``log_file`` gets every record and stderr (which Ray forwards to the
    driver's console) what the console would."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's records reach our handlers, not its own
    logging.captureWarnings(True)
    logging.getLogger("vllm").setLevel(logging.INFO if verbose else logging.WARNING)  # INFO: one line per request
    root = logging.getLogger()
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)  # on another node of a cluster, too
        to_file = logging.FileHandler(log_file)
        to_file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(to_file)
        root.addHandler(logging.StreamHandler(sys.stderr))
        root.setLevel(logging.INFO)
    _quiet.clear()
    if verbose:
        return
    _quiet.append(True)
    for handler in root.handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.addFilter(LibraryNoise())
    # read when each library is imported (not importing them here keeps a bad key's error fast); already imported
    # (the Python API, called from a script that uses them): told directly
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the hub's and transformers' bars
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:  # its constants were read at import: transformers asks it when imported
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def child_process_quiet_env() -> dict[str, str]:
    """The environment that keeps a library process this one starts (vLLM's engine process and its workers) as
    quiet as this one: vLLM's records below ERROR to this process's log file (a logging config vLLM reads at
    import), Python warnings and torch's C++ warnings off. Empty when the console shows everything
    (``logging.verbose=true``) or this process has no log file."""
    files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not _quiet or not files:
        return {}
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": files[0], "formatter": "plain"},
                     "console": {"class": "logging.StreamHandler", "level": "ERROR", "formatter": "plain",
                                 "stream": "ext://sys.stderr"}},
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
        "root": {"handlers": ["file", "console"], "level": "WARNING"},
    }
    path = Path(files[0]).with_name(".engine_logging.json")
    path.write_text(json.dumps(config))
    return {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": str(path), "PYTHONWARNINGS": "ignore",
            "TORCH_CPP_LOG_LEVEL": "ERROR"}
