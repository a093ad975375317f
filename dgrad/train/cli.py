"""The training command line: `python -m experiments.train`.

    python -m experiments.train                                  # the default config
    python -m experiments.train --config experiments/configs/cifar10_resnet56.py \\
        --config.method=ddg --config.num_stages=4 --workdir runs/r56_ddg_k4
    python -m experiments.train --config experiments/configs/cifar10_resnet56.py:smoke
    python -m experiments.train --workdir runs/x --config.num_epochs=20 --extend

`--config FILE[:variant]` loads `get_config(variant)` from FILE;
`--config.<field>=<value>` overrides a field (`--help` lists them all). A
mistake gets one line naming the field, file or directory and what to do, and
exit status 2; SIGINT or SIGTERM stops the run with a checkpoint of the last
step and exit status 128 + signal. Under several processes (`--coordinator`,
`--num_processes`, `--process_id`, or `--distributed` on a cluster JAX knows)
every process runs this same command.

(Overrides are parsed here, not by `ml_collections.config_flags`, which answers a
misspelled field with a traceback.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Sequence

from dgrad.train import config as fields
from dgrad.train.config import files as config_files
from dgrad.train.signals import Stopped, StopRequests


class UsageError(Exception):
    """A mistake on the command line; the message says what to do.

    >>> try:
    ...     parse(["--config=experiments/configs/default.py", "--config.num_stage=3"])
    ... except UsageError as error:
    ...     print(error)
    --config.num_stage is not a config field; did you mean --config.num_stages?
    """


class OneLineParser(argparse.ArgumentParser):
    """An `argparse` parser that answers a mistake with one line and exit status 2
    (argparse's own prints its whole usage first); the scripts in experiments/ use it.

    >>> import contextlib, io
    >>> parser = OneLineParser(prog="x")
    >>> _ = parser.add_argument("--steps", type=int)
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     try:
    ...         parser.parse_args(["--steps=two"])
    ...     except SystemExit as exit:
    ...         print(exit.code, err.getvalue().strip())
    2 error: argument --steps: invalid int value: 'two' (--help lists the flags)
    """

    def __init__(self, *args, raises: type[Exception] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.raises = raises

    def error(self, message):
        """Prints `error: <message>` on stderr and exits with status 2, or raises the
        parser's `raises` exception with that line (for callers that print it themselves).

        >>> OneLineParser(prog="x", raises=UsageError).error("--steps takes a number")
        Traceback (most recent call last):
        ...
        dgrad.train.cli.UsageError: --steps takes a number (--help lists the flags)
        """
        line = f"{message} (--help lists the flags)"
        if self.raises is not None:
            raise self.raises(line)
        self.exit(2, f"error: {line}\n")


def _parser(default_config: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(
        raises=UsageError,
        prog="python -m experiments.train",
        description="Train a stage-split model with BP, DDG or FDG from an experiment config.",
        add_help=False,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument(
        "--config",
        default=default_config,
        metavar="FILE[:VARIANT]",
        help="experiment config file (default: experiments/configs/default.py); :smoke picks "
        "its CPU-sized variant",
    )
    parser.add_argument(
        "--workdir",
        help="where metrics, checkpoints, plots and the model go; a workdir of the same "
        "experiment is resumed (default: runs/<config>-<date>-<time>)",
    )
    parser.add_argument(
        "--extend",
        action="store_true",
        help="train a finished experiment for more epochs (with --config.num_epochs)",
    )
    group = parser.add_argument_group("several processes")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    group.add_argument("--num_processes", type=int, help="how many processes take part")
    group.add_argument("--process_id", type=int, help="this process's index")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run described by the cluster (SLURM, Open MPI, Kubernetes)",
    )
    parser.add_argument(
        "--cpu_devices",
        type=int,
        help="fake CPU devices of this process when there is no accelerator (default: one "
        "per stage and replica)",
    )
    return parser


def help_text() -> str:
    """What `--help` prints: the flags, then every config field with its meaning.

    >>> text = help_text()
    >>> "--workdir" in text, "--config.num_stages" in text
    (True, True)
    """
    return (
        _parser().format_help()
        + "\nconfig fields (override with --config.<field>=<value>):\n"
        + fields.describe()
        + "\n"
    )


def load_config(spec: str):
    """`dgrad.train.config.files.load`, with its mistakes as `UsageError`s.

    >>> config, name = load_config("experiments/configs/default.py:smoke")
    >>> name, config.method
    ('default', 'fdg')
    """
    try:
        return config_files.load(spec)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(f"--config {error}") from None


def config_overrides(rest: Sequence[str]) -> list[str]:
    """The `--config.<field>=<value>` arguments among those a parser left; `UsageError` on
    any other.

    >>> config_overrides(["--config.seed=3", "--config.beta=0.5"])
    ['--config.seed=3', '--config.beta=0.5']
    """
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        raise UsageError(f"unknown argument {unknown[0]} (--help lists the flags)")
    return list(rest)


def parse(argv: Sequence[str], default_config: str | None = None):
    """The parsed flags, and the config with its overrides applied.

    >>> args, config, name = parse(
    ...     ["--config=experiments/configs/default.py", "--workdir=runs/x", "--config.seed=3"]
    ... )
    >>> args.workdir, name, config.seed
    ('runs/x', 'default', 3)
    """
    args, rest = _parser(default_config).parse_known_args(argv)
    overrides = config_overrides(rest)
    if args.help:
        return args, None, None
    if args.config is None:
        raise UsageError("give an experiment config: --config FILE")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise UsageError(f"--cpu_devices {args.cpu_devices}: give 1 or more fake CPU devices")
    config, name = load_config(args.config)
    try:
        fields.apply_overrides(config, overrides)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return args, config, name


def _default_cpu_devices(config, args) -> int:
    replicas = max(config.data_parallel, 1)
    needed = max(config.num_stages * replicas, replicas if config.baseline else 1)
    return -(-needed // (args.num_processes or 1))


def main(
    argv: Sequence[str] | None = None,
    *,
    default_config: str | None = None,
    stop: StopRequests | None = None,
) -> int:
    """Runs the command; returns its exit status. `stop`: the `StopRequests` already
    catching signals (the script enters one before its imports), else one of its own.

    >>> main(["--config=experiments/configs/default.py", "--config.num_stages=0"])
    2
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    with contextlib.ExitStack() as context:
        stop = stop or context.enter_context(StopRequests())
        try:
            args, config, name = parse(argv, default_config)
            if args.help:
                sys.stdout.write(help_text())
                return 0
            fields.check(config)
        except (UsageError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return 2
        try:
            return _run(args, config, name, stop)
        except Stopped as stopped:
            print(f"\n{stopped}", file=sys.stderr, flush=True)
            return 128 + stopped.signal_number


def _run(args, config, name: str, stop: StopRequests) -> int:
    from dgrad.train import distributed

    try:
        distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            cpu_devices=args.cpu_devices or _default_cpu_devices(config, args),
            auto=args.distributed,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    import jax

    status = 1  # an exception in flight
    try:
        status = _train(args, config, name, stop)
        return status
    except Stopped as stopped:  # said by `main`
        status = 128 + stopped.signal_number
        raise
    except Exception as error:
        if not (distributed.lost_a_peer(error) and jax.process_count() > 1):
            raise
        print(
            f"error: [process {jax.process_index()}] another process of the run went away "
            f"({type(error).__name__}: {str(error).strip()}); its own lines say why. The "
            "newest complete checkpoint is kept; the same command resumes from it.",
            file=sys.stderr,
            flush=True,
        )
        return status
    finally:
        distributed.leave_within(status)


def _train(args, config, name: str, stop: StopRequests) -> int:
    import jax

    from dgrad import data
    from dgrad.train import SetupError, train

    stop.check("starting JAX")
    lead = jax.process_index() == 0
    workdir = args.workdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if lead:
        devices = jax.devices()
        if devices[0].platform == "cpu":
            print(
                f"No accelerator: {len(devices)} fake CPU device(s) "
                f"({jax.process_count()} process(es)).",
                flush=True,
            )
        print(f"Workdir: {os.path.abspath(workdir)}", flush=True)
    try:
        results = train(config, workdir, extend=args.extend, stop=stop, name=name)
    except (SetupError, data.DatasetNotFoundError) as error:
        hint = ""
        if isinstance(error, data.DatasetNotFoundError):
            offline = "stdlib" if data.is_text(config.dataset) else "synthetic"
            hint = f"; or try the run on offline data: --config.dataset={offline}"
        print(f"error: {str(error).rstrip('.')}{hint}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    if lead:
        key, heading = "test_accuracy", "Test accuracy"
        if all("test_bits_per_byte" in record for record in results.values()):  # text
            key, heading = "test_bits_per_byte", "Test loss (bits per byte)"
        print(f"\n{heading}:")
        for title, record in results.items():
            print(f"  {title:24s} {record[key]:.4f}")
        print(f"\nCurves: {os.path.join(os.path.abspath(workdir), 'curves.png')}", flush=True)
    return 0
