"""Models as lists of NNX stages, with the papers' split points and balanced splits.

Each model also has a `*_blocks` builder that returns the chain of blocks
(`Blocks`) before it is cut, for custom or profiled splits.
"""

from dgrad.models.aux import AuxStage, PoolLinear, with_aux_heads
from dgrad.models.cnn1d import cnn1d, cnn1d_blocks
from dgrad.models.gpt import gpt, gpt_blocks, sample
from dgrad.models.mlp import mlp, mlp_blocks
from dgrad.models.resnet import cifar_resnet, cifar_resnet_blocks, wide_resnet, wide_resnet_blocks
from dgrad.models.split import Blocks, balanced_cuts, choose_cuts, stages_from_blocks

__all__ = [
    "AuxStage",
    "PoolLinear",
    "with_aux_heads",
    "Blocks",
    "mlp",
    "mlp_blocks",
    "cnn1d",
    "cnn1d_blocks",
    "gpt",
    "gpt_blocks",
    "sample",
    "cifar_resnet",
    "cifar_resnet_blocks",
    "wide_resnet",
    "wide_resnet_blocks",
    "balanced_cuts",
    "choose_cuts",
    "stages_from_blocks",
]
