"""Run every combination of a grid of config fields, with seeds, and tabulate them.

    python -m experiments.sweep --config experiments/configs/mnist1d.py \\
        --grid 'method=bp,ddg,fdg num_stages=2,4,8 beta=1,0.5 seed=0,1,2' --workdir runs/sweep
    python -m experiments.sweep ... --parallel 2          # two runs at a time
    python -m experiments.sweep ... --config.num_epochs=5 # an override for every run

Combinations the config refuses (beta with ddg, say) are skipped with the reason.
Each run is `python -m experiments.train` in WORKDIR/runs/<name> (its log in
WORKDIR/logs/): a finished run is not redone, an interrupted one resumes. The
results go to WORKDIR/results.csv (a row per run), results.md (median and min-max
over seeds per setting, K as columns) and results.png. See `dgrad.train.sweep`.
"""

import os
import sys

from dgrad.train.cli import OneLineParser, UsageError, config_overrides
from dgrad.train.signals import StopRequests  # noqa: F401 -- imported first: quick start-up


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m experiments.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, metavar="FILE[:VARIANT]")
    parser.add_argument("--grid", required=True, help="'field=v1,v2 other=w1,w2 ...'")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument(
        "--summarise", action="store_true", help="only tabulate what has been run so far"
    )
    args, rest = parser.parse_known_args(argv)
    try:
        rest = config_overrides(rest)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.parallel < 1:
        print(f"error: --parallel {args.parallel}: give 1 or more runs at a time", file=sys.stderr)
        return 2
    from dgrad.train.sweep import SWEEP_FILE, Sweep, SweepError, parse_grid

    try:
        sweep = Sweep(args.config, parse_grid(args.grid), args.workdir, overrides=rest)
        if args.summarise and not os.path.exists(os.path.join(sweep.workdir, SWEEP_FILE)):
            raise SweepError(f"{sweep.workdir} holds no sweep to summarise; run it first")
        sweep.claim()
    except (SweepError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for note in sweep.skipped:
        print(f"skipped  {note}")
    print(f"{len(sweep.runs)} runs in {sweep.workdir}/runs", flush=True)
    failed = 0
    if not args.summarise:
        try:
            failed = sweep.execute(parallel=args.parallel, log=lambda s: print(s, flush=True))
        except KeyboardInterrupt as stop:
            print("Stopped; run the same command to resume the sweep.", file=sys.stderr)
            return 128 + (stop.args[0] if stop.args else 2)
    try:
        paths = sweep.summarise()
    except SweepError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print()
    print(open(paths["md"]).read())
    print("\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
