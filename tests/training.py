"""What the training tests share: a config cut to seconds, reading a run's records, and
asking a run to stop at a given step."""

import glob
import os
import signal

from helpers import ROOT

import dgrad
from dgrad.train import metrics
from dgrad.train.cli import load_config

PAPER_CONFIGS = sorted(glob.glob(str(ROOT / "experiments/configs/cifar*.py")))


def quiet(text):
    pass


def small_config(**overrides):
    """The default config cut to a few seconds: an MLP, one run, 2 short epochs."""
    config, _ = load_config(str(ROOT / "experiments/configs/default.py:smoke"))
    config.model.name = "mlp"
    config.baseline = ""
    config.num_epochs = 2
    config.steps_per_epoch = 8
    config.log_every_steps = 3
    config.checkpoint_every_steps = 5
    config.update(overrides)
    return config


def records(workdir, run):
    """A run's records without what the clock measured."""
    return [metrics.without_clock(r) for r in metrics.read(workdir / run / "metrics.jsonl")]


def stop_at_call(monkeypatch, call):
    """Makes the `call`-th `Pipeline.step` ask the run to stop (as SIGTERM would)."""
    original, calls = dgrad.Pipeline.step, [0]

    def step(self, state, batch):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, state, batch)

    monkeypatch.setattr(dgrad.Pipeline, "step", step)
    return lambda: monkeypatch.setattr(dgrad.Pipeline, "step", original)
