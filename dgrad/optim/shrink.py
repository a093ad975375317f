"""Gradient shrinking (FDG, Zhuang et al. 2019).

`shrink` is the gradient shrinking of FDG (Zhuang et al., 2019): the pipeline
puts it in front of stage k's optimizer with `depth = K-1-k`, so that weight
decay and momentum inside the optimizer see the shrunk gradient but decay is
not itself shrunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dgrad import checks


def shrink(beta: float, depth: int) -> optax.GradientTransformation:
    """Scales gradients by `beta ** depth` (FDG gradient shrinking).

    Args:
      beta: shrinking factor in (0, 1]; 1 leaves gradients unchanged.
      depth: how many stages lie between this stage and the loss (K-1-k for
        stage k of K), i.e. how often the cotangent was shrunk on its way here.

    Returns:
      A stateless `optax.GradientTransformation`.

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(shrink(0.5, depth=2), optax.add_decayed_weights(0.1), optax.sgd(1.0))
    >>> params = {"w": jnp.array([1.0])}
    >>> updates, _ = tx.update({"w": jnp.array([4.0])}, tx.init(params), params)
    >>> updates["w"]  # -(0.5**2 * 4 + 0.1 * 1)
    Array([-1.1], dtype=float32)
    """
    beta = checks.shrinking_factor(beta)
    checks.integer("depth", depth)
    factor = beta ** int(depth)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        updates = jax.tree.map(lambda g: g * jnp.asarray(factor, g.dtype), updates)
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)
