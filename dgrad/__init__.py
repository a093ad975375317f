"""dgrad: train stage-split Flax models across devices with delayed gradients and pipelines.

The methods: BP, DDG, FDG, Features Replay, DGL and ADL; GPipe, 1F1B (interleaved with
virtual stages), zero-bubble (ZB-H1, and ZB-V with two virtual stages) and DualPipeV;
PipeDream and PipeDream-2BW (`dgrad.schedule` states each timetable, `dgrad.Pipeline` trains them).

The names below are imported when first used, so that `import dgrad` (and the
command line deciding that a run is already finished) stays fast.
"""

import importlib

__version__ = "0.2.0"

_EXPORTS = {
    "METHODS": "dgrad.options",
    "Options": "dgrad.options",
    "Pipeline": "dgrad.pipeline",
    "PipelineState": "dgrad.state",
    "Placement": "dgrad.placement",
    "Schedule": "dgrad.schedule",
}
_SUBMODULES = ("data", "losses", "models", "optim", "reference", "train")

__all__ = [*_EXPORTS, *_SUBMODULES]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"dgrad.{name}")
    raise AttributeError(f"module 'dgrad' has no attribute {name!r}")
