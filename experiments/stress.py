"""Train across local processes many times and count the runs that freeze.

    python -m experiments.stress                       # every layout, fdg and ddg, 10 runs each
    python -m experiments.stress --runs 30 --layouts "2x2 spread" --methods fdg --logs /tmp/logs
    python -m experiments.stress --layouts 2x1 --config=experiments/configs/lm_stdlib.py:smoke

Layouts (processes x devices each): 2x2 spread and 2x2 interleaved (K=2, D=2), 2x1
(K=2), 4x1 K=4 and 4x1 K=2xD=2. Each run is one epoch of the default config
(22 steps, an evaluation and a checkpoint), or of `--config`, under a deadline; the table counts
the runs that finished, froze (past the deadline, or stopped as stalled) and
failed otherwise. The exit status is 1 if any run did not finish.
"""

import pathlib
import sys

from dgrad.measure import stress
from dgrad.train.cli import OneLineParser


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m experiments.stress", description=__doc__.split("\n")[0])
    names = [layout.name for layout in stress.LAYOUTS]
    parser.add_argument("--runs", type=int, default=10, help="runs of each layout and method")
    parser.add_argument(
        "--layouts", default=",".join(names), help=f"comma-separated, of: {', '.join(names)}"
    )
    parser.add_argument("--methods", default="fdg,ddg", help="comma-separated methods")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--logs", type=pathlib.Path, help="folder for each failed run's output")
    parser.add_argument(
        "--config",
        metavar="FILE[:VARIANT]",
        help="the experiment each run trains for one epoch (default: the default config)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not args.deadline > 0:
        parser.error("--deadline must be a positive number of seconds")
    chosen = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        parser.error(f"--layouts: unknown {unknown or chosen}; choose from {', '.join(names)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        parser.error("--methods names none")
    layouts = [layout for layout in stress.LAYOUTS if layout.name in chosen]
    try:
        outcomes = stress.stress(
            layouts,
            methods,
            args.runs,
            args.deadline,
            extra=[f"--config={args.config}"] if args.config else [],
            report=sys.stdout,
            logs=args.logs,
        )
    except stress.StressStopped as stopped:
        print(stress.table(stopped.outcomes))
        print("Stopped by a signal during a run; the table holds the runs before it.")
        return stopped.status
    print(stress.table(outcomes))
    return 0 if all(o.finished == len(o.statuses) for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
