"""Sweeps: the grid's errors, the workdir's rule, and a tiny sweep end to end."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT
from processes import descendants, kill_tree, outliving, run_command

from dgrad.train import config as fields
from dgrad.train.sweep import Sweep, SweepError, expand, parse_grid

CONFIG = str(ROOT / "experiments/configs/digits_mlp.py")


@pytest.mark.parametrize(
    "grid, message",
    [
        (
            "method=bp,ddg num_stage=2",
            "num_stage is not a config field; did you mean num_stages\\?",
        ),
        ("num_stages=two", "num_stages=two: expected int"),
        ("", "--grid is empty"),
        ("method", "write field=value1,value2"),
        ("seed=0 seed=1", "names seed twice"),
        ("seed=0,1,0", "seed gives 0 twice"),
        ("model.hidden=32,32", r"gives 32 twice \(a model.hidden of several numbers is written"),
    ],
)
def test_grid_mistakes_say_what_to_do(grid, message):
    with pytest.raises(SweepError, match=message):
        parse_grid(grid)


def test_a_tuple_field_takes_values_of_several_numbers():
    (run,) = expand(fields.base(), parse_grid("model.hidden=32/16"))[0]
    assert run.settings == (("model.hidden", (32, 16)),)
    assert run.name == "model-hidden-32x16" and run.overrides() == ["--config.model.hidden=32,16"]


def test_invalid_combinations_are_skipped_with_the_reason():
    grid = "method=bp,ddg,fdg beta=1,0.5 weights=stash,current memory=residuals,recompute"
    runs, skipped = expand(fields.base(), parse_grid(grid))
    assert len(runs) == 12  # 3 methods x 3 policies with beta 1, fdg's 3 with beta 0.5
    assert len(skipped) == 12 and any("only FDG has" in s for s in skipped)
    assert any("needs memory=recompute" in s for s in skipped)


def test_a_grid_over_methods_and_microbatches_skips_the_methods_that_have_none():
    runs, skipped = expand(fields.base(), parse_grid("method=ddg,gpipe,1f1b microbatches=1,4"))
    assert [r.describe() for r in runs] == [
        "method=ddg microbatches=1",
        "method=gpipe microbatches=1",
        "method=gpipe microbatches=4",
        "method=1f1b microbatches=1",
        "method=1f1b microbatches=4",
    ]
    assert skipped == [
        "method=ddg microbatches=4: method=ddg has no microbatches (only gpipe, 1f1b, zb, "
        "dualpipev, "
        "2bw do); leave microbatches unset, not 4."
    ]


def test_a_grid_over_virtual_stages_skips_what_chunking_refuses():
    """Interleaved 1F1B needs M a multiple of K; ZB-V takes any M; GPipe takes no chunks."""
    config = fields.base()
    config.num_stages = 4
    grid = parse_grid("method=1f1b,zb,gpipe virtual_stages=1,2 microbatches=2,4")
    runs, skipped = expand(config, grid)
    assert [r.describe() for r in runs] == [
        "method=1f1b virtual_stages=1 microbatches=2",
        "method=1f1b virtual_stages=1 microbatches=4",
        "method=1f1b virtual_stages=2 microbatches=4",
        "method=zb virtual_stages=1 microbatches=2",
        "method=zb virtual_stages=1 microbatches=4",
        "method=zb virtual_stages=2 microbatches=2",
        "method=zb virtual_stages=2 microbatches=4",
        "method=gpipe virtual_stages=1 microbatches=2",
        "method=gpipe virtual_stages=1 microbatches=4",
    ]
    assert len(skipped) == 3 and "multiple of 4, not 2" in skipped[0]
    assert all("puts several chunks on each device group" in line for line in skipped[1:])


@pytest.mark.parametrize(
    "grid, message",
    [
        ("method=bp,fdx", "method=fdx fits no combination: Unknown method 'fdx'"),
        ("method=bp,ddg beta=1,0.5", "beta=0.5 fits no combination: .* only FDG has"),
        ("weights=stash,current", "weights=current fits no combination: .* needs memory=recom"),
    ],
)
def test_a_value_that_fits_no_combination_is_refused(grid, message):
    with pytest.raises(SweepError, match=message):
        expand(fields.base(), parse_grid(grid))


def test_a_workdir_holding_another_sweep_is_refused(tmp_path):
    Sweep(CONFIG, parse_grid("num_stages=2,4 seed=0"), tmp_path).claim()
    Sweep(CONFIG, parse_grid("num_stages=2,4 seed=0"), tmp_path).claim()  # the same: resumes
    with pytest.raises(SweepError, match="holds another sweep"):
        Sweep(CONFIG, parse_grid("num_stages=2,8 seed=0"), tmp_path).claim()


@pytest.mark.parametrize("held", ["[1]", '{"config": ', "", '"grid"'])
def test_a_damaged_sweep_file_or_a_file_for_a_workdir_is_one_line(tmp_path, held):
    (tmp_path / "sweep.json").write_text(held)
    with pytest.raises(SweepError, match="sweep.json is damaged, so what this sweep trains"):
        Sweep(CONFIG, parse_grid("seed=0"), tmp_path).claim()
    assert (tmp_path / "sweep.json").read_text() == held
    with pytest.raises(SweepError, match="is a file; give a directory"):
        Sweep(CONFIG, parse_grid("seed=0"), tmp_path / "sweep.json").claim()


@pytest.mark.processes
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


def _sweep_in_training(workdir, stdout):
    """A sweep of one long run, in a session of its own, once its run trains; and the log."""
    command = [
        sys.executable,
        "-m",
        "experiments.sweep",
        f"--config={CONFIG}:smoke",
        "--grid=method=fdg num_stages=2 seed=0",
        f"--workdir={workdir}",
        "--config.num_epochs=200",
        "--config.log_every_steps=5",
    ]
    sweep = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    log = workdir / "logs" / "method-fdg_num_stages-2_seed-0.log"
    deadline = time.monotonic() + 240
    while sweep.poll() is None and time.monotonic() < deadline:
        if log.exists() and " step " in log.read_text():
            break
        time.sleep(0.05)
    return sweep, log


@pytest.mark.slow
def test_ctrl_c_stops_the_runs_with_a_checkpoint_and_the_sweep_resumes(tmp_path):
    """One SIGINT to the sweep reaches each run once: the run saves and stops (not
    'asked twice'), the sweep exits 130, and the same command resumes the run."""
    sweep, log = _sweep_in_training(tmp_path, stdout=subprocess.PIPE)
    sweep.send_signal(signal.SIGINT)
    try:
        output, _ = sweep.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(sweep.pid)
        raise AssertionError(f"the sweep did not stop:\n{sweep.communicate()[0]}") from None
    assert sweep.returncode == 128 + signal.SIGINT, output
    text = log.read_text()
    assert "asked twice" not in text and "Stopped at step " in text, text[-3000:]
    step = text.split("Stopped at step ")[1].split()[0]
    run_dir = next((tmp_path / "runs").iterdir()) / "fdg_k2"
    assert step in [p.name for p in (run_dir / "checkpoints").iterdir()]


@pytest.mark.slow
def test_a_run_stops_with_a_checkpoint_when_its_sweep_dies(tmp_path):
    """SIGKILL to the sweep alone (its run lives in a session of its own): the run is told
    (SIGTERM, `stop_with_parent`), saves the step it is at and exits."""
    sweep, log = _sweep_in_training(tmp_path, stdout=subprocess.DEVNULL)
    runs = descendants(sweep.pid)
    assert runs, "the sweep started no run"
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()
    left = outliving(runs, 120)
    text = log.read_text()
    assert not left, f"the run outlived its sweep by 120 s:\n{text[-3000:]}"
    assert "Stopped at step " in text, text[-3000:]
    step = text.split("Stopped at step ")[1].split()[0]
    run_dir = next((tmp_path / "runs").iterdir()) / "fdg_k2"
    assert step in [p.name for p in (run_dir / "checkpoints").iterdir()]


def test_the_table_holds_finished_runs_and_names_the_others():
    from dgrad.train.sweep import _table

    row = dict(method="fdg", seed=0, epochs=6, finished=True, final_test_accuracy=0.9)
    rows = [row, {**row, "seed": 1, "final_test_accuracy": 0.8}]
    rows.append({**row, "seed": 2, "epochs": 2, "finished": False, "final_test_accuracy": 0.3})
    table, _ = _table(rows, ["method", "seed"])
    assert "| fdg | 85.00 [80.00-90.00] (n=2) |" in table
    assert "unfinished (their last evaluation is in the CSV): method=fdg seed=2 (epoch 2)" in table


def test_the_table_before_any_run_has_finished_and_with_tuple_values():
    from dgrad.train.sweep import _table

    row = dict(
        **{"model.hidden": (64, 64)}, seed=0, epochs=1, finished=False, final_test_accuracy=0.5
    )
    table, groups = _table([row], ["model.hidden", "seed"])
    assert table.splitlines()[:2] == ["| model.hidden | test accuracy % |", "|---|---|"]
    assert "model.hidden=64/64 seed=0 (epoch 1)" in table and groups == {}
    table, _ = _table([{**row, "finished": True}], ["model.hidden", "seed"])
    assert "| 64/64 | 50.00 [50.00-50.00] (n=1) |" in table


def test_a_nan_value_that_fits_nothing_is_refused_not_crashed_on():
    with pytest.raises(SweepError, match="learning_rate=nan fits no combination"):
        expand(fields.base(), parse_grid("optimizer.learning_rate=0.1,nan"))


def test_a_language_models_table_gives_bits_per_byte():
    from dgrad.train.sweep import _table

    row = dict(method="fdg", seed=0, epochs=2, finished=True, final_test_accuracy=0.3)
    rows = [
        {**row, "final_test_bits_per_byte": 2.5},
        {**row, "seed": 1, "final_test_bits_per_byte": 2.25},
    ]
    table, _ = _table(rows, ["method", "seed"])
    assert table.splitlines()[0] == "| method | test bits per byte |"
    assert "| fdg | 2.375 [2.250-2.500] (n=2) |" in table
    assert "Final test bits per byte: median" in table
