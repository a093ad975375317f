"""The runs an experiment config asks for: its method, then the fused-BP baseline."""

from __future__ import annotations

import dataclasses

import ml_collections

from dgrad.options import method_title

BASELINE_LABEL = "bp_fused"  # the directory of the fused-BP baseline run


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of an experiment (`runs_of` makes them from a config)."""

    label: str  # directory name under the workdir
    title: str  # for people
    method: str
    num_stages: int  # the model's stages: K, or K*V chunks when interleaved
    fused: bool


def runs_of(config: ml_collections.ConfigDict) -> list[Run]:
    """The config's method, then its baseline (fused BP on one device group) if it asks for one.

    The baseline is one stage, or the run's own cut when the optimizer clips: clipping is
    per stage, so only the same cut clips BP's gradient as the run clips its own.

    >>> from dgrad.train.config import base
    >>> config = base()
    >>> config.baseline = "bp"
    >>> [(run.label, run.title, run.num_stages) for run in runs_of(config)]
    [('fdg_k2', 'FDG K=2', 2), ('bp_fused', 'BP (fused)', 1)]
    """
    k, m, v = config.num_stages, config.microbatches, config.virtual_stages
    label, title = f"{config.method}_k{k}", f"{method_title(config.method, v)} K={k}"
    if v > 1:
        label, title = f"{label}_v{v}", f"{title} V={v}"
    if m not in (None, 1):
        label, title = f"{label}_m{m}", f"{title} M={m}"
    runs = [Run(label, title, config.method, k * v, False)]
    if config.baseline == "bp":
        cut = k * v if config.optimizer.clip_norm > 0 else 1
        runs.append(Run(BASELINE_LABEL, "BP (fused)", "bp", cut, True))
    return runs
