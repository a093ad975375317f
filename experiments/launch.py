"""Start a training command as several local processes under jax.distributed.

    python -m experiments.launch --processes 2 -- --config.num_stages=2 \\
        --config.data_parallel=2 --workdir runs/two_processes

Each process gets the train command's arguments plus `--coordinator` (a free
localhost port), `--num_processes`, `--process_id` and `--cpu_devices`; on a
machine without accelerators they run on fake CPU devices with gloo
collectives. Their output comes through with the process index in front; if
one fails, the others are stopped; SIGINT/SIGTERM reach them all.
"""

import sys

from dgrad.train.cli import OneLineParser
from dgrad.train.supervisor import launch_local


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = OneLineParser(prog="python -m experiments.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="how many processes (default 2)")
    parser.add_argument(
        "--cpu_devices",
        type=int,
        help="fake CPU devices per process (default: what the config needs)",
    )
    parser.add_argument("--timeout", type=float, help="stop them all after this many seconds")
    args = parser.parse_args(own)
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        parser.error("--cpu_devices must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parser.error("--timeout must be a positive number of seconds")
    command = [sys.executable, "-m", "experiments.train", *rest]
    return launch_local(command, args.processes, cpu_devices=args.cpu_devices, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
