"""`python -m experiments.train` as a user runs it: outputs, one-line errors, signals,
and the workdir's rules, each command in a process of its own but the mistakes, which
one process makes in turn (they stop before anything is computed)."""

import json
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT
from processes import kill_tree, run_command

from dgrad.train import metrics

SMOKE = "--config=experiments/configs/default.py:smoke"


def cli(*args, timeout=600, check=False):
    return run_command(
        [sys.executable, "-m", "experiments.train", *args], timeout=timeout, cwd=ROOT, check=check
    )


@pytest.mark.slow
def test_a_language_model_run_ends_with_its_test_bits_per_byte(tmp_path):
    workdir = tmp_path / "run"
    status, output = cli(
        "--config=experiments/configs/lm_stdlib.py:smoke",
        "--config.num_epochs=1",
        f"--workdir={workdir}",
    )
    assert status == 0, output[-3000:]
    summary = output.split("Test loss (bits per byte):")[1].split("Curves:")[0]
    printed = {
        line.rsplit(maxsplit=1)[0].strip(): line.split()[-1]
        for line in summary.splitlines()
        if line.strip()
    }
    for title, run in (("FDG K=2", "fdg_k2"), ("BP (fused)", "bp_fused")):
        (epoch,) = metrics.read(workdir / run / "metrics.jsonl", "epoch")
        assert printed[title] == f"{epoch['test_bits_per_byte']:.4f}"


@pytest.mark.slow
def test_default_smoke_run_learns_digits_and_writes_its_workdir(tmp_path):
    workdir = tmp_path / "run"
    status, output = cli(SMOKE, f"--workdir={workdir}")
    assert status == 0, output[-3000:]
    assert "No accelerator: 2 fake CPU device(s) (1 process(es))." in output
    summary = output.split("Test accuracy:")[1].split("Curves:")[0]
    accuracies = {
        line.rsplit(maxsplit=1)[0].strip(): float(line.split()[-1])
        for line in summary.splitlines()
        if line.strip()
    }
    assert set(accuracies) == {"FDG K=2", "BP (fused)"}
    assert all(a > 0.8 for a in accuracies.values()), accuracies  # chance is 0.1
    assert (workdir / "curves.png").exists()
    assert json.loads((workdir / "workdir.json").read_text())["config"]["method"] == "fdg"
    for run in ("fdg_k2", "bp_fused"):
        epochs = metrics.read(workdir / run / "metrics.jsonl", "epoch")
        assert [r["epoch"] for r in epochs] == [1, 2, 3]
        assert (workdir / run / "model").is_dir()
        assert (workdir / run / "checkpoints" / str(3 * 22)).is_dir()
    assert "step 66/66" in output  # progress lines, since the output is not a terminal
    status, output = run_command(  # -X importtime lists every module imported
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "experiments.train",
            SMOKE,
            f"--workdir={workdir}",
        ],
        timeout=120,
        cwd=ROOT,
    )
    assert status == 0 and "finished earlier: nothing left to train" in output
    imported = {line.rsplit("|", 1)[-1].strip() for line in output.splitlines() if "|" in line}
    assert "jax" in imported and not {"flax", "optax"} & imported  # no model built


@pytest.mark.slow
def test_gpipe_from_the_command_line_trains_fused_backprop_s_numbers(tmp_path):
    """--config.method=gpipe --config.microbatches=4 on the MLP (no BatchNorm) ends where the
    fused BP run beside it does, in the run directory that names its M."""
    workdir = tmp_path / "run"
    status, output = cli(
        SMOKE,
        "--config.model.name=mlp",
        "--config.method=gpipe",
        "--config.microbatches=4",
        "--config.num_epochs=1",
        f"--workdir={workdir}",
    )
    assert status == 0, output[-3000:]
    assert "GPipe K=2 M=4" in output
    (gpipe,) = metrics.read(workdir / "gpipe_k2_m4" / "metrics.jsonl", "epoch")
    (fused,) = metrics.read(workdir / "bp_fused" / "metrics.jsonl", "epoch")
    assert gpipe["test_loss"] == pytest.approx(fused["test_loss"], rel=1e-5)
    assert gpipe["train_loss"] == pytest.approx(fused["train_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config.num_stage=3"],
            "--config.num_stage is not a config field; did you mean --config.num_stages?",
        ),
        (["--config.num_stages=abc"], "--config.num_stages=abc: expected int"),
        (["--config.model.hidden=1,x"], "--config.model.hidden=1,x: expected tuple values"),
        (["--config=nope.py"], "--config nope.py: no such file"),
        ([SMOKE + "k"], "unknown config variant 'smokek'; the only variant is smoke"),
        (["--bogus=1"], "unknown argument --bogus=1"),
        (["--cpu_devices=-1"], "--cpu_devices -1: give 1 or more fake CPU devices"),
        (
            ["--coordinator=localhost:abc", "--num_processes=2", "--process_id=0"],
            "--coordinator localhost:abc: give process 0's address as HOST:PORT",
        ),
        (["--config.steps_per_epoch=100"], "more than the 22 batches of 64"),
        (["--config.method=sgd"], "Unknown method 'sgd'; choose one of: bp, ddg, fdg"),
        (["--config.method=ddg", "--config.beta=0.5"], "only FDG has; use method=fdg or beta=1"),
        (
            ["--config.microbatches=4"],
            "method=fdg has no microbatches (only gpipe, 1f1b, zb, dualpipev, 2bw",
        ),
        (["--config.predict=velocity"], "Unknown predict 'velocity'; choose one of: momentum"),
        pytest.param(
            ["--config.model.name=mlp", "--config.num_stages=9"],
            "cannot be cut into num_stages=9",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--config.method=zb", "--config.virtual_stages=2", "--config.microbatches=2"]
            + ["--config.num_stages=3", "--config.baseline="],
            "Here the 6 are num_stages=3 x virtual_stages=2 chunks",
            marks=pytest.mark.slow,
        ),
        (
            ["--config.method=gpipe", "--config.virtual_stages=2"],
            "use one of those methods with it, or virtual_stages=1 with method=gpipe",
        ),
        (["--config.method=2bw", "--config.weights=current"], "leave weights unset or use"),
    ],
)
def test_a_mistake_gets_one_line_and_status_2(mistakes_made, args, message):
    status, output, workdir = mistakes_made[tuple(args)]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output
    assert not workdir.exists()


@pytest.fixture(scope="module")
def mistakes_made(request, tmp_path_factory):
    """The command's status, output and workdir for each mistake this session tests, all
    made in one process (tests/cli_worker.py calls the command's `main` on each)."""
    chosen = [
        tuple(item.callspec.params["args"])
        for item in request.session.items
        if item.originalname == "test_a_mistake_gets_one_line_and_status_2"
    ]
    base = tmp_path_factory.mktemp("mistakes")
    workdirs = [base / str(i) / "run" for i in range(len(chosen))]
    cases = [[*args, f"--workdir={workdir}"] for args, workdir in zip(chosen, workdirs)]
    (base / "cases.json").write_text(json.dumps(cases))
    run_command(
        [sys.executable, str(ROOT / "tests/cli_worker.py"), base / "cases.json", base / "out.json"],
        timeout=300,
        cwd=ROOT,
    )
    results = json.loads((base / "out.json").read_text())
    return {
        args: (result["status"], result["output"], workdir)
        for args, result, workdir in zip(chosen, results, workdirs)
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "arguments, prepare, instead",
    [
        (["--config=experiments/configs/cifar10_resnet56.py:smoke"], "cifar10", "synthetic"),
        (
            [
                "--config=experiments/configs/lm_stdlib.py:smoke",
                "--config.dataset=tiny_shakespeare",
            ],
            "tiny_shakespeare",
            "stdlib",
        ),
    ],
)
def test_an_unprepared_dataset_says_how_to_prepare_it(tmp_path, arguments, prepare, instead):
    status, output = cli(
        *arguments,
        f"--config.data_dir={tmp_path}",
        f"--workdir={tmp_path / 'run'}",
        timeout=120,
    )
    assert status == 2 and "Traceback" not in output and "WARNING" not in output, output
    (error,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert f"tfds build {prepare} --file_format=array_record" in error
    assert f"--config.dataset={instead}" in error


def test_help_lists_every_field_and_exits_0():
    status, output = cli("--help", timeout=60)
    assert status == 0
    assert "--config.num_stages" in output and "--config.optimizer.learning_rate" in output
    assert "FDG gradient shrinking" in output  # the meaning comes from where the field is set


def _train_until(workdir, predicate, args, timeout=300):
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *args, f"--workdir={workdir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while not predicate() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process


@pytest.mark.parametrize(
    "moment",
    [
        "starting",
        pytest.param("compiling", marks=pytest.mark.slow),
        pytest.param("training", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_at_any_moment_stops_cleanly(tmp_path, moment):
    workdir = tmp_path / "run"
    args = [SMOKE, "--config.model.name=mlp", "--config.baseline=", "--config.log_every_steps=5"]
    seen = {
        "starting": lambda: True,
        "compiling": lambda: (workdir / "workdir.json").exists(),
        "training": lambda: bool(metrics.read(workdir / "fdg_k2" / "metrics.jsonl", "train")),
    }[moment]
    process = _train_until(workdir, seen, args)
    if moment == "starting":
        time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        output, _ = process.communicate()
        raise AssertionError(f"no exit 120 s after SIGINT ({moment}):\n{output[-4000:]}") from None
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output and "Fatal" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith("Stopped"), output[-2000:]
    if moment == "training":
        stopped_at = int(last.split("Stopped at step ")[1].split()[0])
        assert str(stopped_at) in [p.name for p in (workdir / "fdg_k2" / "checkpoints").iterdir()]
        status, output = cli(*args, f"--workdir={workdir}")
        assert status == 0 and f"resumed from the checkpoint at step {stopped_at} " in output
        steps = [r["step"] for r in metrics.read(workdir / "fdg_k2" / "metrics.jsonl", "train")]
        assert steps == sorted(set(steps))  # no step written twice
    elif not (workdir / "fdg_k2" / "checkpoints").exists():
        assert not workdir.exists()  # stopped before any checkpoint: nothing left behind


@pytest.mark.slow
def test_a_workdir_of_another_experiment_is_refused(tmp_path):
    state = {"config": {"method": "ddg"}, "corpus": None, "finished_epochs": None}
    (tmp_path / "workdir.json").write_text(json.dumps(state))
    status, output = cli(SMOKE, f"--workdir={tmp_path}", timeout=120)
    assert status == 2 and "holds another experiment" in output and "Traceback" not in output
    assert json.loads((tmp_path / "workdir.json").read_text()) == state


@pytest.mark.slow
def test_a_run_whose_checkpoints_all_fail_to_restore_is_one_line_and_status_2(tmp_path):
    """Damaged checkpoints: each resume is one line, a resume with none left status 2."""
    from damage import damage, snapshot, unfinish

    small = ["--config.model.name=mlp", "--config.baseline=", "--config.num_epochs=1"]
    small += ["--config.steps_per_epoch=6", "--config.checkpoint_every_steps=4"]
    status, output = cli(SMOKE, *small, f"--workdir={tmp_path}", timeout=300)
    assert status == 0, output
    unfinish(tmp_path)  # as if killed before its end: it resumes
    checkpoints = tmp_path / "fdg_k2" / "checkpoints"
    damage(checkpoints / "6", "truncated data")
    damage(checkpoints / "4", "deleted data")
    before = snapshot(tmp_path / "fdg_k2")
    status, output = cli(SMOKE, *small, f"--workdir={tmp_path}", timeout=300)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1, output
    assert f"No checkpoint in {checkpoints} restores (step 6: OUT_OF_RANGE" in errors[0]
    assert "Traceback" not in output and snapshot(tmp_path / "fdg_k2") == before
