"""The cost of one sandboxed Python call (torchrl_grpo/episodes/sandbox.py): the median wall clock of ``--calls`` calls
of a few snippets, each a fresh process with every layer set up. Not a test.

    python bench/sandbox_cost.py --calls 20
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrl_grpo.episodes.sandbox import run_python  # noqa: E402

SNIPPETS = {"print": "print(6 * 7)", "import numpy": "import numpy\nprint(numpy.arange(3).sum())"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    for name, code in SNIPPETS.items():
        seconds = []
        for _ in range(args.calls):
            start = time.perf_counter()
            result = run_python(code)
            seconds.append(time.perf_counter() - start)
            assert result.status == "ok", result.output
        print(f"{name:14s} median {1000 * statistics.median(seconds):6.1f} ms over {args.calls} calls")


if __name__ == "__main__":
    main()
