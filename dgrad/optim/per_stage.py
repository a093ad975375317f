"""One optimizer per pipeline stage, given as a transformation or a factory.

>>> import optax
>>> tx = for_stage(lambda k: optax.sgd(0.1 * (k + 1)), 1)
>>> isinstance(tx, optax.GradientTransformation)
True
"""

from __future__ import annotations

from typing import Callable

import optax

Optimizer = optax.GradientTransformation | Callable[[int], optax.GradientTransformation]


def for_stage(optimizer: Optimizer, stage: int) -> optax.GradientTransformation:
    """`optimizer` itself, or `optimizer(stage)` when it is a factory; checks the type.

    >>> import jax.numpy as jnp, optax
    >>> tx = for_stage(lambda k: optax.sgd(0.1 * (k + 1)), 1)  # stage 1's: sgd(0.2)
    >>> tx.update(jnp.ones(1), tx.init(jnp.zeros(1)))[0]
    Array([-0.2], dtype=float32)
    >>> for_stage(lambda k: "sgd", 0)
    Traceback (most recent call last):
        ...
    TypeError: optimizer must be an optax.GradientTransformation or a function from the stage ...
    """
    tx = (
        optimizer(stage)
        if callable(optimizer) and not isinstance(optimizer, optax.GradientTransformation)
        else optimizer
    )
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            "optimizer must be an optax.GradientTransformation or a function from the stage "
            f"index to one; for stage {stage} got {type(tx).__name__}."
        )
    return tx
