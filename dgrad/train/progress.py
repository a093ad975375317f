"""Training progress: a one-line bar on a terminal, plain log lines otherwise.

>>> import io
>>> out = io.StringIO()
>>> progress = Progress(total=100, start=0, batch_size=32, stream=out, every=50)
>>> progress.update(50, loss=1.25)
>>> "step 50/100" in out.getvalue() and "loss 1.2500" in out.getvalue()
True
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Shows samples/s, loss and ETA for steps `start..total`.

    On a terminal the bar redraws in place at most 5 times a second; elsewhere
    (logs, notebooks' captured output) it prints one line every `every` steps.
    """

    def __init__(
        self,
        total: int,
        start: int,
        batch_size: int,
        *,
        stream: TextIO | None = None,
        every: int = 50,
        label: str = "",
    ):
        self.total, self.batch_size, self.every, self.label = (
            total,
            batch_size,
            max(1, every),
            label,
        )
        self.stream = stream or sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._start_step, self._start_time = start, time.perf_counter()
        self._last_draw = 0.0

    def update(self, step: int, loss: float | None = None) -> None:
        now = time.perf_counter()
        if self.interactive and now - self._last_draw < 0.2 and step < self.total:
            return
        if not self.interactive and step % self.every and step < self.total:
            return
        self._last_draw = now
        done = step - self._start_step
        rate = done / (now - self._start_time) if done > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        fraction = step / max(self.total, 1)
        text = (
            f"{self.label}step {step}/{self.total} {100 * fraction:3.0f}% | "
            f"{rate * self.batch_size:7.1f} samples/s"
            + (f" | loss {loss:.4f}" if loss is not None else "")
            + (f" | ETA {_clock(eta)}" if rate > 0 else "")
        )
        if self.interactive:
            bar = "#" * int(20 * fraction)
            self.stream.write(f"\r[{bar:<20}] {text}\033[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
