"""Training progress: a tqdm bar where one can be drawn, plain log lines elsewhere.

On a terminal or in a notebook (`tqdm.auto`) the bar shows samples/s, loss and ETA;
in logs and captured output a line comes every `every` steps and at the last.

>>> import io
>>> out = io.StringIO()
>>> with Progress(total=100, start=0, batch_size=32, stream=out, every=50) as progress:
...     progress.update(50, loss=1.25)
>>> print(out.getvalue(), end="")
step 50/100  50% | ... samples/s | loss 1.2500 | ETA ...
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _interactive(stream) -> bool:
    in_notebook = "ipykernel" in sys.modules and stream in (sys.stdout, sys.stderr)
    return in_notebook or (hasattr(stream, "isatty") and stream.isatty())


class Progress:
    """Progress of steps `start..total` of `batch_size` samples (or other `unit`s, such as
    a text batch's tokens), labelled `label`.

    >>> import io
    >>> out, log = io.StringIO(), []  # not a terminal: plain lines
    >>> progress = Progress(total=20, start=10, batch_size=8, stream=out, every=5, label="FDG ")
    >>> progress.update(15, loss=0.5)
    >>> out.getvalue().split(" |")[0]  # a resumed run counts from its start step
    'FDG step 15/20  75%'
    >>> progress.write("epoch 1", log.append)  # no bar: the line goes to the log
    >>> progress.close()
    >>> log
    ['epoch 1']
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
        unit: str = "sample",
    ):
        self.total, self.batch_size, self.every, self.label = (
            total,
            batch_size,
            max(1, every),
            label,
        )
        self.unit = unit
        self.stream = stream or sys.stderr
        self._start_step, self._start_time = start, time.perf_counter()
        self._bar = None
        if _interactive(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total * batch_size,
                initial=start * batch_size,
                unit=unit,
                unit_scale=True,
                desc=label.strip() or None,
                file=self.stream,
                dynamic_ncols=True,
                leave=True,
            )

    def update(self, step: int, loss: float | None = None) -> None:
        """Reports that `step` steps are done (a line only every `every` steps and at the end)."""
        if self._bar is not None:
            self._bar.update(step * self.batch_size - self._bar.n)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        if step % self.every and step < self.total:
            return
        done, elapsed = step - self._start_step, time.perf_counter() - self._start_time
        rate = done / elapsed if done > 0 and elapsed > 0 else 0.0
        text = (
            f"{self.label}step {step}/{self.total} {100 * step / max(self.total, 1):3.0f}% | "
            f"{rate * self.batch_size:7.1f} {self.unit}s/s"
            + (f" | loss {loss:.4f}" if loss is not None else "")
            + (f" | ETA {_clock((self.total - step) / rate)}" if rate > 0 else "")
        )
        self.stream.write(text + "\n")
        self.stream.flush()

    def write(self, text: str, log) -> None:
        """Puts a line of text above the bar (or hands it to `log` where there is none)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            log(text)

    def close(self) -> None:
        """Closes the bar, if one is drawn; `with Progress(...)` calls it."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
