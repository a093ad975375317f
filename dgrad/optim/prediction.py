"""Weight prediction for the forward pass.

A stage whose gradient will be applied `tau` updates from now can forward with
the weights it is expected to have by then. Two rules:

- `predict_weights`: `w - tau * lr * v`, with `v` the optimizer's momentum
  (SpecTrain, Chen et al. 2018; PipeMare): for SGD with momentum.
- `extrapolate_weights`: `w + tau * u`, with `u` the update the optimizer last
  applied (constant velocity, as marin's delayed-gradient study does it): for any
  optimizer wrapped in `remember_update` (AdamW, Muon, ...).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from dgrad.checks import integer


def momentum_of(opt_state) -> Any:
    """The momentum trace in an optax state (from `optax.trace`, e.g. `optax.sgd(momentum=...)`).

    >>> import jax.numpy as jnp, optax
    >>> momentum_of(optax.sgd(0.1, momentum=0.9).init(jnp.zeros(2)))
    Array([0., 0.], dtype=float32)
    """
    traces = optax.tree.get_all_with_path(opt_state, "trace")
    if not traces:
        raise ValueError(
            "Weight prediction by momentum needs a momentum trace in the optimizer state; use "
            "an optimizer with momentum, e.g. optax.sgd(lr, momentum=0.9), or predict=update "
            "(extrapolates the last update, for any optimizer)."
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
    return optax.tree.add_scale(params, -tau * learning_rate, velocity)


class RememberUpdateState(NamedTuple):
    """The wrapped optimizer's state and the update it returned last (zeros at first).

    >>> import jax.numpy as jnp, optax
    >>> state = remember_update(optax.sgd(0.5)).init(jnp.ones(2))
    >>> state.inner, state.last_update  # sgd keeps nothing; no update yet
    ((EmptyState(), EmptyState()), Array([0., 0.], dtype=float32))
    """

    inner: Any
    last_update: Any


def remember_update(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner`, keeping the update it returns in its state for `extrapolate_weights`.

    Extra arguments (`stale_params`, ...) reach `inner`.

    >>> import jax.numpy as jnp, optax
    >>> tx = remember_update(optax.adam(0.1))
    >>> params = jnp.array([1.0, -1.0])
    >>> updates, state = tx.update(jnp.array([3.0, -0.5]), tx.init(params), params)
    >>> state.last_update.round(3)  # what it returned: Adam's first step, -lr * sign(g)
    Array([-0.1,  0.1], dtype=float32)
    """
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return RememberUpdateState(inner.init(params), optax.tree.zeros_like(params))

    def update(updates, state, params=None, **extra_args):
        updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
        return updates, RememberUpdateState(inner_state, updates)

    return optax.GradientTransformationExtraArgs(init, update)


def last_update_of(opt_state) -> Any:
    """The last update kept by `remember_update` in an optax state.

    >>> import jax.numpy as jnp, optax
    >>> last_update_of(remember_update(optax.sgd(0.1)).init(jnp.zeros(2)))
    Array([0., 0.], dtype=float32)
    """
    states = [
        node
        for node in jax.tree.leaves(
            opt_state, is_leaf=lambda node: isinstance(node, RememberUpdateState)
        )
        if isinstance(node, RememberUpdateState)
    ]
    if len(states) != 1:
        raise ValueError(
            "Weight extrapolation needs the optimizer wrapped once in "
            f"dgrad.optim.remember_update (found {len(states)} such states)."
        )
    return states[0].last_update


def extrapolate_weights(params, opt_state, tau: int):
    """Returns `params + tau * last_update`: the weights `tau` steps ahead if each step
    repeats the last one (`opt_state` from an optimizer wrapped in `remember_update`).

    >>> import jax.numpy as jnp, optax
    >>> tx = remember_update(optax.sgd(0.1))
    >>> params = jnp.array([1.0])
    >>> updates, state = tx.update(jnp.array([2.0]), tx.init(params), params)
    >>> params = optax.apply_updates(params, updates)  # 1 - 0.1 * 2
    >>> extrapolate_weights(params, state, tau=3)  # 0.8 - 3 * 0.2
    Array([0.19999999], dtype=float32)
    """
    integer("tau", tau)
    return optax.tree.add_scale(params, tau, last_update_of(opt_state))
