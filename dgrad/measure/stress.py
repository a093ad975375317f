"""Runs short trainings across local processes many times and counts the ones that freeze.

A path that crosses processes is trusted only after many runs: an intermittent
freeze hides in one. `LAYOUTS` lists the multi-process layouts of stages and
replicas; `stress` starts each (with each method) `runs` times through
`dgrad.train.supervisor.launch_local`, with a deadline per run, and `table` prints
how many finished, froze (ran past the deadline, or stopped itself as stalled)
or failed otherwise.

>>> [layout.name for layout in LAYOUTS]
['2x2 spread', '2x2 interleaved', '2x1', '4x1 K=4', '4x1 K=2xD=2']
>>> LAYOUTS[0].train_flags()
['--config.num_stages=2', '--config.data_parallel=2', '--config.placement=spread']
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time
from typing import Sequence

from dgrad.train.supervisor import launch_local
from dgrad.train.watchdog import STALLED

TIMED_OUT = 124  # launch_local's status for a run past its deadline
SIGNALLED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # the stress itself was asked to stop


class StressStopped(Exception):
    """The stress was interrupted (Ctrl-C or SIGTERM, forwarded to the run in progress):
    `outcomes` holds the runs done before, `status` the run's exit status.

    >>> done = [Outcome("2x1", "fdg", statuses=[0], seconds=[20.0])]
    >>> stopped = StressStopped(done, 128 + signal.SIGTERM)
    >>> stopped.status, print(table(stopped.outcomes).splitlines()[-1])
    | 2x1 | fdg | 1 | 1 | 0 | 0 | 20.0 |
    (143, None)
    """

    def __init__(self, outcomes, status: int):
        super().__init__(f"stopped by a signal (status {status})")
        self.outcomes, self.status = outcomes, status


@dataclasses.dataclass(frozen=True)
class Layout:
    """`processes` local processes with `devices` fake CPU devices each, training K stages
    x D replicas placed as `placement`.

    >>> Layout("2x1", processes=2, devices=1, stages=2).train_flags()
    ['--config.num_stages=2', '--config.data_parallel=1', '--config.placement=spread']
    """

    name: str
    processes: int
    devices: int
    stages: int
    replicas: int = 1
    placement: str = "spread"

    def train_flags(self) -> list[str]:
        """The training command's flags for this layout.

        >>> LAYOUTS[1].train_flags()[-1]
        '--config.placement=interleaved'
        """
        return [
            f"--config.num_stages={self.stages}",
            f"--config.data_parallel={self.replicas}",
            f"--config.placement={self.placement}",
        ]


LAYOUTS = (
    Layout("2x2 spread", processes=2, devices=2, stages=2, replicas=2, placement="spread"),
    Layout(
        "2x2 interleaved", processes=2, devices=2, stages=2, replicas=2, placement="interleaved"
    ),
    Layout("2x1", processes=2, devices=1, stages=2),
    Layout("4x1 K=4", processes=4, devices=1, stages=4),
    Layout("4x1 K=2xD=2", processes=4, devices=1, stages=2, replicas=2),
)

# One epoch of the default config's digits ResNet: 22 steps, a log every 5, an evaluation
# and a checkpoint at the end; a stall is called after 60 s without a step.
RUN_FLAGS = (
    "--config.num_epochs=1",
    "--config.baseline=",
    "--config.log_every_steps=5",
    "--config.stall_timeout=60",
)


@dataclasses.dataclass
class Outcome:
    """How the runs of one layout and method ended.

    >>> outcome = Outcome("2x1", "fdg", statuses=[0, 0, STALLED], seconds=[20.0, 22.0, 61.0])
    >>> outcome.finished, outcome.frozen, outcome.failed, outcome.median_s
    (2, 1, 0, 21.0)
    """

    layout: str
    method: str
    statuses: list[int] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> int:
        return sum(status == 0 for status in self.statuses)

    @property
    def frozen(self) -> int:
        return sum(status in (TIMED_OUT, STALLED) for status in self.statuses)

    @property
    def failed(self) -> int:
        return len(self.statuses) - self.finished - self.frozen

    @property
    def median_s(self) -> float:
        done = [s for s, status in zip(self.seconds, self.statuses) if status == 0]
        return statistics.median(done) if done else float("nan")


# What a failed run's own account of it looks like: an exception, an error line, or a
# fatal or error line of XLA's log (F/E, then the month and day).
_ERROR = re.compile(r"Error|error:|Terminating|DEADLINE_EXCEEDED|UNAVAILABLE|(^|\] )[FE]\d{4} ")
_FRAME = re.compile(r"@\s+0x[0-9a-f]+")  # a line of a native stack trace


def first_errors(output: str, count: int = 4) -> list[str]:
    """The first `count` lines of a run's `output` that say what went wrong (a stack trace
    at its end rarely does).

    >>> first_errors("[1] step 3\\n[2] F1207 13:55:01 coordination_service.cc] Terminating\\n"
    ...              "[2]     @ 0x7f54 SetError()\\n")
    ['[2] F1207 13:55:01 coordination_service.cc] Terminating']
    """
    said = [line for line in output.splitlines() if _ERROR.search(line)]
    return [line for line in said if not _FRAME.search(line)][:count]


def run_once(layout: Layout, method: str, deadline_s: float, extra: Sequence[str] = ()):
    """One training run of `layout` with `method`: (exit status, seconds, output).

    >>> status, seconds, output = run_once(LAYOUTS[2], "fdg", 1.0)  # cannot start in 1 s
    >>> status == TIMED_OUT, "ran past 1 s" in output
    (True, True)
    """
    with tempfile.TemporaryDirectory(prefix="dgrad-stress-") as workdir:
        command = [
            sys.executable,
            "-m",
            "experiments.train",
            *layout.train_flags(),
            f"--config.method={method}",
            *RUN_FLAGS,
            *extra,
            f"--workdir={workdir}/run",
        ]
        log = io.StringIO()
        start = time.monotonic()
        status = launch_local(
            command, layout.processes, cpu_devices=layout.devices, timeout=deadline_s, out=log
        )
        return status, time.monotonic() - start, log.getvalue()


def stress(
    layouts: Sequence[Layout],
    methods: Sequence[str],
    runs: int | dict[str, int],
    deadline_s: float,
    *,
    extra: Sequence[str] = (),
    report=None,
    logs: pathlib.Path | None = None,
) -> list[Outcome]:
    """Every layout with every method, `runs` times (or `runs[layout.name]` times); what
    did not finish is described on `report` with the last lines it printed, and its whole
    output is kept in the folder `logs` when one is given. A Ctrl-C or SIGTERM (which
    `launch_local` forwards to the run in progress) stops the stress: `StressStopped`.

    >>> logs = pathlib.Path(tempfile.mkdtemp())
    >>> [o.statuses for o in stress([LAYOUTS[2]], ["fdg"], 1, 1.0, logs=logs)]  # past 1 s
    [[124]]
    >>> [path.name for path in logs.iterdir()]
    ['2x1-fdg-1.log']
    """
    outcomes = []
    for layout in layouts:
        count = runs if isinstance(runs, int) else runs.get(layout.name, 0)
        for method in methods:
            outcome = Outcome(layout.name, method)
            for attempt in range(count):
                status, seconds, output = run_once(layout, method, deadline_s, extra)
                if status in SIGNALLED:  # not the run's doing: the signal was forwarded to it
                    raise StressStopped(outcomes + [outcome] * bool(outcome.statuses), status)
                outcome.statuses.append(status)
                outcome.seconds.append(seconds)
                if status != 0 and logs is not None:
                    logs.mkdir(parents=True, exist_ok=True)
                    name = f"{layout.name}-{method}-{attempt + 1}.log".replace(" ", "_")
                    (logs / name).write_text(output)
                if status != 0 and report is not None:
                    first = "\n".join("    " + line for line in first_errors(output))
                    tail = "\n".join("    " + line for line in output.splitlines()[-8:])
                    report.write(
                        f"{layout.name} {method} run {attempt + 1}: status {status} after "
                        f"{seconds:.0f} s; its first error lines:\n{first or '    (none)'}\n"
                        f"  and its last lines:\n{tail}\n"
                    )
                    report.flush()
            outcomes.append(outcome)
    return outcomes


def table(outcomes: Sequence[Outcome]) -> str:
    """The outcomes as a Markdown table.

    >>> print(table([Outcome("2x1", "ddg", statuses=[0, 0], seconds=[19.0, 21.0])]))
    | layout | method | runs | finished | frozen | failed | median s |
    |---|---|---|---|---|---|---|
    | 2x1 | ddg | 2 | 2 | 0 | 0 | 20.0 |
    """
    lines = [
        "| layout | method | runs | finished | frozen | failed | median s |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.layout} | {o.method} | {len(o.statuses)} | {o.finished} | {o.frozen} | "
            f"{o.failed} | {o.median_s:.1f} |"
        )
    return "\n".join(lines)
