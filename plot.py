"""Figures of finished runs (torchrl_grpo/telemetry/plots.py; a run writes its own at its end).

    python plot.py outputs/2026-11-22/14-00-00            # one run: PNGs in <run dir>/plots/
    python plot.py multirun/2026-11-22/14-00-00           # a sweep: its jobs overlaid, ranked in sweep.md
    python plot.py outputs/<run a> outputs/<run b> --out compare/

Exit codes: 0 done, 2 a path that is not a run or sweep directory (one line on stderr).
"""
import sys

from torchrl_grpo.run.cli import main

if __name__ == "__main__":
    main(["plot", *sys.argv[1:]])  # = torchrl-grpo plot ...
