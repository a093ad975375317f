"""Training experiments from `ml_collections` configs (`train`, in `experiment`).

The modules: `experiment` (what `python -m experiments.train` runs: one
experiment's runs, start to end), `config` (the fields and their rules, overrides,
config files, the papers' recipes), `build` (config to pipeline), `loop` (one run's steps),
`evaluate`, `workdir`, `checkpoint`, `export`, `metrics`, `progress`,
`signals`, `watchdog`, `distributed` (joining processes), `supervisor` (starting
them), `sweep` and `cli` (the command line).
"""

from __future__ import annotations

import importlib

from dgrad.train.experiment import SetupError, train
from dgrad.train.signals import Stopped, StopRequests
from dgrad.train.workdir import WorkdirError

__all__ = ["SetupError", "Stopped", "StopRequests", "WorkdirError", "train"]


def __getattr__(name: str):  # the modules that import JAX, on first use
    if name in ("build", "checkpoint", "evaluate", "export", "loop"):
        return importlib.import_module(f"dgrad.train.{name}")
    raise AttributeError(f"module 'dgrad.train' has no attribute {name!r}")
