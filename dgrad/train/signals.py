"""Stopping on SIGINT / SIGTERM at a moment that keeps the run resumable.

`StopRequests` turns the signals into a flag. The training loop checks it between
steps and saves a checkpoint of the step it stopped after; building and compiling check
it between phases. A save in progress finishes, so the newest checkpoint is always
complete. A second signal stops at once, which is safe too: checkpoints are written
to a temporary directory and renamed into place once whole.

>>> import os, signal
>>> with StopRequests() as stop:
...     os.kill(os.getpid(), signal.SIGTERM)
...     stop.requested == signal.SIGTERM
True
>>> stop.exit_status()
143
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """Training stopped on request; `checkpoint_step` is the step saved last (None if none).

    >>> stop = StopRequests()
    >>> stop.request()
    >>> try:
    ...     stop.check("loading the data")
    ... except Stopped as stopped:
    ...     print(stopped, stopped.signal_number, stopped.checkpoint_step)
    Stopped while loading the data, before training; nothing saved. 15 None
    """

    def __init__(self, signal_number: int, message: str, checkpoint_step: int | None = None):
        super().__init__(message)
        self.signal_number, self.checkpoint_step = signal_number, checkpoint_step


class StopRequests:
    """A context in which SIGINT and SIGTERM ask the run to stop instead of killing it.
    Outside the main thread (where Python takes no signals) it only holds the flag.

    >>> stop = StopRequests()
    >>> with stop:  # the handlers are in place only inside
    ...     stop.check("building the model")  # nothing asked: returns None
    ...     stop.request(signal.SIGINT)  # as the signal would, from any thread
    >>> stop.exit_status()
    130
    """

    def __init__(self):
        self.requested: int | None = None
        self._previous = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number, frame):
        if self.requested is not None:  # asked twice: stop now
            sys.stderr.write("\nStopped at once (asked twice).\n")
            sys.stderr.flush()
            os._exit(128 + number)
        self.request(number)

    def request(self, number: int = signal.SIGTERM) -> None:
        """Asks for a stop as the signal `number` would (from any thread)."""
        self.requested = number

    def check(self, what: str) -> None:
        """Raises `Stopped` (saying nothing was trained yet) if a stop was asked for."""
        if self.requested is not None:
            raise Stopped(self.requested, f"Stopped while {what}, before training; nothing saved.")

    def exit_status(self) -> int:
        """The process's exit status for the signal that stopped it: 128 + its number."""
        return 128 + (self.requested or 0)
