"""Small helpers shared by the model builders."""

from __future__ import annotations

import jax
from flax import nnx

he_normal = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")


def as_rngs(rngs) -> nnx.Rngs:
    """Accepts an `nnx.Rngs`, a JAX key or an integer seed.

    >>> isinstance(as_rngs(0), nnx.Rngs)
    True
    """
    if isinstance(rngs, nnx.Rngs):
        return rngs
    if isinstance(rngs, int) or isinstance(rngs, jax.Array):
        return nnx.Rngs(rngs)
    raise TypeError(f"rngs must be an nnx.Rngs, a jax.random.key or an int seed, got {rngs!r}.")
