"""Delay-dependent Nesterov momentum (Ajanthan et al., ICML 2025).

"Nesterov Method for Asynchronous Pipeline Parallel Optimization" corrects
stale gradients in an asynchronous (PipeDream-style) pipeline with a Nesterov
look-ahead whose momentum grows with the stage's delay (arXiv 2505.01099). This
module follows the authors' code (github PluralisResearch/AsyncPP); the paper's equations
were not available when it was written, so where the two might differ is
unchecked. In the code:

- `main_with_runtime.py` (lines 306-330): stage k keeps `num_versions =
  num_warmup_minibatches + 1` weight versions, and `num_warmup_minibatches` is
  K-1-k with one rank per stage (`runtime/runtime.py`, lines 170-179), i.e. the
  stage's delay tau. With `--adaptive_momentum` the stage's momentum is
  `b1_k = b1 + (num_versions - 1) * (0.99 - b1) / num_stages`, that is

      b1_k = b1 + tau * (b1_target - b1) / K,   b1_target = 0.99.

- `main_with_runtime.py` (lines 342-351) and `optim/optimizer.py` (line 48):
  every stage steps `torch.optim.NAdam(lr, betas=(b1_k, 0.999),
  weight_decay=0.01, decoupled_weight_decay=True, momentum_decay=0.004)`
  (eps is torch's default 1e-8). Its update t = 1, 2, ... (torch's NAdam; psi is
  `momentum_decay`, lr_t the learning rate of update t) is

      mu_t    = b1_k * (1 - 0.5 * 0.96 ** (t * psi))      (Nesterov momentum schedule)
      P_t     = mu_1 * ... * mu_t
      m_t     = b1_k * m_{t-1} + (1 - b1_k) * g_t
      v_t     = b2 * v_{t-1} + (1 - b2) * g_t ** 2
      w_t     = w_{t-1} * (1 - lr_t * weight_decay)
                - lr_t * ((1 - mu_t) / (1 - P_t) * g_t
                          + mu_{t+1} / (1 - P_t * mu_{t+1}) * m_t)
                  / (sqrt(v_t / (1 - b2 ** t)) + eps)

  The look-ahead is the `mu_{t+1} * m_t` term: the step already takes the next
  update's share of the momentum.

`async_nesterov` is exactly this, with the defaults of the code. Choices made
here, where the code leaves room:

- `momentum_decay=None` uses a constant `mu_t = b1_k` (Dozat's simplified
  NAdam), which is `optax.nadamw` with `b1 = b1_k`. torch has no such setting
  (`momentum_decay=0` gives `mu_t = b1_k / 2`).
- The published run script (`run.bash`, "Ours") passes `--momentum 0.99`
  without `--adaptive_momentum`: every stage then uses b1_k = 0.99, which is
  also what the formula gives for b1 = 0.99. The delay-dependent coefficient
  matters only for b1 != 0.99; the default here is the code's `--momentum`
  default, 0.9, so that the correction acts.
- In PipeDream the deepest delay is K-1, below the formula's denominator K, so
  `b1_k` stays between b1 and 0.99. FDG's deepest staleness is 2K-3: over K,
  `b1_k` would reach 0.99 at K = 3 and pass 1 from K = 4 (b1 = 0.9). So
  `async_nesterov` requires `delay < num_stages`, and `async_nesterov_for`
  passes the deepest staleness + 1 as the denominator: K for DDG (the code's
  value), 2K-2 for FDG.
- The run script clips each stage's gradient norm at 10 before the step; chain
  `optax.clip_by_global_norm(10.0)` in front to do the same. The code's
  pipeline stashes weights (PipeDream), as `Pipeline(weights="stash")` does.
  Scalars are computed in float32 here (torch uses Python floats, float64).

>>> [round(stage_momentum(tau, num_stages=4), 4) for tau in (3, 2, 1, 0)]  # DDG, K = 4
[0.9675, 0.945, 0.9225, 0.9]
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dgrad.checks import integer, non_negative, unit_interval
from dgrad.schedule import Schedule


class AsyncNesterovState(NamedTuple):
    """State of `scale_by_async_nesterov`.

    Attributes:
      count: updates made so far.
      mu: running mean of the gradients, decayed by the stage's momentum b1_k.
      nu: running mean of the squared gradients, decayed by b2.
      mu_product: the product of the Nesterov momentum schedule so far,
        `mu_1 * ... * mu_count` (1 before the first update).

    >>> import jax.numpy as jnp
    >>> scale_by_async_nesterov(delay=0, num_stages=1).init(jnp.zeros(2))
    AsyncNesterovState(count=Array(0, dtype=int32), mu=Array([0., 0.], dtype=float32), ...)
    """

    count: jax.Array
    mu: Any
    nu: Any
    mu_product: jax.Array


def stage_momentum(delay: int, num_stages: int, b1: float = 0.9, b1_target: float = 0.99) -> float:
    """The momentum of a stage with delay `delay`: `b1 + delay * (b1_target - b1) / num_stages`.

    Args:
      delay: the stage's weight staleness in updates (K-1-k for DDG stage k).
      num_stages: the formula's denominator, the pipeline's stage count in the
        authors' code; must exceed `delay`.
      b1: the momentum of a stage without delay.
      b1_target: the momentum the formula approaches as the delay nears
        `num_stages` (0.99 in the code).

    Returns:
      The stage's momentum, in [0, 1).

    >>> round(stage_momentum(2, num_stages=4), 4), stage_momentum(0, num_stages=4)
    (0.945, 0.9)
    >>> stage_momentum(4, num_stages=4)
    Traceback (most recent call last):
        ...
    ValueError: delay (4) must be smaller than num_stages (4), as every PipeDream delay ...
    """
    integer("num_stages", num_stages, minimum=1, what="an integer >= 1")
    integer("delay", delay, what="a non-negative integer number of updates")
    if delay >= num_stages:
        raise ValueError(
            f"delay ({delay}) must be smaller than num_stages ({num_stages}), as every PipeDream "
            "delay (K-1-k) is; for FDG use async_nesterov_for(lr, 'fdg', K), which passes the "
            "deepest staleness + 1 as num_stages."
        )
    b1 = unit_interval("b1", b1)
    b1_target = unit_interval("b1_target", b1_target)
    return b1 + int(delay) * (b1_target - b1) / int(num_stages)


def scale_by_async_nesterov(
    delay: int,
    num_stages: int,
    b1: float = 0.9,
    b1_target: float = 0.99,
    b2: float = 0.999,
    eps: float = 1e-8,
    momentum_decay: float | None = 0.004,
) -> optax.GradientTransformation:
    """Rescales gradients by NAdam with the stage's delay-dependent momentum.

    The direction of `async_nesterov` before weight decay and learning rate:
    `((1 - mu_t) / (1 - P_t) * g_t + mu_{t+1} / (1 - P_t * mu_{t+1}) * m_t)
    / (sqrt(v_t / (1 - b2 ** t)) + eps)`, see the module docstring.

    Args:
      delay: the stage's delay; with `num_stages`, `b1` and `b1_target` it gives the
        momentum b1_k, see `stage_momentum`.
      num_stages: K, see `stage_momentum`.
      b1: the momentum of a stage without delay, see `stage_momentum`.
      b1_target: the momentum the formula approaches, see `stage_momentum`.
      b2: decay of the running mean of squared gradients.
      eps: added to the root of the second moment.
      momentum_decay: psi in torch's NAdam schedule
        `mu_t = b1_k * (1 - 0.5 * 0.96 ** (t * psi))`; None for `mu_t = b1_k`.

    Returns:
      An `optax.GradientTransformation` with state `AsyncNesterovState`.

    >>> import jax.numpy as jnp, optax
    >>> tx = scale_by_async_nesterov(delay=1, num_stages=2, momentum_decay=None)  # b1_k = 0.945
    >>> updates, state = tx.update(jnp.array([1.0, -2.0]), tx.init(jnp.zeros(2)))
    >>> updates, state.count
    (Array([ 1.4858515, -1.4858515], dtype=float32), Array(1, dtype=int32))
    >>> adam = optax.scale_by_adam(b1=0.945, nesterov=True)  # the same direction
    >>> adam.update(jnp.array([1.0, -2.0]), adam.init(jnp.zeros(2)))[0]
    Array([ 1.4858514, -1.4858514], dtype=float32)
    """
    momentum = stage_momentum(delay, num_stages, b1, b1_target)
    b2 = unit_interval("b2", b2)
    eps = non_negative("eps", eps)
    if momentum_decay is not None:
        momentum_decay = non_negative("momentum_decay", momentum_decay)

    def nesterov_momentum(t):
        if momentum_decay is None:
            return jnp.asarray(momentum, jnp.float32)
        return momentum * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))

    def init_fn(params):
        return AsyncNesterovState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
            mu_product=jnp.ones([], jnp.float32),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)
        mu_now, mu_next = nesterov_momentum(t), nesterov_momentum(t + 1)
        mu_product = state.mu_product * mu_now
        gradient_scale = (1 - mu_now) / (1 - mu_product)
        moment_scale = mu_next / (1 - mu_product * mu_next)
        second_moment_correction = 1 - b2**t
        mu = optax.tree.update_moment(updates, state.mu, momentum, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)

        def direction(g, m, v):
            numerator = gradient_scale.astype(g.dtype) * g + moment_scale.astype(m.dtype) * m
            return numerator / (jnp.sqrt(v / second_moment_correction.astype(v.dtype)) + eps)

        updates = jax.tree.map(direction, updates, mu, nu)
        return updates, AsyncNesterovState(count, mu, nu, mu_product)

    return optax.GradientTransformation(init_fn, update_fn)


def async_nesterov(
    learning_rate: optax.ScalarOrSchedule,
    delay: int,
    num_stages: int,
    *,
    b1: float = 0.9,
    b1_target: float = 0.99,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    momentum_decay: float | None = 0.004,
    mask: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """NAdamW whose momentum grows with the stage's delay (Ajanthan et al. 2025).

    Stage k of a K-stage pipeline with weight staleness tau_k takes
    `async_nesterov(lr, delay=tau_k, num_stages=K)` (DDG: tau_k = K-1-k), or
    all stages at once `async_nesterov_for(lr, method, K)`. The defaults are
    those of the authors' code. With delay 0 and `momentum_decay=None` it is
    `optax.nadamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)`.
    It does not delay gradients itself: on one device wrap it in
    `dgrad.optim.delay(..., tau)` to simulate the staleness.

    Args:
      learning_rate: a float or an optax schedule of the update count.
      delay: the stage's weight staleness in updates; must be below `num_stages`.
      num_stages: the denominator of the momentum formula, the stage count K.
      b1: the momentum of a stage without delay (the code's `--momentum`).
      b1_target: the momentum approached as the delay nears `num_stages` (0.99).
      b2: decay of the running mean of squared gradients.
      eps: added to the root of the second moment.
      weight_decay: decoupled weight decay, `w <- w - lr * weight_decay * w`.
      momentum_decay: psi of torch's NAdam momentum schedule; None for constant momentum.
      mask: which parameters weight decay applies to, as in `optax.adamw`.

    Returns:
      An `optax.GradientTransformationExtraArgs`, the chain of
      `scale_by_async_nesterov`, `optax.add_decayed_weights` and
      `optax.scale_by_learning_rate`.

    >>> import jax.numpy as jnp
    >>> tx = async_nesterov(0.1, delay=1, num_stages=2, weight_decay=0.0, momentum_decay=None)
    >>> params = jnp.array([1.0])
    >>> updates, state = tx.update(jnp.array([2.0]), tx.init(params), params)
    >>> state[0].mu  # (1 - b1_k) * g with b1_k = 0.9 + 1 * (0.99 - 0.9) / 2 = 0.945
    Array([0.11...], dtype=float32)
    >>> updates  # first step: -lr * (1 + b1_k / (1 + b1_k)) * g / |g|, with the look-ahead
    Array([-0.1485...], dtype=float32)
    """
    if isinstance(learning_rate, numbers.Real):
        non_negative("learning_rate", learning_rate)
    weight_decay = non_negative("weight_decay", weight_decay)
    return optax.chain(
        scale_by_async_nesterov(delay, num_stages, b1, b1_target, b2, eps, momentum_decay),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def async_nesterov_for(
    learning_rate: optax.ScalarOrSchedule, method: str, num_stages: int, **options
) -> Callable[[int], optax.GradientTransformationExtraArgs]:
    """The per-stage factory `k -> async_nesterov(...)` for a BP, DDG or FDG pipeline.

    Stage k gets `delay=Schedule(method, K).weight_staleness(k)` and, as the
    formula's denominator, the deepest stage's staleness + 1: K for DDG, as in
    the authors' code, 2K-2 for FDG (K >= 2), so the momentum stays below
    `b1_target` there too. All stages are built (and their arguments checked)
    at once.

    Args:
      learning_rate: as in `async_nesterov`.
      method: "bp", "ddg" or "fdg".
      num_stages: K, the pipeline's number of stages.
      **options: keyword arguments of `async_nesterov` (b1, weight_decay, ...).

    Returns:
      A function from the stage index to its transformation, for
      `Pipeline(..., optimizer=...)`.

    >>> import jax.numpy as jnp
    >>> tx = async_nesterov_for(1e-3, "fdg", num_stages=3)(0)  # staleness 3 of 3 + 1
    >>> _, state = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)), jnp.zeros(1))
    >>> state[0].mu  # (1 - b1_0) * g with b1_0 = 0.9 + 3 * (0.99 - 0.9) / 4 = 0.9675
    Array([0.0325...], dtype=float32)
    """
    schedule = Schedule(method, num_stages)
    delays = [schedule.weight_staleness(k) for k in range(num_stages)]
    denominator = max(delays) + 1
    transforms = [async_nesterov(learning_rate, tau, denominator, **options) for tau in delays]

    def of_stage(stage: int) -> optax.GradientTransformationExtraArgs:
        last = num_stages - 1
        integer("stage", stage, maximum=last, what=f"a stage index in 0..{last}")
        return transforms[stage]

    return of_stage
