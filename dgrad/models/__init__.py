"""Models as lists of NNX stages, with the papers' split points and balanced splits."""

from dgrad.models.mlp import mlp
from dgrad.models.resnet import cifar_resnet, wide_resnet
from dgrad.models.split import balanced_cuts, choose_cuts, stages_from_blocks

__all__ = [
    "mlp",
    "cifar_resnet",
    "wide_resnet",
    "balanced_cuts",
    "choose_cuts",
    "stages_from_blocks",
]
