"""The codebase stays lint-clean in CI: `ruff check` with the rules of pyproject.toml finds nothing."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed: it comes with the dev extra (pip install -e \".[dev]\")")
def test_ruff_check_passes():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff check failed (`ruff check --fix` sorts imports):\n{done.stdout}{done.stderr}"
