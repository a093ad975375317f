"""The workdir's rules (dgrad.train.workdir): one command at a time, a workdir of another
experiment refused before anything is written, starting, stopping and extending."""

import json
import os
import signal
import sys

import pytest
from damage import damage
from helpers import ROOT
from processes import run_command
from training import quiet, small_config, stop_at_call

from dgrad.train import SetupError, Stopped, StopRequests, build, metrics, train, workdir
from dgrad.train.cli import load_config


@pytest.mark.slow
def test_looking_at_a_workdir_imports_no_model_library():
    """A finished run's command reads its checkpoints' metadata and stops: the modules it
    imports for that (workdir, checkpoint) must not pull in flax or optax, whose import
    is most of its time. The full check, through the CLI, is in the slow set."""
    status, output = run_command(
        [
            sys.executable,
            "-c",
            "import sys; import dgrad.train.workdir, dgrad.train.checkpoint; "
            "print(sorted({'flax', 'optax'} & set(sys.modules)))",
        ],
        timeout=120,
        cwd=ROOT,
    )
    assert output.strip().splitlines()[-1] == "[]", output


@pytest.mark.slow
def test_a_second_command_in_a_workdir_being_trained_is_refused(tmp_path, monkeypatch):
    from dgrad.train import experiment, workdir

    train(small_config(num_epochs=1), tmp_path / "run", log=quiet)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    with monkeypatch.context() as patched:  # refused before it builds (and compiles) anything
        patched.setattr(experiment, "_build_runs", lambda *a, **k: pytest.fail("built"))
        for path in (tmp_path / "run", tmp_path / "new"):
            with workdir.hold(path):  # as a command training there does
                with pytest.raises(SetupError, match="another command is training in"):
                    train(small_config(num_epochs=2), path, extend=path.name == "run", log=quiet)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before
    assert os.listdir(tmp_path / "new") == [".lock"]
    train(small_config(num_epochs=1), tmp_path / "new", log=quiet)  # the lock is gone
    assert (tmp_path / "new" / "fdg_k2" / "model").is_dir()


def test_a_workdir_started_with_more_steps_per_epoch_than_batches_resumes(tmp_path, monkeypatch):
    """Earlier versions cut such a steps_per_epoch silently; new runs are refused it."""
    config = small_config(steps_per_epoch=100, num_epochs=1)  # the digits hold 22 batches
    stop_at_call(monkeypatch, 13)
    monkeypatch.setattr(build, "steps_per_epoch", lambda config, dataset, cut=False: 22)
    with pytest.raises(Stopped):
        train(config, tmp_path, log=quiet)
    monkeypatch.undo()
    lines = []
    train(config, tmp_path, log=lines.append)
    assert any("this workdir trains 22 per epoch, as it was started" in line for line in lines)
    assert [r["step"] for r in metrics.read(tmp_path / "fdg_k2/metrics.jsonl", "epoch")] == [22]


def test_a_workdir_another_command_started_meanwhile_is_decided_again(tmp_path, monkeypatch):
    """Between the first look at the workdir and taking its lock another command may have
    started an experiment there: the config it wrote is not overwritten."""
    from dgrad.train import workdir

    other = small_config(seed=7)
    original = workdir.hold

    def hold_after_another(path):
        workdir.create(workdir.inspect(path, other), other)  # the other command, first
        return original(path)

    monkeypatch.setattr(workdir, "hold", hold_after_another)
    with pytest.raises(SetupError, match="holds another experiment .*seed 7 -> 0"):
        train(small_config(), tmp_path / "run", log=quiet)
    assert json.loads((tmp_path / "run" / "workdir.json").read_text())["config"]["seed"] == 7


def test_a_stop_before_training_leaves_nothing_behind(tmp_path):
    stop = StopRequests()
    stop.request(signal.SIGTERM)
    with pytest.raises(Stopped, match="before training"):
        train(small_config(), tmp_path / "new", log=quiet, stop=stop)
    assert not (tmp_path / "new").exists()


def test_a_workdir_that_cannot_be_written_is_one_line():
    with pytest.raises(SetupError, match="cannot write in --workdir /proc/dgrad-run"):
        train(small_config(), "/proc/dgrad-run", log=quiet)


def test_a_failed_start_leaves_no_directory(tmp_path):
    with pytest.raises(SetupError, match="cannot be cut into num_stages=9"):
        train(small_config(num_stages=9), tmp_path / "new", log=quiet)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SetupError):
        train(small_config(num_stages=9), tmp_path / "empty", log=quiet)
    assert os.listdir(tmp_path / "empty") == []


def test_a_workdir_of_another_experiment_is_refused_before_anything_is_written(tmp_path):
    train(small_config(num_epochs=1), tmp_path, log=quiet)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for changed in (small_config(num_epochs=1, beta=0.5), small_config(num_epochs=1, seed=3)):
        with pytest.raises(SetupError, match="holds another experiment"):
            train(changed, tmp_path, log=quiet)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    with pytest.raises(SetupError, match="add --extend"):
        train(small_config(num_epochs=2), tmp_path, log=quiet)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SetupError, match="not a dgrad workdir"):
        train(small_config(), tmp_path / "other", log=quiet)
    # Fields that only change how the run is watched may differ.
    train(small_config(num_epochs=1, log_every_steps=4, placement="one_per_device"), tmp_path)


@pytest.mark.parametrize(
    "held",
    [
        '{"config": {}, ',
        "",
        "[1, 2]",
        '{"config": {}}',
        '{"config": 1, "corpus": null, "finished_epochs": null}',
        b"\xff\xfe",
    ],
)
def test_a_damaged_workdir_json_is_one_line_and_left_as_it_is(tmp_path, held):
    path = tmp_path / workdir.STATE_FILE
    path.write_bytes(held if isinstance(held, bytes) else held.encode())
    with pytest.raises(SetupError, match=r"workdir.json is damaged \(.*\), so what this workdir"):
        train(small_config(num_epochs=1), tmp_path, log=quiet)
    assert sorted(os.listdir(tmp_path)) == [workdir.STATE_FILE]
    assert path.read_bytes() == (held if isinstance(held, bytes) else held.encode())


def test_a_workdir_trained_on_another_corpus_is_refused(tmp_path):
    """The offline corpus is this interpreter's standard library: the same config read on
    another Python is another corpus, which `workdir.json` records and a resume checks."""
    config, _ = load_config(str(ROOT / "experiments/configs/lm_stdlib.py:smoke"))
    elsewhere = {**build.load_dataset(config).fingerprint, "python": "3.0.1", "sha256": "0ff1ce"}
    workdir.create(workdir.inspect(tmp_path, config), config, elsewhere)
    before = (tmp_path / "workdir.json").read_text()
    with pytest.raises(SetupError, match=r"another corpus \(python 3.0.1 -> 3.*, sha256 0ff1ce"):
        train(config, tmp_path, log=quiet)
    assert (tmp_path / "workdir.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "workdir.json"]


@pytest.mark.slow
def test_extending_a_finished_run_says_what_it_does_to_the_schedule(tmp_path):
    config = small_config(num_epochs=1)
    train(config, tmp_path / "short", log=quiet)
    lines = []
    longer = small_config(num_epochs=2)
    train(longer, tmp_path / "short", extend=True, log=lines.append)
    note = next(line for line in lines if line.startswith("Extending"))
    assert "from 1 to 2 epochs" in note and "cosine" in note and "at step 8 the rate was" in note
    assert [r["epoch"] for r in metrics.read(tmp_path / "short/fdg_k2/metrics.jsonl", "epoch")] == [
        1,
        2,
    ]
    assert (
        json.loads((tmp_path / "short" / "workdir.json").read_text())["config"]["num_epochs"] == 2
    )
    with pytest.raises(SetupError, match="above the 2"):
        train(small_config(num_epochs=1), tmp_path / "short", extend=True, log=quiet)


@pytest.mark.slow
def test_an_unfinished_run_is_finished_before_it_is_extended(tmp_path, monkeypatch):
    """--extend lays the schedule out anew from where the run ended: of a run stopped at
    step 5 of 8 that would change steps 5-8 as well, so it is refused, untouched."""
    undo = stop_at_call(monkeypatch, 5)
    with pytest.raises(Stopped):
        train(small_config(num_epochs=1), tmp_path, log=quiet)
    undo()
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(SetupError, match="has not finished its 1 epochs; finish it first"):
        train(small_config(num_epochs=2), tmp_path, extend=True, log=quiet)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    train(small_config(num_epochs=1), tmp_path, log=quiet)  # finished, then extended
    train(small_config(num_epochs=2), tmp_path, extend=True, log=quiet)
    epochs = metrics.read(tmp_path / "fdg_k2" / "metrics.jsonl", "epoch")
    assert [r["epoch"] for r in epochs] == [1, 2]


@pytest.mark.slow
def test_an_extension_that_was_stopped_resumes(tmp_path):
    train(small_config(num_epochs=1), tmp_path, log=quiet)
    stop = StopRequests()
    with pytest.raises(Stopped) as stopped:  # asked to stop as soon as the extension starts
        train(
            small_config(num_epochs=3),
            tmp_path,
            extend=True,
            stop=stop,
            log=lambda _: stop.request(),
        )
    assert stopped.value.checkpoint_step == 9
    train(small_config(num_epochs=3), tmp_path, extend=True, log=quiet)  # the same command
    epochs = metrics.read(tmp_path / "fdg_k2" / "metrics.jsonl", "epoch")
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    train(small_config(num_epochs=3), tmp_path, log=quiet)  # and without --extend: finished


@pytest.mark.slow
def test_an_extension_that_trains_nothing_leaves_the_experiment_as_it_was(tmp_path):
    """An extension whose resume fails (every checkpoint damaged) puts workdir.json back, so
    that the experiment is still the finished one of its epochs; one killed before it
    saved anything is not taken for finished either."""
    train(small_config(num_epochs=1), tmp_path, log=quiet)
    saved = (tmp_path / "workdir.json").read_text()
    for checkpoint in (tmp_path / "fdg_k2" / "checkpoints").iterdir():
        damage(checkpoint, "truncated data")
    with pytest.raises(SetupError, match="No checkpoint in .* restores"):
        train(small_config(num_epochs=2), tmp_path, extend=True, log=quiet)
    assert (tmp_path / "workdir.json").read_text() == saved

    written = json.loads(saved)  # as if killed after writing the extension's workdir.json
    written["config"]["num_epochs"] = 2
    (tmp_path / "workdir.json").write_text(json.dumps(written))
    lines = []
    with pytest.raises(SetupError, match="No checkpoint in .* restores"):
        train(small_config(num_epochs=2), tmp_path, log=lines.append)
    assert not any("finished earlier" in line for line in lines)


def test_a_run_whose_checkpoints_are_of_the_format_before_is_refused_and_left_as_it_was(
    tmp_path, monkeypatch
):
    """A stopped run whose checkpoints are of format 1 (their meta names none) is not
    resumed: one line names the format and what to do, and nothing in the workdir changes."""
    undo = stop_at_call(monkeypatch, 7)
    with pytest.raises(Stopped):
        train(small_config(num_epochs=1), tmp_path, log=quiet)
    undo()
    for meta in tmp_path.glob("*/checkpoints/*/meta/metadata"):
        written = json.loads(meta.read_text())
        meta.write_text(
            json.dumps({k: v for k, v in written.items() if k not in ("format", "dgrad")})
        )

    def snapshot():
        return {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = snapshot()
    with pytest.raises(SetupError, match=r"is of format 1 \(written by dgrad 0.2.0 or before\)"):
        train(small_config(num_epochs=1), tmp_path, log=quiet)
    assert snapshot() == before
