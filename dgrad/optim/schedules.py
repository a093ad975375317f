"""Step-size and gradient-count remedies for staleness: PipeMare and accumulation."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from dgrad.checks import integer


class PipeMareState(NamedTuple):
    """State of `pipemare_rescale`: `count`, the updates made so far (t).

    >>> import jax.numpy as jnp
    >>> tx = pipemare_rescale(tau=4, horizon=2)
    >>> state = tx.init(jnp.zeros(1))
    >>> state, tx.update(jnp.ones(1), state)[1]
    (PipeMareState(count=Array(0, dtype=int32)), PipeMareState(count=Array(1, dtype=int32)))
    """

    count: jax.Array


def pipemare_rescale(tau: int, horizon: int) -> optax.GradientTransformation:
    """PipeMare's step-size rescaling (Yang et al. 2021) for a stage of delay `tau`.

    Scales the updates by `tau ** (-p_t)` with `p_t = max(0, 1 - t / horizon)`,
    so a stale stage starts with its step divided by its delay and reaches the
    full step after `horizon` updates. Chain it after the optimizer. Delays 0
    and 1 are not rescaled.

    >>> import jax.numpy as jnp
    >>> tx = pipemare_rescale(tau=4, horizon=2)
    >>> state = tx.init(jnp.zeros(1))
    >>> for _ in range(3):
    ...     updates, state = tx.update(jnp.ones(1), state)
    ...     print(updates)  # 4**-1, 4**-0.5, 4**0
    [0.25]
    [0.5]
    [1.]
    """
    integer("tau", tau)
    integer("horizon", horizon, minimum=1, what="a positive number of updates")

    def init_fn(params):
        del params
        return PipeMareState(jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        p = jnp.maximum(0.0, 1.0 - state.count / horizon)
        scale = jnp.asarray(max(tau, 1), jnp.float32) ** (-p)
        updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
        return updates, PipeMareState(optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def accumulate(
    inner: optax.GradientTransformation, every: int, *, total: bool = False
) -> optax.GradientTransformationExtraArgs:
    """Averages (or with `total=True` sums, as the ADL authors' code) `every` gradients
    before each step of `inner` (`optax.MultiSteps`).

    Fewer, larger steps shrink the staleness measured in updates (ADL's remedy);
    between steps the updates are zero. `Pipeline(accumulate=M)` is this with
    `total=True` in every stage.

    >>> import jax.numpy as jnp, optax
    >>> tx = accumulate(optax.sgd(1.0), every=2)
    >>> state, steps = tx.init(jnp.zeros(1)), []
    >>> for g in (1.0, 3.0):
    ...     updates, state = tx.update(jnp.array([g]), state, jnp.zeros(1))
    ...     steps.append(abs(float(updates[0])))
    >>> steps  # nothing, then the mean of the two (with total=True: their sum, 4.0)
    [0.0, 2.0]
    """
    integer("every", every, minimum=1)
    if total:
        inner = optax.chain(optax.scale(every), inner)
    steps = optax.MultiSteps(inner, every_k_schedule=every)  # (passes extra args to inner)
    return optax.GradientTransformationExtraArgs(steps.init, steps.update)
