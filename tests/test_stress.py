"""The stress check: every multi-process layout trains to the end, and the table says so."""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT, run_command

STRESS = [sys.executable, "-m", "experiments.stress"]


@pytest.mark.slow
def test_every_multi_process_layout_finishes_under_stress():
    status, output = run_command(
        [*STRESS, "--runs=1", "--methods=fdg", "--deadline=150"], timeout=1200, cwd=ROOT
    )
    assert status == 0
    rows = [line for line in output.splitlines() if line.startswith("| ") and " fdg " in line]
    assert len(rows) == 5, output[-3000:]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[2:6] == ["1", "1", "0", "0"], row


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
