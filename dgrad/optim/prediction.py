"""Weight prediction for the forward pass (SpecTrain, Chen et al. 2018; PipeMare).

A stage whose gradient will be applied `tau` updates from now can forward with
the weights it is expected to have by then: `w - tau * lr * v`, with `v` the
optimizer's momentum (the direction its steps keep going).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from dgrad.optim.checks import integer


def momentum_of(opt_state) -> Any:
    """The momentum trace in an optax state (from `optax.trace`, e.g. `optax.sgd(momentum=...)`).

    >>> import jax.numpy as jnp, optax
    >>> momentum_of(optax.sgd(0.1, momentum=0.9).init(jnp.zeros(2)))
    Array([0., 0.], dtype=float32)
    """
    traces = optax.tree_utils.tree_get_all_with_path(opt_state, "trace")
    if not traces:
        raise ValueError(
            "Weight prediction needs a momentum trace in the optimizer state; use an optimizer "
            "with momentum, e.g. optax.sgd(lr, momentum=0.9)."
        )
    if len(traces) > 1:
        raise ValueError(f"The optimizer state holds {len(traces)} momentum traces; expected one.")
    return traces[0][1]


def predict_weights(params, opt_state, tau: int, learning_rate: float):
    """Returns `params - tau * learning_rate * momentum` (the weights `tau` steps ahead).

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.sgd(0.1, momentum=0.9)
    >>> params = {"w": jnp.array([1.0])}
    >>> _, state = tx.update({"w": jnp.array([2.0])}, tx.init(params), params)
    >>> predict_weights(params, state, tau=3, learning_rate=0.1)["w"]  # 1 - 3 * 0.1 * 2
    Array([0.39999998], dtype=float32)
    """
    integer("tau", tau)
    velocity = momentum_of(opt_state)
    return jax.tree.map(lambda w, v: w - tau * learning_rate * v, params, velocity)
