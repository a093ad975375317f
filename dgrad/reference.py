"""A plain single-device reference for BP, DDG and FDG, for checking the engine.

It passes no messages. It keeps every stage's weights at every iteration,
`W[k][t]`, and for each update it recomputes the gradient of the batch the
schedule names: forward through all stages with the weights each stage used
for that batch and backward with the weights each stage back-propagated with,
multiplying the received cotangent by beta at every stage but the last (the
shrinking exactly as FDG describes it). Eager and slow, on purpose.

>>> import jax.numpy as jnp, optax
>>> from dgrad import models
>>> stages = models.mlp([4, 8, 3], num_stages=2)
>>> batches = [(jnp.ones((2, 4)) * i, jnp.array([0, 1])) for i in range(4)]
>>> run = reference_run(stages, batches, method="ddg", optimizer=optax.sgd(0.1))
>>> len(run.history[0]), run.losses[:1] != [None]
(5, True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from dgrad import losses
from dgrad.optim.per_stage import Optimizer, for_stage
from dgrad.optim.prediction import predict_weights
from dgrad.schedule import Schedule


@dataclasses.dataclass
class ReferenceRun:
    """What `reference_run` computed.

    Attributes:
      history: `history[k][t]`, stage k's parameters at the start of iteration t
        (t = 0 .. T).
      rests: each stage's final non-parameter state (BatchNorm statistics).
      losses: `losses[t]`, the loss the last stage took in iteration t (None
        while an FDG pipeline fills).
      gradient_batches: `gradient_batches[k][t]`, the batch whose gradient stage
        k applied in iteration t, or None.
    """

    history: list[list[Any]]
    rests: list[Any]
    losses: list[Any]
    gradient_batches: list[list[int | None]]

    @property
    def params(self) -> list[Any]:
        return [h[-1] for h in self.history]


def reference_run(
    stages: Sequence[nnx.Module],
    batches: Sequence[tuple[Any, Any]],
    *,
    method: str,
    optimizer: Optimizer,
    beta: float = 1.0,
    weights: str = "stash",
    loss_fn=losses.softmax_cross_entropy,
    predict_lr: float | None = None,
) -> ReferenceRun:
    """Trains `stages` on `batches` by the definition of `method`.

    The optimizer is the user's, without the shrinking transform: here
    shrinking is done to the cotangents instead. With `predict_lr`, a stage
    forwards with its weights predicted `tau` updates ahead from the momentum
    in its optimizer state at that moment (tau: its weight staleness).
    """
    K = len(stages)
    schedule = Schedule(method, K)
    graphs, W, R, opt_history, txs = [], [], [], [], []
    for k, module in enumerate(stages):
        copy = nnx.merge(*nnx.split(module))
        copy.train()
        graph, params, rest = nnx.split(copy, nnx.Param, ...)
        tx = optax.with_extra_args_support(for_stage(optimizer, k))
        graphs.append(graph)
        W.append([params])
        R.append(rest)
        opt_history.append([tx.init(params)])
        txs.append(tx)

    def apply(j, params, rest, x):
        model = nnx.merge(graphs[j], params, rest, copy=True)
        y = model(x)
        return y, nnx.split(model, nnx.Param, ...)[2]

    # Jitted only to keep the tests fast; each is one stage's textbook maths.
    forward = jax.jit(apply, static_argnums=0)

    @functools.partial(jax.jit, static_argnums=0)
    def backward(j, params, rest, x, cotangent):
        _, vjp = jax.vjp(lambda p, h: apply(j, p, rest, h)[0], params, x)
        return vjp(cotangent)

    @jax.jit
    def loss_gradient(params, rest, x, labels):
        def loss(params, x):
            return loss_fn(apply(K - 1, params, rest, x)[0], labels)[0]

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    forward_rest = {}  # (stage, batch) -> the rest the stage had when it forwarded the batch

    def forward_weights(j, b):
        after_update = 1 if schedule.updates_before_forward(j) else 0
        i = schedule.forward_iteration(j, b) + after_update
        tau = schedule.weight_staleness(j)
        if predict_lr is None or tau == 0:
            return W[j][i]
        return predict_weights(W[j][i], opt_history[j][i], tau, predict_lr)

    def backward_weights(j, b):
        if weights == "stash":
            return forward_weights(j, b)
        return W[j][schedule.backward_iteration(j, b)]

    def activations(b, upto):
        """Inputs of stages 0..upto for batch b, each stage using its forward weights."""
        xs = [batches[b][0]]
        for j in range(upto):
            xs.append(forward(j, forward_weights(j, b), forward_rest[(j, b)], xs[-1])[0])
        return xs

    def stage_gradient(k, b):
        """Stage k's gradient of batch b's loss, and that loss."""
        xs = activations(b, K - 1)
        last = K - 1
        loss, (grad, cotangent) = loss_gradient(
            backward_weights(last, b), forward_rest[(last, b)], xs[last], batches[b][1]
        )
        for j in range(last - 1, k - 1, -1):
            grad, cotangent = backward(
                j, backward_weights(j, b), forward_rest[(j, b)], xs[j], beta * cotangent
            )
        return grad, loss

    loss_history, gradient_batches = [], [[] for _ in range(K)]
    for t in range(len(batches)):
        # The BatchNorm statistics each forward of this iteration starts from.
        for j in range(K):
            b = schedule.forward_batch(j, t)
            if b is not None:
                forward_rest[(j, b)] = R[j]
        updates = {}
        loss_history.append(None)
        for k in range(K):
            b = schedule.backward_batch(k, t)
            gradient_batches[k].append(b)
            if b is None:
                continue
            grad, loss = stage_gradient(k, b)
            if k == K - 1:
                loss_history[t] = loss
            updates[k] = grad
        for k in range(K):
            if k in updates:
                b = schedule.backward_batch(k, t)
                delta, opt_state = txs[k].update(
                    updates[k], opt_history[k][t], W[k][t], stale_params=backward_weights(k, b)
                )
                W[k].append(optax.apply_updates(W[k][t], delta))
                opt_history[k].append(opt_state)
            else:
                W[k].append(W[k][t])
                opt_history[k].append(opt_history[k][t])
        for j in range(K):
            b = schedule.forward_batch(j, t)
            if b is not None:
                x = activations(b, j)[j]
                R[j] = forward(j, forward_weights(j, b), forward_rest[(j, b)], x)[1]
    return ReferenceRun(W, R, loss_history, gradient_batches)


def max_relative_error(a, b) -> float:
    """The largest over leaves of `max|a - b| / max|b|` for two pytrees of arrays."""

    def error(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) if y.size else 0.0

    return max(jax.tree.leaves(jax.tree.map(error, a, b)), default=0.0)
