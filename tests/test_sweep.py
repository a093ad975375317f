"""Sweeps: the grid's errors, the workdir's rule, and a tiny sweep end to end."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, run_command

from dgrad.train import config as fields
from dgrad.train.sweep import Sweep, SweepError, expand, parse_grid

CONFIG = str(ROOT / "experiments/configs/digits_mlp.py")


@pytest.mark.parametrize(
    "grid, message",
    [
        (
            "method=bp,ddg num_stage=2",
            "num_stage is not a config field; did you mean --config.num_stages",
        ),
        ("num_stages=two", "num_stages=two: expected int"),
        ("", "--grid is empty"),
        ("method", "write field=value1,value2"),
        ("seed=0 seed=1", "names seed twice"),
    ],
)
def test_grid_mistakes_say_what_to_do(grid, message):
    with pytest.raises(SweepError, match=message):
        parse_grid(grid)


def test_invalid_combinations_are_skipped_with_the_reason():
    runs, skipped = expand(
        fields.base(), parse_grid("method=bp,ddg,fdg beta=1,0.5 weights=stash,current")
    )
    assert len(runs) == 4  # bp/ddg/fdg with beta 1 and stash, fdg beta 0.5 stash
    assert len(skipped) == 8 and any("only FDG has" in s for s in skipped)
    assert any("needs memory=recompute" in s for s in skipped)


def test_a_workdir_holding_another_sweep_is_refused(tmp_path):
    Sweep(CONFIG, parse_grid("num_stages=2,4 seed=0"), tmp_path).claim()
    Sweep(CONFIG, parse_grid("num_stages=2,4 seed=0"), tmp_path).claim()  # the same: resumes
    with pytest.raises(SweepError, match="holds another sweep"):
        Sweep(CONFIG, parse_grid("num_stages=2,8 seed=0"), tmp_path).claim()


@pytest.mark.slow
def test_a_tiny_sweep_runs_resumes_and_tabulates(tmp_path):
    command = [
        sys.executable,
        "-m",
        "experiments.sweep",
        f"--config={CONFIG}:smoke",
        "--grid=method=bp,fdg num_stages=2 beta=1,0.5 seed=0,1",
        f"--workdir={tmp_path}",
        "--config.num_epochs=1",
        "--config.steps_per_epoch=4",
        "--parallel=2",
    ]
    _, output = run_command(command, timeout=900, cwd=ROOT)
    assert "skipped  method=bp num_stages=2 beta=0.5" in output
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 6 and {r["method"] for r in rows} == {"bp", "fdg"}
    table = (tmp_path / "results.md").read_text()
    assert "| method | beta | K=2 |" in table and "(n=2)" in table
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    _, again = run_command(command, timeout=900, cwd=ROOT)  # nothing is trained twice
    logs = "".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert logs.count("finished earlier: nothing left to train") == 6
    assert again.count("finished ") == 6


@pytest.mark.slow
def test_ctrl_c_stops_the_runs_with_a_checkpoint_and_the_sweep_resumes(tmp_path):
    """One SIGINT to the sweep reaches each run once: the run saves and stops (not
    'asked twice'), the sweep exits 130, and the same command resumes the run."""
    command = [
        sys.executable,
        "-m",
        "experiments.sweep",
        f"--config={CONFIG}:smoke",
        "--grid=method=fdg num_stages=2 seed=0",
        f"--workdir={tmp_path}",
        "--config.num_epochs=200",
        "--config.log_every_steps=5",
    ]
    sweep = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    log = tmp_path / "logs" / "method-fdg_num_stages-2_seed-0.log"
    deadline = time.monotonic() + 240
    while sweep.poll() is None and time.monotonic() < deadline:
        if log.exists() and " step " in log.read_text():
            break
        time.sleep(0.05)
    sweep.send_signal(signal.SIGINT)
    try:
        output, _ = sweep.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(sweep.pid, signal.SIGKILL)
        raise AssertionError(f"the sweep did not stop:\n{sweep.communicate()[0]}") from None
    assert sweep.returncode == 128 + signal.SIGINT, output
    text = log.read_text()
    assert "asked twice" not in text and "Stopped at step " in text, text[-3000:]
    step = text.split("Stopped at step ")[1].split()[0]
    run_dir = next((tmp_path / "runs").iterdir()) / "fdg_k2"
    assert step in [p.name for p in (run_dir / "checkpoints").iterdir()]
