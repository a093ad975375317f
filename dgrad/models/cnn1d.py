"""A small 1-D ResNet for MNIST-1D as a chain of equal blocks.

The chain is `num_blocks` residual blocks of two `width`-channel, kernel-3
convolutions with BatchNorm. The first block also holds the stem (a kernel-5,
stride-2 convolution: 40 points become 20) and the last the head (global
average pooling and the classifier), so all blocks cost about the same and
the stages are equal whenever K divides `num_blocks` (K = 1, 2, 4, 8 for the
default 8). With the defaults (8 blocks, width 16) it has 13,082 parameters.
Inputs are `(batch, length, channels)` signals.

>>> stages = cnn1d(num_stages=4)
>>> [len(s.layers) for s in stages]
[2, 2, 2, 2]
"""

from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx

from dgrad.models.common import as_rngs, conv, he_normal
from dgrad.models.common import batch_norm as _bn
from dgrad.models.split import Blocks

STEM_KERNEL, STEM_STRIDE, KERNEL = 5, 2, 3
# MNIST-1D's 40 points after the stride-2 stem, for the head's share of the cost.
_LENGTH_AFTER_STEM = 20


def _conv(in_ch, out_ch, kernel, rngs, *, stride=1):
    return conv(in_ch, out_ch, (kernel,), rngs, stride=stride)


class Stem1d(nnx.Module):
    """A strided convolution to `out_ch` channels, BatchNorm and ReLU.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> Stem1d(1, 4, rngs=nnx.Rngs(0))(jnp.ones((2, 40, 1))).shape  # stride 2
    (2, 20, 4)
    """

    def __init__(self, in_ch, out_ch, *, rngs):
        self.conv = _conv(in_ch, out_ch, STEM_KERNEL, rngs, stride=STEM_STRIDE)
        self.bn = _bn(out_ch, rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.conv(x)))


class ResidualBlock1d(nnx.Module):
    """conv-BN-ReLU-conv-BN plus the input, then ReLU (the basic ResNet block in 1-D).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> ResidualBlock1d(4, rngs=nnx.Rngs(0))(jnp.ones((2, 20, 4))).shape
    (2, 20, 4)
    """

    def __init__(self, channels, *, rngs):
        self.conv1, self.bn1 = _conv(channels, channels, KERNEL, rngs), _bn(channels, rngs)
        self.conv2, self.bn2 = _conv(channels, channels, KERNEL, rngs), _bn(channels, rngs)

    def __call__(self, x):
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        return jax.nn.relu(x + self.bn2(self.conv2(y)))


class Head1d(nnx.Module):
    """Global average pooling over the length, then the classifier.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> Head1d(4, 10, rngs=nnx.Rngs(0))(jnp.ones((2, 20, 4))).shape
    (2, 10)
    """

    def __init__(self, channels, num_classes, *, rngs):
        self.fc = nnx.Linear(channels, num_classes, kernel_init=he_normal, rngs=rngs)

    def __call__(self, x):
        return self.fc(x.mean(axis=1))


def cnn1d(
    num_classes: int = 10,
    num_stages: int = 1,
    *,
    num_blocks: int = 8,
    width: int = 16,
    in_channels: int = 1,
    split: str | Sequence[int] = "balanced",
    rngs=0,
) -> list[nnx.Sequential]:
    """The 1-D ResNet of `num_blocks` residual blocks, cut into `num_stages` stages.

    Args:
      num_classes: classifier outputs.
      num_stages: K, at most `num_blocks`.
      num_blocks: residual blocks, the units the model is cut between.
      width: channels of every convolution.
      in_channels: the signal's channels (1 for MNIST-1D).
      split: see `dgrad.models.split.choose_cuts` (the papers give no split).
      rngs: an `nnx.Rngs`, key or seed.

    >>> import jax.numpy as jnp
    >>> stages = cnn1d(num_stages=8)
    >>> x = jnp.zeros((2, 40, 1))
    >>> for stage in stages:
    ...     x = stage(x)
    >>> len(stages), x.shape
    (8, (2, 10))
    """
    blocks = cnn1d_blocks(
        num_classes, num_blocks=num_blocks, width=width, in_channels=in_channels, rngs=rngs
    )
    return blocks.stages(num_stages, split)


def cnn1d_blocks(
    num_classes: int = 10,
    *,
    num_blocks: int = 8,
    width: int = 16,
    in_channels: int = 1,
    rngs=0,
) -> Blocks:
    """The 1-D ResNet as a chain `[stem + block, block, ..., block + head]`.

    Costs are multiply-adds per position of the stem's output.

    >>> blocks = cnn1d_blocks()
    >>> len(blocks.modules), blocks.costs[1], blocks.costs[0] > blocks.costs[1]
    (8, 1536, True)
    """
    for name, value in (("num_blocks", num_blocks), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    rngs = as_rngs(rngs)
    stem = Stem1d(in_channels, width, rngs=rngs)
    blocks = [ResidualBlock1d(width, rngs=rngs) for _ in range(num_blocks)]
    head = Head1d(width, num_classes, rngs=rngs)
    block_cost = 2 * KERNEL * width * width
    costs = [block_cost] * num_blocks
    costs[0] += STEM_KERNEL * in_channels * width
    costs[-1] += width * num_classes / _LENGTH_AFTER_STEM
    blocks[0] = nnx.Sequential(stem, blocks[0])
    blocks[-1] = nnx.Sequential(blocks[-1], head)
    return Blocks(blocks, costs, name=f"The 1-D ResNet (num_blocks={num_blocks})")
