"""A damaged newest checkpoint on two processes (2 fake devices each): both fall back to
the same older checkpoint, as one process does (tests/test_train.py)."""

import sys

import pytest
from damage import damage, unfinish
from helpers import ROOT
from processes import run_command

from dgrad.train import metrics

pytestmark = pytest.mark.processes

LAUNCH = [sys.executable, "-m", "experiments.launch", "--processes=2", "--cpu_devices=2", "--"]
TINY = [
    "--config=experiments/configs/default.py:smoke",
    "--config.model.name=mlp",
    "--config.baseline=",
    "--config.num_epochs=1",
    "--config.steps_per_epoch=6",
    "--config.checkpoint_every_steps=4",
    "--config.data_parallel=2",
    "--config.placement=interleaved",
]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated data", "corrupt meta"])
def test_both_processes_resume_from_the_same_older_checkpoint(tmp_path, how):
    workdir = tmp_path / "run"
    run_command(LAUNCH + TINY + [f"--workdir={workdir}"], 300, cwd=ROOT)
    expected = train_records(workdir)
    unfinish(workdir)  # as if killed before its end: the run resumes
    checkpoints = workdir / "fdg_k2" / "checkpoints"
    damage(checkpoints / "6", how)
    _, output = run_command(LAUNCH + TINY + [f"--workdir={workdir}"], 300, cwd=ROOT)
    assert f"The checkpoint at step 6 in {checkpoints} does not restore" in output, output[-3000:]
    assert "resumed from the checkpoint at step 4 (epoch 1, 4 of 6 batches done)" in output
    assert "[0] [process 0] fdg_k2 step 6/6" in output, output[-3000:]
    assert "[1] [process 1] fdg_k2 step 6/6" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["4", "6", "damaged"]
    assert train_records(workdir) == expected


def train_records(workdir):
    records = metrics.read(workdir / "fdg_k2" / "metrics.jsonl", "train")
    return [metrics.without_clock(r) for r in records]
