"""Delay compensation (DC-ASGD, Zheng et al. 2017).

A gradient computed at stale weights `w_stale` is moved towards the gradient at
the current weights with a cheap diagonal Hessian approximation:
`g + lambda * g * g * (w_now - w_stale)`. The adaptive variant divides lambda
by the root of a running mean of `g * g`. The stale weights come in as the
keyword argument `stale_params` (the pipeline passes the weights the batch's
forward used, and keeps them for the delayed update only where
`reads_stale_params` says the update reads them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dgrad.checks import non_negative, unit_interval


class DelayCompensationState(NamedTuple):
    """`mean_square`: running mean of squared gradients (adaptive variant; else None).

    >>> import jax.numpy as jnp
    >>> delay_compensation(0.5).init(jnp.zeros(2))
    DelayCompensationState(mean_square=None)
    >>> delay_compensation(0.5, adaptive=True).init(jnp.zeros(2))
    DelayCompensationState(mean_square=Array([0., 0.], dtype=float32))
    """

    mean_square: Any


def delay_compensation(
    strength: float, *, adaptive: bool = False, decay: float = 0.95, eps: float = 1e-7
) -> optax.GradientTransformationExtraArgs:
    """Compensates stale gradients; needs `params` and `stale_params` at update time.

    Args:
      strength: lambda (lambda_0 in the adaptive variant); 0 is the identity.
      adaptive: use `lambda / sqrt(mean_square + eps)`, DC-ASGD-a.
      decay: the running mean's decay m: `ms = m * ms + (1 - m) * g * g`.
      eps: added under the root.

    >>> import jax.numpy as jnp
    >>> tx = delay_compensation(0.5)
    >>> g, now, stale = jnp.array([2.0]), jnp.array([1.0]), jnp.array([0.5])
    >>> tx.update(g, tx.init(now), now, stale_params=stale)[0]  # 2 + 0.5 * 4 * 0.5
    Array([3.], dtype=float32)
    """
    strength = non_negative("strength (lambda)", strength)
    decay, eps = unit_interval("decay", decay), non_negative("eps", eps)

    def init_fn(params):
        return DelayCompensationState(optax.tree.zeros_like(params) if adaptive else None)

    def update_fn(updates, state, params=None, *, stale_params=None, **extra_args):
        del extra_args
        if params is None or stale_params is None:
            raise ValueError(
                "delay_compensation needs the current params and stale_params=<the weights the "
                "gradient was computed at>: tx.update(grads, state, params, stale_params=...)."
            )
        mean_square = state.mean_square
        if adaptive:
            mean_square = optax.tree.update_moment_per_elem_norm(updates, mean_square, decay, 2)
            scale = jax.tree.map(lambda ms: strength / jnp.sqrt(ms + eps), mean_square)
        else:
            scale = optax.tree.full_like(updates, strength)
        updates = jax.tree.map(
            lambda g, s, now, old: g + s * g * g * (now - old), updates, scale, params, stale_params
        )
        return updates, DelayCompensationState(mean_square)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def reads_stale_params(optimizer: optax.GradientTransformation, params) -> bool:
    """Whether `optimizer.update` reads its `stale_params` keyword argument.

    Traced once on `params` (arrays or shapes): true when any operation of the update
    takes one of the stale weights (delay compensation does; plain optax
    transforms never see them).

    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.zeros(3)}
    >>> reads_stale_params(optax.sgd(0.1), params)
    False
    >>> reads_stale_params(optax.chain(delay_compensation(0.5), optax.sgd(0.1)), params)
    True
    """
    optimizer = optax.with_extra_args_support(optimizer)

    def update(grads, state, params, stale_params):
        return optimizer.update(grads, state, params, stale_params=stale_params)

    state = jax.eval_shape(optimizer.init, params)
    jaxpr = jax.make_jaxpr(update)(params, state, params, params).jaxpr
    count = len(jax.tree.leaves(params))
    stale = {id(v) for v in jaxpr.invars[len(jaxpr.invars) - count :]}
    read = [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars)
    return any(id(v) in stale for v in read)
