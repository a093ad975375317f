"""dgrad: train stage-split Flax models across devices with delayed gradients (DDG, FDG)."""

from dgrad import losses, models, optim
from dgrad.pipeline import Pipeline, PipelineState
from dgrad.placement import place_stages
from dgrad.schedule import METHODS, Schedule

__version__ = "0.1.0"

__all__ = [
    "Pipeline",
    "PipelineState",
    "Schedule",
    "METHODS",
    "place_stages",
    "losses",
    "models",
    "optim",
]
