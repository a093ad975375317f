"""The stress check: every multi-process layout trains to the end, and the table says so."""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT
from processes import run_command

from dgrad.measure.stress import LAYOUTS

pytestmark = pytest.mark.processes

STRESS = [sys.executable, "-m", "experiments.stress"]


def _finishes_one_run(layout, deadline, *flags):
    """One stress run of fdg on `layout` (with `flags`): its table row says one run, finished,
    none frozen or failed, and the command exits 0."""
    status, output = run_command(
        [
            *STRESS,
            "--runs=1",
            "--methods=fdg",
            f"--deadline={deadline}",
            f"--layouts={layout}",
            *flags,
        ],
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    rows = [line for line in output.splitlines() if line.startswith(f"| {layout} | fdg ")]
    assert len(rows) == 1, output[-3000:]
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells[2:6] == ["1", "1", "0", "0"], output[-3000:]
    assert status == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", [layout.name for layout in LAYOUTS])
def test_a_multi_process_layout_finishes_under_stress(layout):
    _finishes_one_run(layout, 150)


@pytest.mark.slow
def test_a_language_model_finishes_under_stress_on_two_processes():
    _finishes_one_run("2x1", 200, "--config=experiments/configs/lm_stdlib.py:smoke")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--layouts=3x3"], "error: --layouts: unknown ['3x3']; choose from 2x2 spread, "),
        (["--runs=0"], "error: --runs must be at least 1 (--help lists the flags)"),
        (["--deadline=-1"], "error: --deadline must be a positive number of seconds"),
    ],
)
def test_stress_flags_that_cannot_work_are_one_line(flags, message):
    status, output = run_command([*STRESS, *flags], timeout=60, cwd=ROOT, check=False)
    assert status == 2
    assert output.strip().count("\n") == 0 and output.startswith(message), output


@pytest.mark.slow
def test_a_signal_stops_the_whole_stress_with_the_table_so_far():
    """SIGTERM reaches the run in progress (launch_local forwards it) and then the stress
    itself: it prints what it has and exits 143 instead of going on to the next run."""
    import os
    import signal
    import subprocess
    import time

    from processes import descendants, kill_tree, outliving

    process = subprocess.Popen(
        [*STRESS, "--runs=3", "--methods=fdg", "--layouts=2x1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(descendants(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # until the first run's processes have started
        started = descendants(process.pid)
        time.sleep(2)
        os.kill(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    except BaseException:
        kill_tree(process.pid)
        raise
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "Stopped by a signal" in output and "| layout | method |" in output, output[-3000:]
    assert outliving(started, 15) == []
