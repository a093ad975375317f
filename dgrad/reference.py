"""A plain single-device reference of every method, for checking the engine.

BP, DDG and FDG pass no messages: the reference keeps every stage's weights at
every iteration, `W[k][t]`, and for each update recomputes the gradient of the
batch the schedule names: forward through all stages with the weights each
stage used for that batch and backward with the weights each stage
back-propagated with, multiplying the received cotangent by beta at every stage
but the last (the shrinking exactly as FDG describes it).

Features Replay (`method="fr"`) is written out as its paper and code state it,
module by module; the engine runs it as DDG with current weights and
recomputation, and the tests check the two agree. DGL (`method="dgl"`) is its
definition: batch by batch, each stage takes a step on its own auxiliary loss
and hands its output on. GPipe, 1F1B (interleaved or not), zero-bubble and
PipeDream-2BW are backprop over the microbatches of each batch, at the current
weights or (2BW) at the weights of one version before; PipeDream is DDG with
stashed weights. The maths of each stage and loss is jitted, only to keep the tests
fast; which batch meets which weights, and when, is plain Python.

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
from dgrad.options import MICROBATCHED, Options
from dgrad.schedule import Schedule


@dataclasses.dataclass
class ReferenceRun:
    """What `reference_run` computed.

    Attributes:
      history: `history[k][t]`, stage k's parameters at the start of iteration t
        (t = 0 .. T), as plain nested dicts of arrays like a pipeline's.
      rests: each stage's final non-parameter state (BatchNorm statistics), alike.
      losses: `losses[t]`, the loss the last stage took in iteration t (None
        while an FDG pipeline fills).
      gradient_batches: `gradient_batches[k][t]`, the batch whose gradient stage
        k applied in iteration t, or None.

    >>> import jax.numpy as jnp, optax
    >>> from dgrad import models
    >>> batches = [(jnp.ones((2, 4)), jnp.array([0, 1]))] * 3
    >>> run = reference_run(models.mlp([4, 8, 3], num_stages=2), batches, method="fdg",
    ...                     optimizer=optax.sgd(0.1))
    >>> len(run.history), len(run.history[0]), run.gradient_batches  # 2 stages, 3 iterations + 1
    (2, 4, [[None, None, 0], [None, 0, 1]])
    >>> run.losses[0], run.losses[1] is not None  # FDG: the loss stage starts at iteration 1
    (None, True)
    """

    history: list[list[Any]]
    rests: list[Any]
    losses: list[Any]
    gradient_batches: list[list[int | None]]

    def __post_init__(self):
        is_state = lambda node: isinstance(node, nnx.State)  # noqa: E731
        self.history, self.rests = jax.tree.map(
            lambda node: nnx.to_pure_dict(node) if is_state(node) else node,
            (self.history, self.rests),
            is_leaf=is_state,
        )

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
    predict: str | None = None,
    predict_lr: float | None = None,
    microbatches: int = 1,
    virtual_stages: int = 1,
) -> ReferenceRun:
    """Trains `stages` on `batches` by the definition of `method` (`microbatches`: the
    parts gpipe, 1f1b, zb and 2bw cut each batch into; `virtual_stages` changes only the
    order: interleaved 1F1B's numbers are GPipe's on its chunks).

    The optimizer is the user's, without the shrinking transform: here
    shrinking is done to the cotangents instead. With `predict="momentum"` (or
    just `predict_lr`), a stage forwards with its weights predicted `tau`
    updates ahead from the momentum in its optimizer state at that moment (tau:
    its weight staleness); with `predict="update"`, with its weights moved on
    `tau` times by the difference of its last two weight versions.

    >>> import jax.numpy as jnp, optax
    >>> from dgrad import models
    >>> batches = [(jnp.ones((2, 4)) * i, jnp.array([0, 1])) for i in range(3)]
    >>> run = reference_run(models.mlp([4, 8, 3], num_stages=2), batches, method="fdg",
    ...                     optimizer=optax.sgd(0.1))
    >>> run.gradient_batches  # FDG: stage 0 applies batch 0's gradient in iteration 2
    [[None, None, 0], [None, 0, 1]]
    >>> run.losses[0] is None, len(run.params)  # nothing reached the loss in iteration 0
    (True, 2)
    """
    if method == "fr":
        return _features_replay(stages, batches, optimizer, loss_fn)
    if method == "dgl":
        return _greedy(stages, batches, optimizer, loss_fn)
    if method in MICROBATCHED:
        return _microbatched(
            stages, batches, optimizer, loss_fn, microbatches, one_version_old=method == "2bw"
        )
    predict = Options(method=method, predict=predict, predict_lr=predict_lr).predict
    if method == "pipedream":  # its weight versions are DDG's with stashing
        method, weights = "ddg", "stash"
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

        if K == 1:  # the input is the batch itself (tokens: integers), nothing to send back
            value, grad = jax.value_and_grad(loss)(params, x)
            return value, (grad, None)
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    forward_rest = {}  # (stage, batch) -> the rest the stage had when it forwarded the batch

    def forward_weights(j, b):
        after_update = 1 if schedule.updates_before_forward(j) else 0
        i = schedule.forward_iteration(j, b) + after_update
        tau = schedule.weight_staleness(j)
        if predict is None or tau == 0:
            return W[j][i]
        if predict == "update":  # a stale stage updates every iteration once it has begun
            last = W[j][i - 1] if i else W[j][i]
            return jax.tree.map(lambda w, v: w + tau * (w - v), W[j][i], last)
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


class _Modules:
    """The stages split into graph, current weights, statistics and optimizer state."""

    def __init__(self, stages, optimizer, loss_fn):
        self.graphs, self.W, self.R, self.opt, self.txs = [], [], [], [], []
        for k, module in enumerate(stages):
            copy = nnx.merge(*nnx.split(module))
            copy.train()
            graph, params, rest = nnx.split(copy, nnx.Param, ...)
            tx = optax.with_extra_args_support(for_stage(optimizer, k))
            self.graphs.append(graph)
            self.W.append(params)
            self.R.append(rest)
            self.opt.append(tx.init(params))
            self.txs.append(tx)
        self.loss_fn = loss_fn
        self.history = [[w] for w in self.W]
        self.apply = jax.jit(self._apply, static_argnums=0)

    def model(self, k, params, rest):
        return nnx.merge(self.graphs[k], params, rest, copy=True)

    def _apply(self, k, params, rest, x):
        """Stage k's output of `x` and its state after the forward."""
        model = self.model(k, params, rest)
        y = model(x)
        return y, nnx.split(model, nnx.Param, ...)[2]

    def forward(self, k, x):
        y, self.R[k] = self.apply(k, self.W[k], self.R[k], x)
        return y

    def update(self, k, grads):
        updates, self.opt[k] = self.txs[k].update(grads, self.opt[k], self.W[k])
        self.W[k] = optax.apply_updates(self.W[k], updates)

    def snapshot(self):
        for k, w in enumerate(self.W):
            self.history[k].append(w)


def _features_replay(stages, batches, optimizer, loss_fn) -> ReferenceRun:
    """Features Replay (Huo, Gu, Huang 2018) as its paper and code state it, for module k
    of K (0-indexed here), iteration t: forward batch t with the current weights and keep
    the input; the last module takes its loss and back-propagates at once; module k < K-1
    replays the forward of the input it kept K-1-k iterations ago with its current
    weights w_k^t, back-propagates the error gradient module k+1 sent at the end of
    iteration t-1, sends its input's gradient to module k-1 and updates."""
    m, K = _Modules(stages, optimizer, loss_fn), len(stages)
    kept = [dict() for _ in range(K)]  # module -> {batch: the input it forwarded}
    received = [None] * K  # module -> (batch, error gradient from module k+1)
    losses, applied = [], [[] for _ in range(K)]

    def loss(params, rest, h, labels):
        y, rest = m._apply(K - 1, params, rest, h)
        return m.loss_fn(y, labels)[0], rest

    @functools.partial(jax.jit, static_argnums=0)
    def replay_backward(k, params, rest, inputs, gradient):
        _, vjp = jax.vjp(lambda p, h: m._apply(k, p, rest, h)[0], params, inputs)
        return vjp(gradient)

    last_gradient = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))
    for t, (x, labels) in enumerate(batches):
        h = x
        for k in range(K - 1):
            kept[k][t] = h
            h = m.forward(k, h)
        (value, m.R[K - 1]), (last_grads, error) = last_gradient(m.W[K - 1], m.R[K - 1], h, labels)
        losses.append(value)
        grads, sent = {K - 1: last_grads}, [None] * K
        if K > 1:
            sent[K - 2] = (t, error)
        for k in range(K - 1):
            if received[k] is None:
                continue
            b, gradient = received[k]
            grads[k], input_gradient = replay_backward(k, m.W[k], m.R[k], kept[k].pop(b), gradient)
            if k > 0:
                sent[k - 1] = (b, input_gradient)
        for k in range(K):
            applied[k].append(None if k not in grads else (t if k == K - 1 else received[k][0]))
            if k in grads:
                m.update(k, grads[k])
        received = sent
        m.snapshot()
    return ReferenceRun(m.history, m.R, losses, applied)


def _greedy(stages, batches, optimizer, loss_fn) -> ReferenceRun:
    """DGL (Belilovsky, Eickenberg, Oyallon 2020), batch by batch: stage k < K-1 takes a
    step on the loss of its own auxiliary head and hands its output (from the weights
    before the step) to stage k+1; the last stage on the model's loss. In a pipeline
    stage k takes batch b in iteration b+k, so after T iterations it has seen T-k."""
    m, K, T = _Modules(stages, optimizer, loss_fn), len(stages), len(batches)
    losses = [None] * T
    snapshots = [[None] * (T + 1) for _ in range(K)]
    for k in range(K):
        snapshots[k][: k + 1] = [m.W[k]] * (k + 1)

    @functools.partial(jax.jit, static_argnums=0)
    def local_gradient(k, params, rest, h, labels):
        def loss(params):
            model = m.model(k, params, rest)
            if k == K - 1:
                y = logits = model(h)
            else:
                y, logits = model.auxiliary(h)
            value = m.loss_fn(logits, labels)[0]
            return value, (y, nnx.split(model, nnx.Param, ...)[2])

        return jax.value_and_grad(loss, has_aux=True)(params)

    for b, (x, labels) in enumerate(batches):
        h = x
        for k in range(K):
            if b + k >= T:
                break
            (value, (h, m.R[k])), grads = local_gradient(k, m.W[k], m.R[k], h, labels)
            m.update(k, grads)
            snapshots[k][b + k + 1] = m.W[k]
            if k == K - 1:
                losses[b + k] = value
    for k in range(K):  # iterations with nothing to do keep the weights
        for t in range(1, T + 1):
            if snapshots[k][t] is None:
                snapshots[k][t] = snapshots[k][t - 1]
    applied = [[t - k if t >= k else None for t in range(T)] for k in range(K)]
    return ReferenceRun(snapshots, m.R, losses, applied)


def _microbatched(stages, batches, optimizer, loss_fn, microbatches, one_version_old):
    """GPipe (and 1F1B-flush, the same numbers) and PipeDream-2BW, batch by batch: cut
    b_t into M microbatches of consecutive rows; forward each in turn through the whole
    model (BatchNorm normalises it with its own statistics and moves the running
    averages once per microbatch, in order) and take its gradient; every stage updates
    once with the mean of the M gradients. GPipe takes them at the current weights,
    W^{t+1} = U(W^t, g(W^t)); 2BW at the weights one version before,
    W^{t+1} = U(W^t, g(W^{t-1})), W^{-1} = W^0. 2BW has no flush: a stage whose
    backwards of b_t go on into iteration t+1 (`Schedule.gradient_delay`) holds W^t
    from then on, so its history is the recursion's one iteration later."""
    m, K = _Modules(stages, optimizer, loss_fn), len(stages)
    before = list(m.W)  # W^{t-1}
    losses, applied = [], [[] for _ in range(K)]

    def loss(params, rests, x, labels):
        h, new_rests = x, []
        for k in range(K):
            model = m.model(k, params[k], rests[k])
            h = model(h)
            new_rests.append(nnx.split(model, nnx.Param, ...)[2])
        return m.loss_fn(h, labels)[0], new_rests

    gradient = jax.jit(jax.value_and_grad(loss, has_aux=True))
    for t, (x, labels) in enumerate(batches):
        at = before if one_version_old else m.W
        size = len(x) // microbatches
        total, values = None, []
        for i in range(microbatches):
            rows = slice(i * size, (i + 1) * size)
            (value, m.R), grads = gradient(at, m.R, x[rows], labels[rows])
            total = grads if total is None else jax.tree.map(lambda a, b: a + b, total, grads)
            values.append(value)
        before = list(m.W)
        for k in range(K):
            mean = jax.tree.map(lambda g: g / microbatches, total[k])
            updates, m.opt[k] = m.txs[k].update(mean, m.opt[k], m.W[k], stale_params=at[k])
            m.W[k] = optax.apply_updates(m.W[k], updates)
            applied[k].append(t)
        losses.append(sum(values) / microbatches)
        m.snapshot()
    history = m.history
    if one_version_old:  # with no flush, a stage with backwards left applies g_t at t + 1
        schedule = Schedule("2bw", K, microbatches=microbatches)
        delays = [schedule.gradient_delay(k) for k in range(K)]
        history = [h[:1] * d + h[: len(h) - d] for h, d in zip(history, delays)]
        applied = [[None] * d + a[: len(a) - d] for a, d in zip(applied, delays)]
    return ReferenceRun(history, m.R, losses, applied)


def max_relative_error(a, b) -> float:
    """The largest over leaves of `max|a - b| / max|b|` for two pytrees of arrays.

    >>> import numpy as np
    >>> a = {"w": np.array([1.0, 2.0]), "b": np.array([4.0])}
    >>> b = {"w": np.array([1.0, 2.5]), "b": np.array([4.0])}
    >>> max_relative_error(a, b)  # |2.0 - 2.5| / 2.5
    0.2
    """

    def error(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) if y.size else 0.0

    return max(jax.tree.leaves(jax.tree.map(error, a, b)), default=0.0)
