"""The real data of ../shared/data beside the repo (GSM8K, IFEval with GPT-4's responses).

Tests that read it skip where it is absent (a user's clone without it), but never under CI (``CI`` set):
there a missing folder must fail the run, not pass it with the golden checks skipped.
"""
import os
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GSM8K = DATA / "gsm8k"
IFEVAL = DATA / "ifeval"


def needs(*paths: Path):
    """Skip unless every path exists; under CI run anyway, so that the absence fails loudly."""
    missing = [p for p in paths if not p.exists()]
    return pytest.mark.skipif(
        bool(missing) and not os.environ.get("CI"),
        reason=f"{missing[0] if missing else ''} not found (expected ../shared/data beside the repo)",
    )
