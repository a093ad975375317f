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
from helpers import ROOT, descendants, kill_tree, outliving, run_command

from dgrad.distributed import launch_local
from dgrad.train.watchdog import STALLED, TEST_STALL_ENV

TRAIN = [sys.executable, "-m", "experiments.train"]
SHORT = [
    "--config.model.name=mlp",
    "--config.num_epochs=1",
    "--config.baseline=",
    "--config.log_every_steps=2",
    "--config.checkpoint_every_steps=3",
]
WATCHDOG_LINE = re.compile(r"^\[(\d)\] \[process \d\] (stalled|SIGTERM not honoured)", re.M)


def _checkpoint_steps(run_dir):
    folder = run_dir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []
    )


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


@pytest.mark.slow
def test_a_stuck_run_obeys_sigterm_within_its_grace(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TRAIN, *SHORT, "--config.stall_timeout=0", f"--workdir={run_dir}"]
    process, lines, reader = _start_stuck(args, {TEST_STALL_ENV: "0:6"}, "step 6/")
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
    output = "".join(lines)
    assert status == 128 + signal.SIGTERM, output[-4000:]
    assert took < 5.0 + 3.0, took
    assert output.count("SIGTERM not honoured within 5 s") == 1, output[-4000:]
    assert "after step 6 in injected_stall" in output
    assert _checkpoint_steps(run_dir / "fdg_k2")[-1] == 6


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
