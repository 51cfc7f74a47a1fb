"""The suite's own rules: a test that needs a missing stack skips on a user's machine and fails under CI, so that
"passed" under CI means the engines ran."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_missing_stack_skips_here_and_fails_under_ci():
    probe = TESTS / f"probe_needs_{uuid.uuid4().hex}.py"  # not test_*.py: the suite itself never collects it
    probe.write_text("import pytest\n\n\n@pytest.mark.needs('no_such_module_anywhere')\ndef test_it():\n    pass\n")
    try:
        def run(ci: bool) -> subprocess.CompletedProcess:
            env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER")}
            return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-rs",
                                   str(probe)], cwd=TESTS.parent, capture_output=True, text=True, timeout=120,
                                  env={**env, **({"CI": "true"} if ci else {})})

        here, ci = run(ci=False), run(ci=True)
        assert here.returncode == 0 and "1 skipped" in here.stdout, here.stdout
        assert ci.returncode == 1 and "no_such_module_anywhere not importable here (under CI a missing stack fails" \
            in ci.stdout, ci.stdout
    finally:
        probe.unlink()
