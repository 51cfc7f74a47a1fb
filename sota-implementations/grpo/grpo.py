"""The original recipe's path to grpo.py: runs the repository root's grpo.py (one copy of the logic)."""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
runpy.run_path(str(ROOT / "grpo.py"), run_name="__main__")
