"""Figures of finished runs (torchrl_grpo/telemetry/plots.py; a run writes its own at its end).

    python plot.py outputs/2026-11-22/14-00-00            # one run: PNGs in <run dir>/plots/
    python plot.py multirun/2026-11-22/14-00-00           # a sweep: its jobs overlaid, ranked in sweep.md
    python plot.py outputs/<run a> outputs/<run b> --out compare/

Exit codes: 0 done, 2 a path that is not a run or sweep directory (one line on stderr).
"""
import argparse

from torchrl_grpo.core.errors import exit_with_one_line
from torchrl_grpo.telemetry.plots import main


@exit_with_one_line
def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run directories (with metrics.csv) or sweep directories")
    parser.add_argument("--out", help="where several runs' overlays and sweep.md go (default: the sweep directory, "
                                      "or the folder the runs share)")
    args = parser.parse_args()
    main(args.paths, args.out)


if __name__ == "__main__":
    cli()
