"""Small helpers shared by the model builders."""

from __future__ import annotations

import jax
from flax import nnx

he_normal = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")


def conv(in_ch: int, out_ch: int, kernel: tuple[int, ...], rngs, *, stride: int = 1) -> nnx.Conv:
    """The ResNets' convolution: bias-free, He-initialised, padded by half the (odd) kernel
    on each side, so that only the stride changes the length.

    >>> import jax.numpy as jnp
    >>> conv(2, 4, (3, 3), nnx.Rngs(0), stride=2)(jnp.ones((1, 8, 8, 2))).shape
    (1, 4, 4, 4)
    """
    return nnx.Conv(
        in_ch,
        out_ch,
        kernel,
        strides=stride,
        padding=tuple((k // 2, k // 2) for k in kernel),
        use_bias=False,
        kernel_init=he_normal,
        rngs=rngs,
    )


def batch_norm(channels: int, rngs) -> nnx.BatchNorm:
    """BatchNorm with PyTorch's defaults (its momentum 0.1 is Flax's 0.9), as the papers' code.

    >>> float(batch_norm(4, nnx.Rngs(0)).momentum)
    0.9
    """
    return nnx.BatchNorm(channels, momentum=0.9, epsilon=1e-5, rngs=rngs)


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
