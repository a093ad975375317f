"""Optax transforms for delayed-gradient training, usable in any optax loop.

- `shrink(beta, depth)`: scales gradients by beta**depth (FDG, Zhuang et al. 2019).
- `delay(inner, tau)`, `delayed(tau)`: apply the gradient from tau updates ago
  (stale-gradient SGD, DDG); `staged_delay(opt, method, K)` gives each stage of
  a list of per-stage parameters its BP/DDG/FDG weight staleness.
- `delay_compensation(lam, adaptive=False)`: g + lam * g * g * (w_now - w_stale)
  (DC-ASGD, Zheng et al. 2017); `reads_stale_params(tx, params)` says whether a
  transform reads the `stale_params` it is passed.
- `predict_weights(params, opt_state, tau, lr)`: w - tau * lr * momentum
  (SpecTrain, Chen et al. 2018; PipeMare, Yang et al. 2021);
  `extrapolate_weights(params, opt_state, tau)`: w + tau * the last update, for any
  optimizer wrapped in `remember_update(tx)` (AdamW, Muon, ...).
- `pipemare_rescale(tau, horizon)`: step scaled by tau**(-p_t), p_t from 1 to 0 (PipeMare).
- `accumulate(inner, every, total=False)`: averages (or sums) `every` gradients per step
  (`optax.MultiSteps`; ADL).
- `async_nesterov(lr, delay, K)`, `async_nesterov_for(lr, method, K)`: NAdamW whose momentum
  grows with the stage's delay, b1 + delay * (0.99 - b1) / K (Ajanthan et al. 2025).

In a pipeline, pass them per stage: `Pipeline(..., optimizer=lambda k: ...)`.

>>> import jax, jax.numpy as jnp, optax
>>> tx = delay(optax.sgd(0.1), tau=2)
>>> params = jnp.array([1.0, 2.0])
>>> state = tx.init(params)
>>> for _ in range(5):
...     grads = jax.grad(lambda p: jnp.sum(p ** 2))(params)  # gradient at current weights
...     updates, state = tx.update(grads, state, params)
...     params = optax.apply_updates(params, updates)
>>> params  # three updates, each with the gradient from two updates earlier
Array([0.40000004, 0.8000001 ], dtype=float32)
"""

from dgrad.optim.compensation import (
    DelayCompensationState,
    delay_compensation,
    reads_stale_params,
)
from dgrad.optim.delay import (
    DelayState,
    delay,
    delayed,
    pipeline_delays,
    stage_labels,
    staged_delay,
)
from dgrad.optim.nesterov import (
    AsyncNesterovState,
    async_nesterov,
    async_nesterov_for,
    scale_by_async_nesterov,
    stage_momentum,
)
from dgrad.optim.prediction import (
    RememberUpdateState,
    extrapolate_weights,
    last_update_of,
    momentum_of,
    predict_weights,
    remember_update,
)
from dgrad.optim.schedules import PipeMareState, accumulate, pipemare_rescale
from dgrad.optim.shrink import shrink

__all__ = [
    "AsyncNesterovState",
    "DelayCompensationState",
    "DelayState",
    "PipeMareState",
    "RememberUpdateState",
    "accumulate",
    "async_nesterov",
    "async_nesterov_for",
    "delay",
    "delay_compensation",
    "delayed",
    "extrapolate_weights",
    "last_update_of",
    "momentum_of",
    "pipeline_delays",
    "pipemare_rescale",
    "predict_weights",
    "reads_stale_params",
    "remember_update",
    "scale_by_async_nesterov",
    "shrink",
    "stage_labels",
    "stage_momentum",
    "staged_delay",
]
