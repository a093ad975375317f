"""The staleness probe: how far the gradients a delayed pipeline applies are from fresh ones.

On a probed step, for every stage k that applies a gradient (of batch b_k),
`Probe.measure` compares that gradient with the gradient of b_k's loss at the
current weights of every stage, and the current weights with those of b_k's
forward. It costs one backprop of the whole model per distinct batch b_k, on
the first stage's devices, and nothing on the steps it does not probe.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from dgrad.stage import Given, Vars

if TYPE_CHECKING:
    from dgrad.placement import Placement
    from dgrad.schedule import Schedule
    from dgrad.stage import LossFn, StageFunctions
    from dgrad.state import PipelineState, StageSpec


class Probe:
    """The probe of one pipeline's stages (see `Pipeline.probe` for what it measures): its
    stages' functions, the loss, where the stages live and the timetable.

    >>> import jax.numpy as jnp, optax
    >>> from dgrad import Pipeline, models
    >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="ddg",
    ...                 optimizer=optax.sgd(0.1), probe_every=1)
    >>> batch = (jnp.ones((4, 4)), jnp.array([0, 1, 2, 0]))
    >>> state, _ = pipe.step(pipe.init(batch), batch)
    >>> probe = Probe(pipe.stages, pipe.loss_fn, pipe.placement, pipe.schedule)
    >>> result = probe.measure(state, batch, pipe.specs)  # what pipe.probe(state, batch) does
    >>> sorted(result), sorted(result[0])
    ([0, 1], ['cosine', 'relative_difference', 'weight_drift'])
    """

    def __init__(
        self,
        stages: list[StageFunctions],
        loss_fn: LossFn,
        placement: Placement,
        schedule: Schedule,
    ):
        self.stages, self.placement, self.schedule = stages, placement, schedule
        self._fresh_gradients = jax.jit(functools.partial(_fresh_gradients, stages, loss_fn))
        self._compare = jax.jit(compare_gradients)

    def measure(
        self, state: PipelineState, batch, specs: list[StageSpec]
    ) -> dict[int, dict[str, jax.Array]]:
        """`Pipeline.probe`: each stage's applied gradient in the next `step(state, batch)`
        against a fresh one, and how far its weights drifted (`specs`: the stages' specs,
        as `Pipeline.init` made them).

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import Pipeline, models
        >>> pipe = Pipeline(models.mlp([4, 3], num_stages=1), method="bp",
        ...                 optimizer=optax.sgd(0.1), probe_every=1)
        >>> batch = (jnp.ones((2, 4)), jnp.array([0, 1]))
        >>> probe = Probe(pipe.stages, pipe.loss_fn, pipe.placement, pipe.schedule)
        >>> probe.measure(pipe.init(batch), batch, pipe.specs)  # BP's gradient: the fresh one
        {0: {'cosine': Array(1., dtype=float32), 'relative_difference': Array(0., ...), ...}}
        """
        t, move, schedule = state.step, self.placement.move, self.schedule
        known = {m.batch: (m.value, m.labels) for m in state.recent}
        known[t] = self.placement.put_batch(tuple(batch), 0)
        params = [move(s.params, k, 0) for k, s in enumerate(state.stages)]
        rests = [move(s.rest, k, 0) for k, s in enumerate(state.stages)]
        fresh_of, results = {}, {}
        if schedule.keeps_previous_weights:  # 2BW: every gradient at the version before
            previous = [move(s.previous, k, 0) for k, s in enumerate(state.stages)]
            at_previous = self._fresh_gradients(previous, rests, *known[t])
        for k in range(len(self.stages)):
            b = schedule.backward_batch(k, t)
            if b is None or b not in known:
                continue
            if b not in fresh_of:
                fresh_of[b] = self._fresh_gradients(params, rests, *known[b])
            if schedule.keeps_previous_weights:
                applied, drift = move(at_previous[k], 0, k), state.stages[k].previous
            else:
                applied, drift = self._applied_gradient(k, state, known, b, specs[k])
            fresh = fresh_of[b][k]
            if applied is None:
                applied = move(fresh, 0, k)
            now = state.stages[k].params
            if schedule.trains_locally(k):  # the head is not part of the model
                applied, fresh, drift, now = (tree["body"] for tree in (applied, fresh, drift, now))
            results[k] = self._compare(
                move(applied, k, 0), fresh, move(now, k, 0), move(drift, k, 0)
            )
        return results

    def _applied_gradient(self, k, state, known, batch, spec):
        """Stage k's gradient in the coming step (None where that step computes it from the
        current weights of every stage: the fresh gradient itself), and the weights of its
        batch's forward (NaN where the stage does not keep them)."""
        stage, last = state.stages[k], len(self.stages) - 1
        calls, given = self.stages[k].compile(spec.residual_layout), Given(stage.params, stage.rest)
        if self.schedule.trains_locally(k):
            if k == 0:
                x, labels = self.placement.move(known[batch], 0, k)
            else:
                x, labels = state.activations[k].value, state.activations[k].labels
            grads = calls.aux_gradient(Vars(), given.replace(x=x, labels=labels))[1].grads
            return grads, stage.params
        if k == last:
            message = state.activations[k]
            if message is None:  # its input is this step's forward at the current weights
                return None, stage.params
            given = given.replace(x=message.value, labels=message.labels)
            return calls.loss_gradient(Vars(), given)[1].grads, stage.params
        if batch not in stage.kept_batches:  # this step's forward at the current weights
            return None, stage.params
        record, received = stage.take(batch, k)[0], state.cotangents[k]
        given = given.replace(record=record, cotangent=received.value)
        grads = calls.gradient(Vars(), given)[1].grads
        forward_weights = getattr(record, "params", None)
        if forward_weights is None:
            forward_weights = jax.tree.map(lambda w: jnp.full_like(w, jnp.nan), stage.params)
        return grads, forward_weights


def _fresh_gradients(stages, loss_fn, params, rests, x, labels):
    """Every stage's gradient of the loss of (x, labels) at `params` (one backprop of
    the whole model; statistics are not updated)."""

    def loss(params):
        h = x
        for fns, p, r in zip(stages, params, rests):
            h, _ = fns.apply(p, r, h)
        return loss_fn(h, labels)[0]

    return jax.grad(loss)(params)


def _norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(tree)))


def compare_gradients(applied, fresh, now, forward_weights) -> dict[str, jax.Array]:
    """Cosine and relative difference of `applied` against `fresh`, and the drift of the
    weights `now` from `forward_weights`, relative to `now`.

    >>> import jax.numpy as jnp
    >>> r = compare_gradients(jnp.array([1.0, 0.0]), jnp.array([1.0, 1.0]),
    ...                       jnp.array([2.0, 0.0]), jnp.array([1.0, 0.0]))
    >>> [round(float(r[name]), 3) for name in ("cosine", "relative_difference", "weight_drift")]
    [0.707, 0.707, 0.5]
    """
    dot = sum(jnp.sum(a * f) for a, f in zip(jax.tree.leaves(applied), jax.tree.leaves(fresh)))
    difference = jax.tree.map(lambda a, f: a - f, applied, fresh)
    moved = jax.tree.map(lambda w, v: w - v, now, forward_weights)
    return {
        "cosine": dot / (_norm(applied) * _norm(fresh)),
        "relative_difference": _norm(difference) / _norm(fresh),
        "weight_drift": _norm(moved) / _norm(now),
    }
