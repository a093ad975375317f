"""dgrad.train.distributed: several processes under jax.distributed (gloo), 2 processes x 2 fake
devices in the two layouts: every process holding every stage, and stage k on process k.
They give the numbers of one process, move checkpoints between process counts, go down
together when one dies, and stop on the same step.

The placement's rules are in test_placement, each process's rows of the batch in
test_data, and the numbers of K stages x D replicas in one process in test_pipeline
and test_invariants.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from helpers import ROOT, SMOOTH_OPTIMIZER, assert_close, batches, build_pipeline
from processes import kill_tree, run_command

from dgrad.train import metrics
from dgrad.train.checkpoint import Checkpointer
from dgrad.train.supervisor import launch_local

pytestmark = pytest.mark.processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
STEPS, SAVE_AT = 8, 4


def single_process_run(tmp_path, save=False, restore=False):
    """The same run in this process: K=2 x D=2 on the 4 local devices."""
    pipe = build_pipeline(
        "cnn",
        2,
        method="fdg",
        optimizer=SMOOTH_OPTIMIZER,
        devices=jax.devices(),
        data_parallel=2,
        record_sources=True,  # as the worker: its checkpoints hold records as their sources
    )
    stream = batches("cnn", STEPS)
    state = pipe.init(stream[0])
    if restore:
        with Checkpointer(tmp_path / "checkpoints") as checkpoints:
            state, _ = checkpoints.restore(pipe)
    losses = []
    for t in range(state.step, STEPS):
        state, metrics = pipe.step(state, stream[t])
        losses.append(float(metrics["loss"]) if metrics else np.nan)
        if save and state.step == SAVE_AT:
            with Checkpointer(tmp_path / "checkpoints") as checkpoints:
                checkpoints.save(state)
    return np.array(losses), jax.device_get(
        ([s.params for s in state.stages], [s.rest for s in state.stages])
    )


def two_processes(tmp_path, layout, **flags):
    out = tmp_path / f"out-{layout}.npz"
    command = [sys.executable, WORKER, f"--layout={layout}", f"--out={out}", f"--steps={STEPS}"]
    command += [f"--{name}={value}" for name, value in flags.items()]
    log = _Log()
    status = launch_local(command, 2, cpu_devices=2, timeout=240, out=log)
    assert status == 0, f"the worker processes failed ({status}):\n{log.text[-6000:]}"
    saved = np.load(out)
    leaves = [saved[f"leaf{i}"] for i in range(len(saved.files) - 1)]
    return saved["losses"], leaves, log.text


class _Log:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["a", "b"])
def test_two_processes_give_the_numbers_of_one(tmp_path, layout):
    losses, leaves, log = two_processes(tmp_path, layout)
    groups = {"a": "[[0, 1], [0, 1]]", "b": "[[0], [1]]"}[layout]
    assert f"stage groups by process: {groups}" in log
    expected_losses, expected = single_process_run(tmp_path)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_close(leaves, jax.tree.leaves(expected))


@pytest.mark.slow
def test_checkpoints_move_between_process_counts(tmp_path):
    """Saved by 2 processes (stage k on process k), resumed by one; and the reverse."""
    _, leaves_two, _ = two_processes(tmp_path, "b", save_dir=tmp_path / "from-two", save_at=SAVE_AT)
    os.rename(tmp_path / "from-two", tmp_path / "checkpoints")
    _, resumed_here = single_process_run(tmp_path, restore=True)
    assert_close(jax.tree.leaves(resumed_here), leaves_two)

    os.rename(tmp_path / "checkpoints", tmp_path / "old")
    _, uninterrupted = single_process_run(tmp_path, save=True)
    _, resumed_there, _ = two_processes(tmp_path, "b", restore_dir=tmp_path / "checkpoints")
    assert_close(resumed_there, jax.tree.leaves(uninterrupted))


@pytest.mark.slow
def test_a_process_that_dies_takes_the_others_down(tmp_path):
    log = _Log()
    command = [sys.executable, WORKER, "--layout=c", f"--out={tmp_path / 'x.npz'}", "--steps=3"]
    status = launch_local(command, 2, cpu_devices=2, timeout=120, out=log)
    assert status != 0
    assert "exited with status" in log.text or "KeyError" in log.text


LAUNCH = [sys.executable, "-m", "experiments.launch", "--processes=2", "--cpu_devices=2", "--"]
TRAIN = [sys.executable, "-m", "experiments.train"]
TINY = [
    "--config=experiments/configs/default.py:smoke",  # FDG K=2 and the fused BP baseline
    "--config.model.name=mlp",
    "--config.steps_per_epoch=6",
    "--config.log_every_steps=3",
]
TWO = ["--config.data_parallel=2", "--config.placement=interleaved"]  # the README's layout


def _epochs(workdir):
    return {
        label: [
            [r[k] for k in ("train_loss", "test_loss", "test_accuracy")]
            for r in metrics.read(workdir / label / "metrics.jsonl", "epoch")
        ]
        for label in ("bp_fused", "fdg_k2")
    }


@pytest.mark.slow
def test_the_command_line_on_two_processes(tmp_path):
    """The README's command: both processes train (the fused BP baseline data parallel
    across them); process 0 alone writes the metrics; a run moves from 2 processes (D = 2)
    to 1 (D = 1) and from 1 to 2 with the same numbers (within float tolerance)."""
    there, back = tmp_path / "there", tmp_path / "back"
    _, output = run_command(
        LAUNCH + TINY + TWO + ["--config.num_epochs=1", f"--workdir={there}"], 300, cwd=ROOT
    )
    assert "[0] [process 0] fdg_k2 step 6/6" in output, output[-3000:]
    assert "[1] [process 1] fdg_k2 step 6/6" in output, output[-3000:]
    assert "[1] [process 1] bp_fused step 6/6" in output, output[-3000:]
    _, output = run_command(
        TRAIN + TINY + ["--config.num_epochs=2", "--extend", f"--workdir={there}"], 300, cwd=ROOT
    )
    assert "resumed from the checkpoint at step 6" in output
    run_command(TRAIN + TINY + ["--config.num_epochs=1", f"--workdir={back}"], 300, cwd=ROOT)
    run_command(
        LAUNCH + TINY + TWO + ["--config.num_epochs=2", "--extend", f"--workdir={back}"],
        300,
        cwd=ROOT,
    )
    there_epochs, back_epochs = _epochs(there), _epochs(back)
    assert [len(e) for e in there_epochs.values()] == [2, 2]
    for label in there_epochs:
        np.testing.assert_allclose(there_epochs[label], back_epochs[label], rtol=1e-4)


@pytest.mark.slow
def test_a_workdir_refused_on_two_processes_is_one_line_from_each(tmp_path):
    """Process 0 alone takes the workdir's lock; when it cannot, every process says so in
    one line and exits 2 (the others do not wait in a barrier for one that left)."""
    from dgrad.train import workdir

    with workdir.hold(tmp_path / "run"):  # another command trains there
        status, output = run_command(
            LAUNCH + TINY + TWO + [f"--workdir={tmp_path / 'run'}"], 300, cwd=ROOT, check=False
        )
    errors = [line for line in output.splitlines() if "error:" in line]
    assert status == 2 and len(errors) == 2, output[-3000:]
    assert all("another command is training in" in line for line in errors), errors
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.slow
def test_a_stop_on_two_processes_saves_the_same_step_on_both(tmp_path):
    """SIGTERM to the launcher: it reaches each process once, they agree on the step to
    stop at, save it and exit 143; the run resumes from that step."""
    workdir = tmp_path / "run"
    args = TINY + TWO + ["--config.baseline=", "--config.num_epochs=40", f"--workdir={workdir}"]
    launcher = subprocess.Popen(
        LAUNCH + args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while launcher.poll() is None and time.monotonic() < deadline:
        if any("[process 1] fdg_k2 step" in line for line in lines):
            break
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=180)
    except subprocess.TimeoutExpired:
        kill_tree(launcher.pid)
        reader.join(timeout=10)
        raise AssertionError("the launcher did not stop:\n" + "".join(lines)[-4000:]) from None
    reader.join(timeout=30)
    output = "".join(lines)
    assert launcher.returncode == 128 + signal.SIGTERM, output[-4000:]
    stopped = sorted(set(re.findall(r"\[(\d)\] Stopped at step (\d+)", output)))
    assert len(stopped) == 2 and stopped[0][1] == stopped[1][1], output[-4000:]
    step = stopped[0][1]
    assert "Traceback" not in output
    _, output = run_command(
        TRAIN + TINY + ["--config.baseline=", "--config.num_epochs=40", f"--workdir={workdir}"],
        timeout=600,
        cwd=ROOT,
    )
    assert f"resumed from the checkpoint at step {step} " in output


@pytest.mark.slow
def test_every_process_of_the_tests_writes_the_compilation_cache():
    """The children of the tests load startup/sitecustomize.py: without it, processes after
    the first compile every program again in every multi-process test (JAX writes its cache
    from process 0 only, and a CPU program's key names its devices)."""
    probe = "import jax._src.compiler as c; print(c._cache_write.__qualname__)"
    written = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert written.stdout.strip() == "_write_from_every_process.<locals>.cache_write", written
    bare = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=bare)
    assert plain.stdout.strip() == "_cache_write", plain  # the control: JAX's own
