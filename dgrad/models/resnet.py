"""CIFAR ResNets (He et al. 2016) and Wide ResNets (Zagoruyko & Komodakis 2016) as stage lists.

Both are chains of blocks `[stem, group1..., group2..., group3..., head]`
(3n + 2 blocks), cut into stages either where the DDG/FDG papers cut them
(`split="authors"`) or to balance the stages' multiply-adds.
Inputs are NHWC images.

>>> chain = cifar_resnet_blocks(depth=8, width=4)  # stem, 3 blocks, head
>>> [len(s.layers) for s in chain.stages(2, split="balanced")]
[2, 3]
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dgrad.models.common import as_rngs, conv, he_normal
from dgrad.models.common import batch_norm as _bn
from dgrad.models.split import Blocks


def _conv(in_ch, out_ch, rngs, *, stride=1, kernel=3):
    return conv(in_ch, out_ch, (kernel, kernel), rngs, stride=stride)


class Stem(nnx.Module):
    """3x3 convolution, then (unless `pre_activation`) BatchNorm and ReLU.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> Stem(3, 4, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 8, 3))).shape
    (2, 8, 8, 4)
    """

    def __init__(self, in_ch, out_ch, *, pre_activation=False, rngs):
        self.conv = _conv(in_ch, out_ch, rngs)
        self.bn = None if pre_activation else _bn(out_ch, rngs)

    def __call__(self, x):
        x = self.conv(x)
        return x if self.bn is None else jax.nn.relu(self.bn(x))


class BasicBlock(nnx.Module):
    """The CIFAR ResNet block with the option-A (subsample + zero-pad) shortcut.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> BasicBlock(4, 8, stride=2, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 8, 4))).shape
    (2, 4, 4, 8)
    """

    def __init__(self, in_ch, out_ch, stride, *, rngs):
        self.conv1, self.bn1 = _conv(in_ch, out_ch, rngs, stride=stride), _bn(out_ch, rngs)
        self.conv2, self.bn2 = _conv(out_ch, out_ch, rngs), _bn(out_ch, rngs)
        self.stride, self.pad = stride, out_ch - in_ch

    def __call__(self, x):
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        shortcut = x[:, :: self.stride, :: self.stride, :]
        if self.pad:
            half = self.pad // 2
            shortcut = jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (half, self.pad - half)))
        return jax.nn.relu(y + shortcut)


class WideBlock(nnx.Module):
    """The pre-activation wide block (BN-ReLU-conv twice), 1x1 conv shortcut on change.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> WideBlock(4, 8, stride=2, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 8, 4))).shape
    (2, 4, 4, 8)
    """

    def __init__(self, in_ch, out_ch, stride, *, rngs):
        self.bn1, self.conv1 = _bn(in_ch, rngs), _conv(in_ch, out_ch, rngs, stride=stride)
        self.bn2, self.conv2 = _bn(out_ch, rngs), _conv(out_ch, out_ch, rngs)
        self.shortcut = (
            None
            if in_ch == out_ch and stride == 1
            else _conv(in_ch, out_ch, rngs, stride=stride, kernel=1)
        )

    def __call__(self, x):
        a = jax.nn.relu(self.bn1(x))
        y = self.conv1(a)
        y = self.conv2(jax.nn.relu(self.bn2(y)))
        return y + (x if self.shortcut is None else self.shortcut(a))


class Head(nnx.Module):
    """(Optional BN-ReLU,) global average pooling and the classifier.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> Head(8, 10, rngs=nnx.Rngs(0))(jnp.ones((2, 4, 4, 8))).shape
    (2, 10)
    """

    def __init__(self, channels, num_classes, *, pre_activation=False, rngs):
        self.bn = _bn(channels, rngs) if pre_activation else None
        self.fc = nnx.Linear(channels, num_classes, kernel_init=he_normal, rngs=rngs)

    def __call__(self, x):
        if self.bn is not None:
            x = jax.nn.relu(self.bn(x))
        return self.fc(x.mean(axis=(1, 2)))


def _cut(n: int, group: int, index: int) -> int:
    """The block index of `L{group}[index]` in `[stem, L1.., L2.., L3.., head]`."""
    return 1 + (group - 1) * n + index


def _resnet_authors_cuts(depth: int, n: int) -> dict[int, list[int]]:
    c = lambda g, i: _cut(n, g, i)  # noqa: E731
    groups = {3: [c(2, 0), c(3, 0)]}
    table = {
        56: {2: [c(2, 4)], 4: [c(1, 6), c(2, 4), c(3, 2)], **groups},
        110: {2: [c(2, 9)], 4: [c(1, 13), c(2, 9), c(3, 5)]},
        1202: {4: [c(1, 75), c(2, 50), c(3, 25)]},
    }
    return table.get(depth, {})


def _chain(blocks_per_group, widths, make_block, rngs):
    blocks, costs, resolution = [], [], 1.0
    in_ch = widths[0]
    for group, out_ch in enumerate(widths[1:]):
        for i in range(blocks_per_group):
            stride = 2 if group > 0 and i == 0 else 1
            resolution /= stride * stride
            blocks.append(make_block(in_ch, out_ch, stride, rngs=rngs))
            # multiply-adds per input pixel of two 3x3 convolutions
            costs.append(9 * (in_ch * out_ch + out_ch * out_ch) * resolution)
            in_ch = out_ch
    return blocks, costs


def cifar_resnet(
    depth: int = 56,
    num_classes: int = 10,
    num_stages: int = 1,
    *,
    width: int = 16,
    in_channels: int = 3,
    split: str | Sequence[int] = "auto",
    rngs=0,
) -> list[nnx.Sequential]:
    """The CIFAR ResNet-`depth` (depth = 6n+2: 20, 56, 110, 1202, ...) as stages.

    Args:
      depth: 6n + 2 layers: n basic blocks in each of three groups.
      num_classes: classifier outputs.
      num_stages: K.
      width: channels of the first group (16 in the paper; doubled per group).
      in_channels: image channels.
      split: see `dgrad.models.split.choose_cuts`; the papers' splits exist for
        ResNet-56 (K = 2, 3, 4), ResNet-110 (K = 2, 4) and ResNet-1202 (K = 4).
      rngs: an `nnx.Rngs`, key or seed.

    >>> stages = cifar_resnet(56, num_stages=2, width=4)  # the papers' cut, before L2[4]
    >>> [len(s.layers) for s in stages]
    [14, 15]
    >>> [type(block).__name__ for block in stages[0].layers[:2]], type(stages[1].layers[-1])
    (['Stem', 'BasicBlock'], <class 'dgrad.models.resnet.Head'>)
    """
    blocks = cifar_resnet_blocks(
        depth, num_classes, width=width, in_channels=in_channels, rngs=rngs
    )
    return blocks.stages(num_stages, split)


def cifar_resnet_blocks(
    depth: int = 56, num_classes: int = 10, *, width: int = 16, in_channels: int = 3, rngs=0
) -> Blocks:
    """The CIFAR ResNet-`depth` as a chain of blocks `[stem, L1.., L2.., L3.., head]`.

    >>> blocks = cifar_resnet_blocks(20, width=4)  # stem, 3 groups of 3 blocks, head
    >>> len(blocks.modules), blocks.name, blocks.authors  # the papers split no ResNet-20
    (11, 'ResNet-20', {})
    >>> [type(b).__name__ for b in blocks.modules[:2]], type(blocks.modules[-1]).__name__
    (['Stem', 'BasicBlock'], 'Head')
    """
    if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise ValueError(
            f"A CIFAR ResNet has depth 6n+2 with n >= 1 (20, 56, 110, ...), got {depth}."
        )
    n = (depth - 2) // 6
    rngs = as_rngs(rngs)
    widths = [width, width, 2 * width, 4 * width]
    stem = Stem(in_channels, width, rngs=rngs)
    blocks, costs = _chain(n, widths, BasicBlock, rngs)
    head = Head(widths[-1], num_classes, rngs=rngs)
    costs = [9 * in_channels * width, *costs, widths[-1] * num_classes / 64]
    return Blocks([stem, *blocks, head], costs, _resnet_authors_cuts(depth, n), f"ResNet-{depth}")


def wide_resnet(
    depth: int = 28,
    widen: int = 10,
    num_classes: int = 10,
    num_stages: int = 1,
    *,
    in_channels: int = 3,
    split: str | Sequence[int] = "auto",
    rngs=0,
) -> list[nnx.Sequential]:
    """The Wide ResNet WRN-`depth`-`widen` (depth = 6n+4) as stages.

    The papers' splits exist for WRN-28-10 with K = 2 and 4.

    >>> [len(s.layers) for s in wide_resnet(16, 1, num_stages=2, split="balanced")]
    [4, 4]
    """
    blocks = wide_resnet_blocks(depth, widen, num_classes, in_channels=in_channels, rngs=rngs)
    return blocks.stages(num_stages, split)


def wide_resnet_blocks(
    depth: int = 28, widen: int = 10, num_classes: int = 10, *, in_channels: int = 3, rngs=0
) -> Blocks:
    """WRN-`depth`-`widen` as a chain of blocks `[stem, L1.., L2.., L3.., head]`.

    >>> blocks = wide_resnet_blocks(16, 1)  # stem, 3 groups of 2 blocks, head
    >>> len(blocks.modules), blocks.name, [len(s.layers) for s in blocks.stages(2)]
    (8, 'WRN-16-1', [4, 4])
    """
    if not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
        raise ValueError(
            f"A Wide ResNet has depth 6n+4 with n >= 1 (16, 28, 40, ...), got {depth}."
        )
    if not isinstance(widen, int) or widen < 1:
        raise ValueError(f"widen must be a positive integer, got {widen!r}.")
    n = (depth - 4) // 6
    rngs = as_rngs(rngs)
    widths = [16, 16 * widen, 32 * widen, 64 * widen]
    blocks, costs = _chain(n, widths, WideBlock, rngs)
    blocks = [
        Stem(in_channels, 16, pre_activation=True, rngs=rngs),
        *blocks,
        Head(widths[-1], num_classes, pre_activation=True, rngs=rngs),
    ]
    costs = [9 * in_channels * 16, *costs, widths[-1] * num_classes / 64]
    c = lambda g, i: _cut(n, g, i)  # noqa: E731
    authors = {2: [c(2, 2)], 4: [c(1, 3), c(2, 2), c(3, 1)]} if (depth, widen) == (28, 10) else {}
    return Blocks(blocks, costs, authors, f"WRN-{depth}-{widen}")
