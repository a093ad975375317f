"""Child processes of a command, in one place: the launcher's, a sweep's, the stress
command's and the benchmark's.

`Supervisor` starts them (each in a session of its own, with the starter's process id in
its environment), passes their output through with a prefix or into a file, forwards
SIGINT and SIGTERM to those running, and on leaving terminates what still runs, then
kills it by process id. `launch_local` runs a program as N processes of one
`jax.distributed` run on this machine, and stops them all when one fails.

>>> import sys
>>> with Supervisor() as children:
...     child = children.start([sys.executable, "-c", "print('hello')"], prefix="[0] ")
...     children.wait(timeout=60)
[0] hello
True
>>> child.returncode
0
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from dgrad.train.distributed import free_port

PARENT_ENV = "DGRAD_STOP_WITH_PARENT"  # what `stop_with_parent` follows


class Supervisor:
    """The children started within a with-block.

    Args:
      out: where `start(..., prefix=...)` passes output through (default sys.stdout).
      grace: seconds between the SIGTERM of a child still running on leaving and its SIGKILL.

    The SIGINTs and SIGTERMs received in the block are in `stopped`, in order; `poll`
    (which a supervising loop calls) sends each of them once to each child still running.
    A child started with `pin=core` runs on that core alone (see `pinned`).

    >>> import sys
    >>> with Supervisor() as children:
    ...     sleeper = children.start([sys.executable, "-c", "import time; time.sleep(60)"])
    ...     quick = children.start([sys.executable, "-c", "exit(3)"])
    ...     ended = children.wait(timeout=2)  # the sleeper has not
    ...     print(ended, children.poll() == [sleeper], children.failed() == [quick])
    ...     children.stop()  # what leaving the block does
    False True True
    >>> sleeper.returncode == -signal.SIGTERM
    True
    """

    def __init__(self, out: IO[str] | None = None, grace: float = 10.0):
        self.out, self.grace = out or sys.stdout, grace
        self.children: list[subprocess.Popen] = []
        self.stopped: list[int] = []
        self._relays: list[threading.Thread] = []
        self._told: list[int] = []  # how many of `stopped` each child was sent
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
            for relay in self._relays:
                relay.join(timeout=10)
        finally:
            for number, handler in self._previous.items():
                signal.signal(number, handler)

    def _forward(self, number: int, frame) -> None:
        self.stopped.append(number)  # (sent by `poll`, never twice to a child)

    def start(
        self,
        argv: Sequence[str],
        *,
        prefix: str | None = None,
        pin: int | None = None,
        env: dict[str, str] | None = None,
        **popen,
    ) -> subprocess.Popen:
        """Starts `argv`: its output passed through line by line after `prefix`, if given,
        else as `popen` (`subprocess.Popen`'s options: stdout, stdin, cwd) says."""
        if prefix is not None:
            popen.update(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        child = subprocess.Popen(
            pinned(argv, pin) if pin is not None else list(argv),
            start_new_session=True,  # a Ctrl-C reaches it once: forwarded, not from the tty
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
                PARENT_ENV: str(os.getpid()),
            },
            **popen,
        )
        self.children.append(child)
        self._told.append(0)  # (one started after a stop is sent it too)
        if prefix is not None:
            relay = threading.Thread(target=self._relay, args=(child.stdout, prefix), daemon=True)
            relay.start()
            self._relays.append(relay)
        return child

    def _relay(self, stream, prefix: str) -> None:
        for line in iter(stream.readline, ""):
            self.out.write(prefix + line)
            self.out.flush()

    def poll(self) -> list[subprocess.Popen]:
        """Sends each child still running the signals received since its last `poll`, and
        returns the children running."""
        for index, child in enumerate(self.children):
            if child.poll() is None:
                missed = self.stopped[self._told[index] :]
                for number in missed:
                    child.send_signal(number)
                self._told[index] += len(missed)
        return [child for child in self.children if child.poll() is None]

    def failed(self) -> list[subprocess.Popen]:
        """The children that ended with a status other than 0, in the order started."""
        return [child for child in self.children if child.poll() not in (None, 0)]

    def wait(self, timeout: float | None = None, poll_s: float = 0.1) -> bool:
        """Waits for every child to end, at most `timeout` seconds; whether they all did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    def stop(self) -> None:
        """Terminates the children still running, then kills what is left after `grace` s."""
        for child in self.poll():
            child.terminate()
        deadline = time.monotonic() + self.grace
        for child in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def stop_with_parent(every_s: float = 0.5) -> None:
    """In a child of a `Supervisor`: sends this process one SIGTERM (a stop with a
    checkpoint) when the starter is gone, watched from a daemon thread every `every_s`
    seconds. Linux's PDEATHSIG would signal once for each thread of the starter as they
    die, and a second SIGTERM stops a run at once, without its checkpoint.

    >>> stop_with_parent()  # this process was not started so: nothing to follow
    """
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def watch():
        while os.getppid() == int(parent):
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dgrad-stop-with-parent", daemon=True).start()


def pinned(argv: Sequence[str], core: int) -> list[str]:
    """`argv` run pinned to `core`: a fresh Python pins itself, then becomes `argv`, so
    no Python runs between the fork and the pinning.

    >>> cores = [sys.executable, "-c", "import os; print(os.sched_getaffinity(0))"]
    >>> subprocess.run(pinned(cores, 0), capture_output=True, text=True).stdout
    '{0}\\n'
    """
    pin = (
        f"import os, sys; os.sched_setaffinity(0, {{{core}}}); os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", pin, *argv]


def launch_local(
    command: Sequence[str],
    processes: int,
    *,
    cpu_devices: int | None = None,
    timeout: float | None = None,
    pins: Sequence[int] | None = None,
    out=None,
) -> int:
    """Runs `command` (argv of a program taking `--coordinator`, `--num_processes`,
    `--process_id` and `--cpu_devices`) as `processes` local processes, process i
    pinned to core `pins[i]` if given, their output passed through after `[i] `.
    Returns 0 if all succeeded; else the first failure's exit status (124 on `timeout`
    seconds), after stopping the rest.

    >>> import io, sys
    >>> fail = [sys.executable, "-c",  # process 1 fails at once, process 0 would wait a minute
    ...         "import sys, time; time.sleep(0 if sys.argv[3].endswith('1') else 60); sys.exit(3)"]
    >>> out = io.StringIO()
    >>> launch_local(fail, processes=2, out=out), out.getvalue()
    (3, 'process 1 exited with status 3; stopping the others\\n')
    """
    out = out or sys.stdout
    coordinator = f"127.0.0.1:{free_port()}"
    deadline = None if timeout is None else time.monotonic() + timeout
    with Supervisor(out) as children:
        for index in range(processes):
            argv = [
                *command,
                f"--coordinator={coordinator}",
                f"--num_processes={processes}",
                f"--process_id={index}",
                *([f"--cpu_devices={cpu_devices}"] if cpu_devices else []),
            ]
            children.start(argv, prefix=f"[{index}] ", pin=None if pins is None else pins[index])
        while children.poll():
            failed = children.failed()
            if failed and not children.stopped:  # (when stopping, each saves, then exits)
                index = children.children.index(failed[0])
                out.write(f"process {index} exited with status {failed[0].returncode}; ")
                out.write("stopping the others\n")
                return failed[0].returncode
            if deadline is not None and time.monotonic() > deadline:
                out.write(f"the processes ran past {timeout:g} s; stopping them\n")
                return 124
            time.sleep(0.1)
        return next((child.returncode for child in children.children if child.returncode), 0)
