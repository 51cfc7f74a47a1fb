"""The recipe-path twin of the repository root's evaluate.py: runs it (one copy of the logic)."""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
runpy.run_path(str(ROOT / "evaluate.py"), run_name="__main__")
