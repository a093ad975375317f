"""Auxiliary heads for decoupled greedy learning (DGL, Belilovsky et al. 2020).

Under `method="dgl"` every stage but the last trains on the loss of its own
small classifier. `AuxStage(body, head)` is such a stage: calling it runs the
body only (what the next stage receives, what the exported model keeps);
`auxiliary(x)` also runs the head. The heads are part of the stage's
parameters and of checkpoints; `dgrad.train.export` drops them.

The head here is global average pooling over the spatial (or sequence) axes
followed by one linear layer: the cheapest head of the kind the DGL paper
describes ("a reduction of the spatial resolution followed by a classifier").
The authors' CIFAR code uses a larger one (average pooling to 4x4, three 1x1
convolutions with BatchNorm, pooling to 2x2 and a 3-layer MLP); any NNX module
from features to logits can be given instead.

>>> import jax.numpy as jnp
>>> from dgrad import models
>>> stages = with_aux_heads(models.mlp([6, 8, 8, 3], num_stages=2), 3, jnp.ones((4, 6)))
>>> [type(s).__name__ for s in stages]
['AuxStage', 'Sequential']
>>> y, logits = stages[0].auxiliary(jnp.ones((4, 6)))
>>> y.shape, logits.shape
((4, 8), (4, 3))
"""

from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx

from dgrad.models.common import as_rngs


class PoolLinear(nnx.Module):
    """Mean over every axis between the batch and the features, then a linear layer.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> head = PoolLinear(8, 3, rngs=nnx.Rngs(0))
    >>> head(jnp.ones((2, 5, 5, 8))).shape, head(jnp.ones((2, 8))).shape  # images or vectors
    ((2, 3), (2, 3))
    """

    def __init__(self, features: int, num_classes: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(features, num_classes, rngs=rngs)

    def __call__(self, x):
        if x.ndim > 2:
            x = x.mean(axis=tuple(range(1, x.ndim - 1)))
        return self.linear(x)


class AuxStage(nnx.Module):
    """A pipeline stage with an auxiliary classifier: `stage(x)` is `body(x)`.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> stage = AuxStage(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), PoolLinear(8, 3, rngs=nnx.Rngs(1)))
    >>> stage(jnp.ones((2, 4))).shape  # the body only
    (2, 8)
    """

    def __init__(self, body: nnx.Module, head: nnx.Module):
        self.body, self.head = body, head

    def __call__(self, x):
        return self.body(x)

    def auxiliary(self, x):
        """The body's output, and the head's logits on it.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> stage = AuxStage(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), PoolLinear(8, 3, rngs=nnx.Rngs(1)))
        >>> y, logits = stage.auxiliary(jnp.ones((2, 4)))
        >>> y.shape, logits.shape
        ((2, 8), (2, 3))
        """
        y = self.body(x)
        return y, self.head(y)


def with_aux_heads(
    stages: Sequence[nnx.Module], num_classes: int, example_input, *, rngs=0
) -> list[nnx.Module]:
    """`stages` with a `PoolLinear` head on every stage but the last (which has the loss).

    `example_input` (an array or `jax.ShapeDtypeStruct` of the model's input) fixes the
    width of each head.

    >>> import jax.numpy as jnp
    >>> from dgrad import models
    >>> stages = with_aux_heads(models.mlp([6, 8, 8, 3], num_stages=3), 3, jnp.ones((4, 6)))
    >>> [type(s).__name__ for s in stages]  # the last stage's head is the model's own
    ['AuxStage', 'AuxStage', 'Sequential']
    >>> [(s.head.linear.in_features, s.head.linear.out_features) for s in stages[:2]]
    [(8, 3), (8, 3)]
    """
    rngs = as_rngs(rngs)
    shape = jax.ShapeDtypeStruct(example_input.shape, example_input.dtype)
    out = []
    for k, stage in enumerate(stages):
        if k == len(stages) - 1:
            out.append(stage)
            break
        graph, state = nnx.split(stage)  # traced on a copy: the stage itself stays untouched
        shape = jax.eval_shape(lambda s, x, g=graph: nnx.merge(g, s, copy=True)(x), state, shape)
        out.append(AuxStage(stage, PoolLinear(shape.shape[-1], num_classes, rngs=rngs)))
    return out
