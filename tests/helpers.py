"""What several test modules share: the repository's paths and config tree, the real data beside it, skip
marks, and the entry scripts run as users run them (a real subprocess, its metrics.csv read back).

Fixtures live in conftest.py; this module holds plain names, imported as ``from helpers import ...``.
"""
import csv
import functools
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "config"


def cfg_with(*overrides, name="grpo_gsm8k"):
    """The real config tree composed by Hydra, as the scripts compose it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


# a small LoRA config for the tiny model (models and model sources tests)
LORA = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


# ---------------------------------------------------------------------------------------------- real data
# ../shared/data beside the repo (GSM8K, IFEval with GPT-4's responses). Tests that read it skip where it is
# absent (a user's clone without it), but never under CI (``CI`` set): there a missing folder must fail the
# run, not pass it with the golden checks skipped.
DATA = ROOT.parent / "shared" / "data"
GSM8K = DATA / "gsm8k"
IFEVAL = DATA / "ifeval"


def needs_files(*paths: Path):
    """Skip unless every path exists; under CI run anyway, so that the absence fails loudly."""
    missing = [p for p in paths if not p.exists()]
    return pytest.mark.skipif(
        bool(missing) and not os.environ.get("CI"),
        reason=f"{missing[0] if missing else ''} not found (expected ../shared/data beside the repo)",
    )


# ------------------------------------------------------------------------------------------ optional stacks
@functools.cache
def importable(module: str) -> bool:
    """Whether ``module`` imports in a fresh interpreter (a broken install counts as missing); asked once."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


# Probed when a marked test is about to run (conftest.py), not at import: `import vllm` alone takes seconds.
needs_vllm = pytest.mark.needs("vllm")
needs_ray_and_vllm = pytest.mark.needs("ray", "vllm")


# -------------------------------------------------------------------------------------- scripts as users run
SMALL = ["model=tiny", "env=gsm_symbolic", "env.size=64", "env.num_envs=2", "env.repeats=4",
         "train.optim_batch_size=4", "train.gradient_accumulation_steps=2", "inference_model.max_tokens=8",
         "logging.progress_bar=false", "optimizer.lr=1e-3"]
SCRIPT_ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run(args, cwd, script="grpo.py", timeout=300, env_extra=None) -> subprocess.CompletedProcess:
    """The repository's ``script`` run to its end, output captured."""
    env = {**os.environ, **SCRIPT_ENV, **(env_extra or {})}
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_async(args, cwd, timeout=240, env_extra=None) -> subprocess.CompletedProcess:
    """grpo-async.py run to its end."""
    return run(args, cwd, script="grpo-async.py", timeout=timeout, env_extra=env_extra)


def start(args, cwd, script="grpo.py", **popen_kwargs) -> subprocess.Popen:
    """The script running in the background, in a process group of its own (for ``os.killpg``), output piped."""
    popen_kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen_kwargs}
    return subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=cwd, env={**os.environ, **SCRIPT_ENV},
                            start_new_session=True, **popen_kwargs)


def wait_until(done, proc: subprocess.Popen, seconds: float, poll: float = 0.2) -> None:
    """Return once ``done()`` holds, the process has exited, or ``seconds`` have passed."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None and not done():
        time.sleep(poll)


def metric_rows(run_dir: Path) -> list[dict]:
    """The run's metrics.csv rows; none before its first step."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def finite(cell: str) -> bool:
    """Whether a metrics.csv cell holds a finite number (not empty, nan or inf)."""
    try:
        return math.isfinite(float(cell))
    except (TypeError, ValueError):  # None: a column the row lacks
        return False


def ray_processes() -> str:
    """Ray's daemons still alive on this machine (raylet, GCS); Ray reaps them within a moment of shutdown."""
    out = ""
    for _ in range(40):
        out = subprocess.run(["pgrep", "-fa", "raylet|gcs_server"], capture_output=True, text=True).stdout
        if not out.strip():
            return ""
        time.sleep(0.5)
    return out
