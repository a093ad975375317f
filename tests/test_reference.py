"""dgrad.reference, itself checked by hand: at K = 2 with SGD, every update is the whole
model's `jax.grad` at the weights of the iteration each paper names, written out per
method below (the reference computes it stage by stage, through VJPs and messages)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, batches, build_stages, whole_model_loss

from dgrad.reference import max_relative_error, reference_run

LR, STEPS = 0.1, 6


def _by_hand(rule, beta=1.0):
    """Stage k's weights at every iteration, when iteration t applies to stage k the
    gradient of batch `b` at weights `(w0 of iteration s0, w1 of iteration s1)`, for
    `rule(k, t) = (b, s0, s1)` or None; stage 0's gradient is scaled by `beta`."""
    data, grad = batches("mlp", STEPS), jax.grad(whole_model_loss(build_stages("mlp", 2)))
    initial = [nnx.to_pure_dict(nnx.state(s, nnx.Param)) for s in build_stages("mlp", 2)]
    history = [[initial[0]], [initial[1]]]
    for t in range(STEPS):
        for k in range(2):
            w = history[k][t]
            if rule(k, t) is not None:
                b, s0, s1 = rule(k, t)
                g = grad([history[0][s0], history[1][s1]], *data[b])[k]
                w = jax.tree.map(lambda a, d, s=LR * beta ** (1 - k): a - s * d, w, g)
            history[k].append(w)
    return history


RULES = {
    # every stage: this iteration's batch at this iteration's weights
    "bp": lambda k, t: (t, t, t),
    # stage 1 as BP; stage 0 the batch of t-1 at the weights that forwarded it
    "ddg": lambda k, t: (t, t, t) if k == 1 else (t - 1, t - 1, t - 1) if t >= 1 else None,
    # a stage updates, then forwards batch t-k with the weights just updated (index t+1):
    # stage 1 backs batch t-1, which stage 0 forwarded in t-1 at w0 of t, at its w1 of t;
    # stage 0 gets that backward one iteration later and backs it at its stashed w0
    "fdg": lambda k, t: (
        ((t - 1, t, t) if t >= 1 else None)
        if k == 1
        else ((t - 2, t - 1, t - 1) if t >= 2 else None)
    ),
}


@pytest.mark.parametrize("method, beta", [("bp", 1.0), ("ddg", 1.0), ("fdg", 1.0), ("fdg", 0.5)])
def test_the_reference_applies_each_papers_gradient(method, beta):
    ref = reference_run(
        build_stages("mlp", 2),
        batches("mlp", STEPS),
        method=method,
        optimizer=optax.sgd(LR),
        beta=beta,
    )
    history = _by_hand(RULES[method], beta)
    assert_close(ref.history, history, rtol=1e-5, atol=1e-6)
    # the loss is the last stage's, of the batch it backs, at the weights it backs it at
    loss, data = whole_model_loss(build_stages("mlp", 2)), batches("mlp", STEPS)
    for t, value in enumerate(ref.losses):
        rule = RULES[method](1, t)
        assert (value is None) == (rule is None)
        if rule is not None:
            b, s0, s1 = rule
            expected = loss([history[0][s0], history[1][s1]], *data[b])
            np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_the_hand_computation_can_fail():
    """DDG's stage 0 at fresh weights (the rule without its staleness) is another run."""
    ref = reference_run(
        build_stages("mlp", 2), batches("mlp", STEPS), method="ddg", optimizer=optax.sgd(LR)
    )
    fresh = _by_hand(lambda k, t: (t, t, t) if k == 1 else (t - 1, t, t) if t >= 1 else None)
    assert max_relative_error(ref.history[0][-1], fresh[0][-1]) > 1e-3
    assert max_relative_error(ref.history[0][-1], _by_hand(RULES["ddg"])[0][-1]) < 1e-5


def test_max_relative_error_is_the_worst_leaf():
    a = {"w": np.array([1.0, 2.0]), "b": np.array([4.0])}
    b = {"w": np.array([1.0, 2.2]), "b": np.array([4.0])}
    assert max_relative_error(a, b) == pytest.approx(0.2 / 2.2, rel=1e-6)
    assert max_relative_error(a, a) == 0.0
