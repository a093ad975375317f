"""Processes the tests start: run with a timeout, find their children, and make sure
none outlives its test (Linux: read from /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def process_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (state, parent, ...), or
    None once the process is gone (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped by its dead parent, does not)."""
    stat = process_stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(pid: int) -> list[int]:
    """The process ids of `pid`'s children, theirs, and so on (Linux: read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = process_stat(int(entry))
        if stat is not None:
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found += frontier
    return found


def outliving(pids, seconds: float) -> list[int]:
    """Waits up to `seconds` for `pids` to end; SIGKILLs and returns those still running."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def kill_tree(pid: int) -> None:
    """SIGKILLs `pid`'s process group and every process it started, by id (the runs a
    launcher starts live in sessions of their own). The group is frozen first, so that
    it starts none after the list is read; the runs themselves start no processes."""

    def send(kill, target, number):
        try:
            kill(target, number)
        except ProcessLookupError:
            pass

    send(os.killpg, pid, signal.SIGSTOP)
    below = descendants(pid)
    send(os.killpg, pid, signal.SIGKILL)
    for child in below:
        send(os.kill, child, signal.SIGKILL)


def run_command(args, timeout: float, cwd=None, env=None, check: bool = True):
    """Runs `args` in a process group of its own; on timeout kills it and every process it
    started (`kill_tree`) and fails with what they printed. Returns (status, output)."""
    process = subprocess.Popen(
        args,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        output, _ = process.communicate()
        raise AssertionError(f"{args} ran past {timeout} s, killed:\n{output[-4000:]}") from None
    if check:
        assert process.returncode == 0, f"{args} exited {process.returncode}:\n{output[-4000:]}"
    return process.returncode, output


def rerun_with_cpu_devices(request, count: int, root) -> bool:
    """Reruns the test of `request` in a process of its own with `count` fake CPU devices
    (on any host: JAX_PLATFORMS=cpu), unless this process has them; True if it reran.
    In the rerun itself too few devices fail the test instead of rerunning it again."""
    import sys

    import jax
    import pytest

    if len(jax.devices()) >= count:
        return False
    if os.environ.get("DGRAD_TEST_DEVICES") == str(count):
        pytest.fail(f"asked for {count} fake CPU devices, got {len(jax.devices())}")
    run_command(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        timeout=900,
        cwd=root,
        env={"DGRAD_TEST_DEVICES": str(count), "JAX_PLATFORMS": "cpu"},
    )
    return True
