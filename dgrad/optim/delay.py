"""Delayed updates: apply the gradient computed `tau` updates ago.

`delay(inner, tau)` keeps the last `tau` gradients in a ring buffer and feeds
`inner` the oldest, making no update at all (no inner step: momentum and decay
stand still) until the buffer is full, as a pipeline does while it fills. Fed
the gradient at the current parameters, it is the stale-gradient model
`w_{t+1} = U(w_t, g(w_{t-tau}))` on one device. `staged_delay` gives each
pipeline stage's parameters the weight staleness of BP, DDG or FDG.

See `delay` for an example.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from dgrad.checks import integer
from dgrad.optim.per_stage import Optimizer, for_stage
from dgrad.schedule import Schedule


class DelayState(NamedTuple):
    """State of `delay`.

    Attributes:
      count: gradients received so far.
      buffer: the last `tau` gradients, each leaf stacked on a new leading axis
        (a ring: gradient `count` lives in slot `count % tau`).
      inner_state: the wrapped transformation's state.

    >>> import jax.numpy as jnp, optax
    >>> state = delay(optax.sgd(0.1), tau=2).init(jnp.zeros(3))
    >>> state.count, state.buffer.shape, state.inner_state  # two gradients of shape (3,) kept
    (Array(0, dtype=int32), (2, 3), (EmptyState(), EmptyState()))
    """

    count: jax.Array
    buffer: Any
    inner_state: Any


def _check_tau(tau) -> int:
    return integer("tau", tau, what="a non-negative integer number of updates")


def delay(inner: optax.GradientTransformation, tau: int) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so that it receives each gradient `tau` updates late.

    Args:
      inner: any optax transformation, e.g. `optax.sgd(0.1, momentum=0.9)`.
      tau: the delay in updates; 0 returns `inner` itself (bit-identical).

    Returns:
      A transformation whose first `tau` updates are zero and leave `inner`'s
      state untouched. Extra arguments (`stale_params=` for delay compensation)
      go to `inner` with the gradient it applies now, so give those of that
      gradient: the weights of `tau` updates ago. The kept gradients take the
      dtype of `params`.

    >>> import jax.numpy as jnp, optax
    >>> tx = delay(optax.sgd(1.0), tau=2)
    >>> params = jnp.zeros(1)
    >>> state = tx.init(params)
    >>> for g in [1.0, 2.0, 3.0, 4.0]:
    ...     updates, state = tx.update(jnp.array([g]), state, params)
    ...     print(updates)
    [0.]
    [0.]
    [-1.]
    [-2.]
    """
    tau = _check_tau(tau)
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"delay wraps an optax transformation such as optax.sgd(0.1), got {inner!r}."
        )
    inner = optax.with_extra_args_support(inner)
    if tau == 0:
        return inner

    def init_fn(params):
        buffer = jax.tree.map(lambda p: jnp.zeros((tau, *jnp.shape(p)), jnp.result_type(p)), params)
        return DelayState(jnp.zeros([], jnp.int32), buffer, inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        slot = state.count % tau
        oldest = jax.tree.map(lambda b: b[slot], state.buffer)
        buffer = jax.tree.map(lambda b, g: b.at[slot].set(g.astype(b.dtype)), state.buffer, updates)
        ready = state.count >= tau
        new_updates, new_inner = inner.update(oldest, state.inner_state, params, **extra_args)
        new_updates = optax.tree.where(ready, new_updates, optax.tree.zeros_like(new_updates))
        inner_state = optax.tree.where(ready, new_inner, state.inner_state)
        return new_updates, DelayState(optax.safe_int32_increment(state.count), buffer, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def delayed(tau: int) -> optax.GradientTransformationExtraArgs:
    """Outputs the gradient received `tau` updates ago (zeros while filling).

    Chain it in front of an optimizer to delay gradients only; wrap the
    optimizer with `delay` instead to also skip its steps while filling.

    >>> import jax.numpy as jnp
    >>> tx = delayed(1)
    >>> state = tx.init(jnp.zeros(1))
    >>> out = []
    >>> for g in (5.0, 7.0):
    ...     updates, state = tx.update(jnp.array([g]), state)
    ...     out.append(float(updates[0]))
    >>> out  # zeros while filling, then the gradient of one update ago
    [0.0, 5.0]
    """
    return delay(optax.identity(), tau)


def pipeline_delays(method: str, num_stages: int) -> list[int]:
    """The weight staleness of each stage: BP 0, DDG K-1-k, FDG 2(K-1-k)-1 (last: 0).

    >>> pipeline_delays("fdg", 4)
    [5, 3, 1, 0]
    """
    schedule = Schedule(method, num_stages)
    return [schedule.weight_staleness(k) for k in range(num_stages)]


def stage_labels(stage_params: Sequence[Any]) -> list[Any]:
    """Labels each leaf of a list of per-stage parameter trees with its stage index.

    >>> stage_labels([{"w": 1.0}, {"w": 2.0, "b": 3.0}])
    [{'w': 0}, {'b': 1, 'w': 1}]
    """
    return [jax.tree.map(lambda _, k=k: k, params) for k, params in enumerate(stage_params)]


def staged_delay(
    optimizer: Optimizer,
    method: str,
    num_stages: int,
) -> optax.GradientTransformation:
    """One-device simulation of a pipeline's staleness for a list of per-stage parameters.

    Stage k's parameters (`params[k]`) are updated by `delay(optimizer, tau_k)`
    with `tau_k = pipeline_delays(method, num_stages)[k]`. With DDG and the
    gradient of the whole model at the current parameters this is exactly what
    a DDG pipeline with stashed weights computes.

    >>> import jax.numpy as jnp, optax
    >>> tx = staged_delay(optax.sgd(1.0), "ddg", num_stages=2)
    >>> params = [jnp.zeros(1), jnp.zeros(1)]
    >>> updates, _ = tx.update([jnp.ones(1), jnp.ones(1)], tx.init(params), params)
    >>> updates  # stage 0 waits one update, stage 1 applies at once
    [Array([0.], dtype=float32), Array([-1.], dtype=float32)]
    """
    delays = pipeline_delays(method, num_stages)
    transforms = {k: delay(for_stage(optimizer, k), tau) for k, tau in enumerate(delays)}

    def labels(params):
        if not isinstance(params, (list, tuple)) or len(params) != num_stages:
            got = f"{len(params)}" if isinstance(params, (list, tuple)) else type(params).__name__
            raise ValueError(
                f"staged_delay expects a list of {num_stages} per-stage parameter trees, got {got}."
            )
        return type(params)(stage_labels(params))

    # Each stage's transform gets its own part of extra args shaped like the params
    # (stale_params for delay compensation).
    return optax.partition(transforms, labels, mask_compatible_extra_args=True)
