"""A multi-layer perceptron as a list of stages."""

from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx

from dgrad.models.common import as_rngs
from dgrad.models.split import Blocks


class Dense(nnx.Module):
    """A linear layer, followed by ReLU unless it is the output layer.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> x = jnp.array([[1.0, -2.0], [-3.0, 0.5]])
    >>> Dense(2, 3, activate=True, rngs=nnx.Rngs(0))(x)  # ReLU: no negative outputs
    Array([[2.508251  , 0.63418496, 0.        ],
           [0.        , 1.7271304 , 1.9311765 ]], dtype=float32)
    >>> float(Dense(2, 3, activate=False, rngs=nnx.Rngs(0))(x).min())  # the output layer
    -2.70807...
    """

    def __init__(self, in_features: int, out_features: int, *, activate: bool, rngs: nnx.Rngs):
        self.linear = nnx.Linear(in_features, out_features, rngs=rngs)
        self.activate = activate

    def __call__(self, x):
        y = self.linear(x)
        return jax.nn.relu(y) if self.activate else y


def mlp(
    features: Sequence[int],
    num_stages: int = 1,
    *,
    split: str | Sequence[int] = "balanced",
    rngs=0,
) -> list[nnx.Sequential]:
    """An MLP `features[0] -> ... -> features[-1]` cut into `num_stages` stages.

    Each linear layer is one block; `split="balanced"` balances the
    multiply-adds (in * out) of the stages. Inputs are flattened first.

    >>> stages = mlp([64, 32, 32, 10], num_stages=2)
    >>> [len(s.layers) for s in stages]
    [1, 2]
    """
    return mlp_blocks(features, rngs=rngs).stages(num_stages, split)


def mlp_blocks(features: Sequence[int], *, rngs=0) -> Blocks:
    """The MLP as a chain of blocks, one per linear layer.

    >>> blocks = mlp_blocks([64, 32, 10])
    >>> len(blocks.modules), blocks.costs  # costs: multiply-adds per example
    (2, [2048, 320])
    >>> [len(s.layers) for s in blocks.stages(2)]
    [1, 1]
    """
    features = list(features)
    if len(features) < 2 or any(not isinstance(f, int) or f < 1 for f in features):
        raise ValueError(f"features must list at least two positive layer sizes, got {features}.")
    rngs = as_rngs(rngs)
    sizes = list(zip(features, features[1:]))
    blocks = [Dense(i, o, activate=n < len(sizes) - 1, rngs=rngs) for n, (i, o) in enumerate(sizes)]
    blocks[0] = nnx.Sequential(Flatten(), blocks[0])
    return Blocks(blocks, [i * o for i, o in sizes], name=f"The MLP {features}")


class Flatten(nnx.Module):
    """Flattens every axis after the batch axis.

    >>> import jax.numpy as jnp
    >>> Flatten()(jnp.ones((2, 3, 4))).shape
    (2, 12)
    """

    def __call__(self, x):
        return x.reshape(x.shape[0], -1)
