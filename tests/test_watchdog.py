"""A run that stalls stops by itself; a stuck run obeys signals and dies with its starter.

The stall is injected (`DGRAD_TEST_STALL=PROCESS:STEP`): that process blocks inside a
device call before the step, where Python's signal handlers cannot run, as a frozen
collective or a dead peer would hold it.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT
from processes import descendants, kill_tree, outliving, run_command

from dgrad.train.supervisor import launch_local
from dgrad.train.watchdog import STALLED, TEST_STALL_ENV

TRAIN = [sys.executable, "-m", "experiments.train"]
SHORT = [
    "--config.model.name=mlp",
    "--config.num_epochs=1",
    "--config.baseline=",
    "--config.log_every_steps=2",
    "--config.checkpoint_every_steps=3",
]
WATCHDOG_LINE = re.compile(  # a process waiting for the stalled one may see it go instead
    r"^\[(\d)\] (?:error: )?\[process \d\] "
    r"(stalled|SIGTERM not honoured|another process of the run went away)",
    re.M,
)


def _checkpoint_steps(run_dir):
    folder = run_dir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []
    )


@pytest.mark.processes
@pytest.mark.slow
def test_a_stalled_process_stops_every_process_with_one_line_each(tmp_path, monkeypatch):
    """Process 1 blocks before step 7 (after the checkpoint of step 6): it stops itself as
    stalled; process 0, stuck waiting for it, stops too; the checkpoint of step 6 is kept
    and the same command resumes from it."""
    monkeypatch.setenv(TEST_STALL_ENV, "1:6")
    command = [*TRAIN, *SHORT, "--config.stall_timeout=8", f"--workdir={tmp_path}/run"]
    log = io.StringIO()
    started = time.monotonic()
    status = launch_local(command, 2, cpu_devices=1, timeout=240, out=log)
    assert status == STALLED, f"status {status}:\n{log.getvalue()[-4000:]}"
    assert time.monotonic() - started < 200
    lines = WATCHDOG_LINE.findall(log.getvalue())
    assert sorted(process for process, _ in lines) == ["0", "1"], log.getvalue()[-4000:]
    assert "[1] [process 1] stalled: no step completed for" in log.getvalue()
    assert "after step 6 in injected_stall" in log.getvalue()
    assert _checkpoint_steps(tmp_path / "run" / "fdg_k2")[-1] == 6

    monkeypatch.delenv(TEST_STALL_ENV)
    log = io.StringIO()
    assert launch_local(command, 2, cpu_devices=1, timeout=240, out=log) == 0, log.getvalue()[
        -4000:
    ]
    assert "resumed from the checkpoint at step 6" in log.getvalue()


def _start_stuck(args, env, wanted: str, timeout: float = 180):
    """Starts `args` in a session of its own; returns it once its output shows `wanted`."""
    process = subprocess.Popen(
        args,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen, lines = threading.Event(), []

    def read():
        for line in process.stdout:
            lines.append(line)
            if wanted in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not seen.wait(timeout):
        kill_tree(process.pid)
        raise AssertionError(f"never printed {wanted!r}:\n{''.join(lines)[-4000:]}")
    return process, lines, reader


def _sigterm_when_stuck(args, stall: str, wanted: str):
    """Starts `args` stalled at `stall` ("PROCESS:STEP"), sends SIGTERM a second after it
    prints `wanted`; returns its status, its output and the seconds it took to stop."""
    process, lines, reader = _start_stuck(args, {TEST_STALL_ENV: stall}, wanted)
    time.sleep(1.0)  # now inside the blocked device call
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        raise AssertionError(f"SIGTERM did not stop it:\n{''.join(lines)[-4000:]}") from None
    took = time.monotonic() - sent
    reader.join(timeout=5)
    return status, "".join(lines), took


@pytest.mark.slow
def test_a_stuck_run_obeys_sigterm_within_its_grace(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TRAIN, *SHORT, "--config.stall_timeout=0", f"--workdir={run_dir}"]
    status, output, took = _sigterm_when_stuck(args, "0:6", "step 6/")
    assert status == 128 + signal.SIGTERM, output[-4000:]
    assert took < 5.0 + 3.0, took
    assert output.count("SIGTERM not honoured within 5 s") == 1, output[-4000:]
    assert "after step 6 in injected_stall" in output
    assert _checkpoint_steps(run_dir / "fdg_k2")[-1] == 6


@pytest.mark.slow
def test_a_start_stuck_before_its_first_step_takes_back_what_it_wrote(tmp_path):
    """SIGTERM while the first step is stuck (compiling, say): the watchdog's exit leaves
    no run directory that would hold the workdir to this config; the same command
    starts again from nothing."""
    run_dir = tmp_path / "run"
    args = [*TRAIN, *SHORT, "--config.stall_timeout=0", f"--workdir={run_dir}"]
    status, output, _ = _sigterm_when_stuck(args, "0:0", "Pipeline(")
    assert status == 128 + signal.SIGTERM, output[-4000:]
    assert "before the first step in injected_stall" in output, output[-4000:]
    assert "Nothing was trained yet: what this start wrote is taken back" in output
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))


@pytest.mark.processes
@pytest.mark.slow
def test_the_processes_of_a_killed_launcher_stop_while_stuck(tmp_path):
    """Both processes are stuck (process 1 blocked, process 0 waiting for it) when the
    launcher is SIGKILLed; both are gone within the watch interval and the grace."""
    args = [
        sys.executable,
        "-m",
        "experiments.launch",
        "--processes=2",
        "--cpu_devices=1",
        "--",
        *SHORT,
        "--config.stall_timeout=0",
        f"--workdir={tmp_path}/run",
    ]
    launcher, lines, _ = _start_stuck(
        args, {TEST_STALL_ENV: "1:6"}, "[1] [process 1] fdg_k2 step 6/"
    )
    time.sleep(2.0)
    runs = descendants(launcher.pid)
    assert len(runs) == 2, runs
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    left = outliving(runs, 20)
    assert not left, f"still running 20 s after the launcher died:\n{''.join(lines)[-3000:]}"


def test_a_stall_timeout_that_cannot_work_is_one_line(tmp_path):
    status, output = run_command(
        [*TRAIN, "--config.stall_timeout=-2", f"--workdir={tmp_path}/run"],
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert status == 2
    assert output.strip().splitlines()[-1] == (
        "error: config.stall_timeout = -2.0 is not valid: use seconds > 0, 0 (never) or -1 "
        "(follow the run)."
    )


SIGNALLED_THEN_STUCK = """
import os, signal, threading, time
from dgrad.train.signals import StopRequests
from dgrad.train.watchdog import Watchdog

with StopRequests(), Watchdog(stall_timeout=0, grace_s=1.0) as watchdog:
    watchdog.beat(1)
    os.kill(os.getpid(), signal.SIGTERM)
    for step in range(2, 22):  # 2 s of steps after the signal: the stop is under way
        time.sleep(0.1)
        watchdog.beat(step)
    threading.Event().wait()  # then the stop waits for a peer that never answers
"""


@pytest.mark.slow
def test_a_signalled_run_that_steps_on_and_then_sticks_stops_within_the_grace():
    """The beats after a signal show the stop is under way; they do not excuse a stop
    that then waits forever (a vote or a transfer with a peer that died)."""
    status, output = run_command(
        [sys.executable, "-c", SIGNALLED_THEN_STUCK], timeout=60, cwd=ROOT, check=False
    )
    assert status == 128 + signal.SIGTERM, output
    assert "SIGTERM not honoured within 1 s" in output, output
    assert "after step 21" in output, output


LEFT_ALONE = """
import os, sys, time
import jax
from dgrad.train import distributed

distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), cpu_devices=1)
jax.devices()  # every process takes part in starting the backend
if sys.argv[2] == "1":
    os._exit(0)  # a peer that goes away without joining the shutdown
time.sleep(1.0)
distributed.leave_within(3, seconds=2.0)
raise SystemExit(3)  # JAX's shutdown at exit now waits for process 1 at its barrier
"""


@pytest.mark.processes
@pytest.mark.slow
def test_a_failed_process_leaves_within_its_bound_when_a_peer_is_gone():
    from dgrad.train.distributed import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    peers = [
        subprocess.Popen(
            [sys.executable, "-c", LEFT_ALONE, coordinator, str(index)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for index in range(2)
    ]
    started = time.monotonic()
    try:
        output, _ = peers[0].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for peer in peers:
            kill_tree(peer.pid)
        raise AssertionError(f"process 0 did not leave:\n{peers[0].communicate()[0]}") from None
    finally:
        peers[1].wait(timeout=30)
    assert peers[0].returncode == 3, output
    assert "[process 0] the other processes did not join the shutdown within 2 s" in output
    assert time.monotonic() - started < 45
