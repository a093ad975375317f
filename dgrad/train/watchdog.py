"""A run that stops making progress, or is asked to stop and cannot, ends by itself.

The training loop `beat`s after every step and evaluation batch. A `Watchdog` thread
watches its own process's beats and ends the process with one line saying where its
main thread waits (the newest complete checkpoint stays as it was):
- on a stall, no beat within the limit: status `STALLED` (75), neither success nor a
  signal's. `stall_timeout` -1 (the default) follows the run: 10 times the slowest step,
  at least `AUTO_FLOOR_S`, and `AUTO_FIRST_S` until the first (compiling) step is done;
  0 turns stall detection off.
- on a SIGINT / SIGTERM not honoured: `StopRequests`' handler runs only once the main
  thread is back in Python, which one blocked in a device call never is, so the watchdog
  hears the signals too (`signal.set_wakeup_fd`). After one, a gap between beats longer
  than the grace (`grace_s`, or twice the slowest step) exits with 128 + its number, also
  when a stop waits for a peer that died. A checkpoint's save is progress: the grace runs
  from its end. A second signal exits at once.

Before an exit it waits (up to `write_wait_s`) for a checkpoint being written in the
background (`watch_writes`) on threads of its own, so that the run resumes from it.

>>> import io
>>> with Watchdog(stall_timeout=0, out=io.StringIO()) as watchdog:
...     watchdog.beat(1)
...     watchdog.limit_s() is None  # 0: no stall detection
True
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Callable

import jax

STALLED = 75  # EX_TEMPFAIL: the run did not fail, it stopped advancing; resume it
AUTO_FLOOR_S = 300.0
AUTO_FIRST_S = 900.0
WRITE_WAIT_S = 120.0  # how long an exit waits for a checkpoint being written
TEST_STALL_ENV = "DGRAD_TEST_STALL"  # "PROCESS:STEP": that process blocks in a device call


class Watchdog:
    """Watches this process's steps from a daemon thread; see the module's docstring.

    Args:
      stall_timeout: seconds without a beat that count as a stall (-1: follow the run,
        0: never).
      grace_s: how long a signalled process may go without a beat before it exits.
      write_wait_s: how long an exit waits for a checkpoint being written.
      out: where the one line goes (default stderr).
      take_back: called before an exit; True when it removed what a start that had
        trained nothing wrote (`dgrad.train.workdir.take_back`), which the line then says.

    >>> import io
    >>> with Watchdog(stall_timeout=5, out=io.StringIO()) as watchdog:
    ...     watchdog.watch_writes(lambda: False)  # asked before an exit: nothing being written
    ...     watchdog.beat(3)  # step 3 done
    ...     with watchdog.saving():  # a checkpoint's save
    ...         pass
    ...     watchdog.limit_s(), watchdog.grace_after_signal_s(), watchdog.step
    (5.0, 5.0, 3)
    """

    def __init__(
        self,
        stall_timeout: float = -1,
        grace_s: float = 5.0,
        *,
        write_wait_s: float = WRITE_WAIT_S,
        out=None,
        take_back: Callable[[], bool] | None = None,
    ):
        self.stall_timeout = float(stall_timeout)
        self.take_back = take_back
        self.grace_s = grace_s
        self.write_wait_s = write_wait_s
        self.out = out
        self._writing: Callable[[], bool] = lambda: False
        self.step: int | None = None
        self.slowest_s = 0.0
        self._last = time.monotonic()
        self._saving = False
        self._signalled: tuple[int, float] | None = None
        self._main = threading.main_thread()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._wakeup = None  # (read end, write end, previous wakeup fd)

    # ------------------------------------------------------- the loop's side

    def beat(self, step: int | None = None) -> None:
        """Marks progress: a step (its number) or other work (an evaluation batch) completed;
        the slowest gap between beats after the first step sets the automatic limit."""
        now = time.monotonic()
        if self.step is not None:
            self.slowest_s = max(self.slowest_s, now - self._last)
        if step is not None:
            self.step = step
        self._last = now

    def saving(self) -> _Saving:
        """A context for a checkpoint save: the grace after a signal runs from its end."""
        return _Saving(self)

    def watch_writes(self, writing: Callable[[], bool]) -> None:
        """Has an exit wait while `writing()` (a checkpoint's background write) says True."""
        self._writing = writing

    def limit_s(self) -> float | None:
        """The stall limit now, in seconds (None: no stall detection)."""
        if self.stall_timeout > 0:
            return self.stall_timeout
        if self.stall_timeout == 0:
            return None
        if self.step is None:
            return AUTO_FIRST_S
        return max(AUTO_FLOOR_S, 10 * self.slowest_s)

    def grace_after_signal_s(self) -> float:
        """The longest gap between beats a signalled process may take before it exits."""
        return max(self.grace_s, 2 * self.slowest_s)

    # ---------------------------------------------------------- the thread

    def __enter__(self) -> Watchdog:
        if threading.current_thread() is self._main:
            read, write = os.pipe()
            os.set_blocking(write, False)
            try:
                previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            except ValueError:
                os.close(read)
                os.close(write)
            else:
                self._wakeup = (read, write, previous)
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="dgrad-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._closed.set()
        if self._wakeup is not None:
            read, write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # wakes the thread
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._wakeup is not None:
            os.close(self._wakeup[0])
            self._wakeup = None

    def _watch(self) -> None:
        while not self._closed.is_set():
            self._listen(0.25)
            now = time.monotonic()
            if self._saving:
                continue
            if self._signalled is not None:
                number, since = self._signalled
                grace = self.grace_after_signal_s()
                if now - max(since, self._last) > grace:
                    self._exit(
                        128 + number,
                        f"{signal.Signals(number).name} not honoured within {grace:g} s "
                        f"(stuck {self._waiting()}); stopping now",
                    )
            limit = self.limit_s()
            if limit is not None and now - self._last > limit:
                self._exit(
                    STALLED,
                    f"stalled: no step completed for {now - self._last:.0f} s "
                    f"(limit {limit:g} s, config.stall_timeout), waiting {self._waiting()}",
                )

    def _listen(self, timeout_s: float) -> None:
        """Notes the signals this process received (their bytes on the wakeup pipe)."""
        if self._wakeup is None:
            self._closed.wait(timeout_s)
            return
        read, _, previous = self._wakeup
        try:
            ready, _, _ = select.select([read], [], [], timeout_s)
            received = os.read(read, 64) if ready else b""
        except OSError:  # closed by __exit__
            return
        for number in received:
            if previous >= 0:  # whoever listened before (an event loop) still hears it
                try:
                    os.write(previous, bytes([number]))
                except OSError:
                    pass
            if number not in (signal.SIGINT, signal.SIGTERM):
                continue
            if self._signalled is not None and not self._saving:
                self._exit(
                    128 + number, f"{signal.Signals(number).name} twice; stopping now", wait=False
                )
            self._signalled = (number, time.monotonic())

    def _waiting(self) -> str:
        step = "before the first step" if self.step is None else f"after step {self.step}"
        return f"{step} in {waiting_in(self._main)}"

    def _wait_for_write(self) -> float:
        """Waits up to `write_wait_s` while a checkpoint is being written; the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < self.write_wait_s:
            try:
                if not self._writing():
                    break
            except Exception:  # (the checkpointer closing meanwhile): nothing to wait for
                break
            time.sleep(0.05)
        return time.monotonic() - start

    def _exit(self, status: int, why: str, wait: bool = True) -> None:
        name = f"process {jax.process_index()}" if jax.process_count() > 1 else "this run"
        out = self.out or sys.stderr
        try:  # a dead starter leaves no one to read it: the exit must not depend on it
            waited = self._wait_for_write() if wait else 0.0
            written = f" (after {waited:.1f} s waiting for its write)" if waited >= 0.05 else ""
            try:
                taken = bool(self.take_back and self.take_back())
            except Exception:  # what was written stays; the exit must not depend on it
                taken = False
            if taken:
                kept = (
                    "Nothing was trained yet: what this start wrote is taken back, and the "
                    "same command starts again"
                )
            else:
                kept = (
                    f"The newest complete checkpoint is kept{written}; the same command "
                    "resumes from it"
                )
            out.write(f"\n[{name}] {why}. {kept}.\n")
            out.flush()
        finally:
            os._exit(status)


class _Saving:
    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog

    def __enter__(self):
        self.watchdog._saving = True

    def __exit__(self, *exc):
        self.watchdog._last = time.monotonic()  # progress, but not a step's length
        self.watchdog._saving = False


def waiting_in(thread: threading.Thread) -> str:
    """Where `thread` is in dgrad's code: the innermost dgrad function on its stack, and the
    stage (`k`) or the move (`src` -> `dst`) of the nearest caller that works on one.

    >>> import threading
    >>> waiting_in(threading.current_thread())
    'waiting_in (dgrad/train/watchdog.py:...)'
    """
    frame = sys._current_frames().get(thread.ident)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    innermost, about = None, ""
    while frame is not None and not about:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(package + os.sep):
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            if innermost is None:
                where = os.path.relpath(path, os.path.dirname(package))
                innermost = f"{name} ({where}:{frame.f_lineno})"
            names = frame.f_locals
            if "src" in names and "dst" in names:
                about = f", in {name} moving stage {names['src']}'s values to stage {names['dst']}"
            elif isinstance(names.get("k"), int):
                about = f", in {name} for stage {names['k']}"
        frame = frame.f_back
    return (innermost or "code outside dgrad") + about


def injected_stall(step: int) -> None:
    """For tests: blocks this process inside a device call at `step` when the environment
    says `DGRAD_TEST_STALL=PROCESS:STEP` for it, as a stuck device or peer would.

    >>> injected_stall(3)  # not asked for: returns at once
    """
    wanted = os.environ.get(TEST_STALL_ENV)
    if not wanted:
        return
    process, _, at = wanted.partition(":")
    if int(process) != jax.process_index() or int(at) != step:
        return
    forever = threading.Event()

    def block(x):
        forever.wait()
        return x

    def device_call(x):
        return jax.pure_callback(block, jax.ShapeDtypeStruct((), "float32"), x)

    jax.jit(device_call)(jax.numpy.zeros(())).block_until_ready()
