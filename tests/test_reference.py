"""dgrad.reference, itself checked by hand: with SGD, every update is the whole model's
`jax.grad` at the weights of the iteration each paper names, written out per method below
(the reference computes it stage by stage, through VJPs and messages)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, batches, build_stages, whole_model_loss

from dgrad.reference import max_relative_error, reference_run

LR, STEPS = 0.1, 8


def bp(K, k, t):
    """Every stage: this iteration's batch at this iteration's weights."""
    return t, [t] * K


def ddg(K, k, t):
    """Stage k: the batch of K-1-k iterations ago, at the weights that forwarded it."""
    b = t - (K - 1 - k)
    return (b, [b] * K) if b >= 0 else None


def fdg(K, k, t):
    """Stage k backs batch t-2K+2+k. Stage j forwarded that batch in iteration b+j after
    updating (weights of index b+j+1), the last stage in b+K-1 before its update; each
    stage backs it at the weights it forwarded it with."""
    b = t - 2 * K + 2 + k
    return (b, [b + j + 1 for j in range(K - 1)] + [b + K - 1]) if b >= 0 else None


def _by_hand(K, rule, beta=1.0):
    """Stage k's weights at every iteration, when iteration t applies to stage k the
    gradient of batch `b` at the weights `w_j of iteration s[j]`, for `rule(K, k, t) =
    (b, s)` or None; stage k's gradient is scaled by `beta ** (K - 1 - k)`."""
    data, grad = batches("mlp", STEPS), jax.grad(whole_model_loss(build_stages("mlp", K)))
    history = [[nnx.to_pure_dict(nnx.state(s, nnx.Param))] for s in build_stages("mlp", K)]
    for t in range(STEPS):
        for k in range(K):
            w = history[k][t]
            if rule(K, k, t) is not None:
                b, s = rule(K, k, t)
                g = grad([history[j][s[j]] for j in range(K)], *data[b])[k]
                w = jax.tree.map(lambda a, d, f=LR * beta ** (K - 1 - k): a - f * d, w, g)
            history[k].append(w)
    return history


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize(
    "method, rule, beta", [("bp", bp, 1.0), ("ddg", ddg, 1.0), ("fdg", fdg, 1.0), ("fdg", fdg, 0.5)]
)
def test_the_reference_applies_each_papers_gradient(K, method, rule, beta):
    data = batches("mlp", STEPS)
    ref = reference_run(
        build_stages("mlp", K), data, method=method, optimizer=optax.sgd(LR), beta=beta
    )
    history = _by_hand(K, rule, beta)
    assert_close(ref.history, history, rtol=1e-5, atol=1e-6)
    assert ref.gradient_batches == [
        [None if rule(K, k, t) is None else rule(K, k, t)[0] for t in range(STEPS)]
        for k in range(K)
    ]
    # the loss is the last stage's, of the batch it backs, at the weights it backs it at
    loss = whole_model_loss(build_stages("mlp", K))
    assert len(ref.losses) == STEPS
    for t, value in enumerate(ref.losses):
        backed = rule(K, K - 1, t)
        assert (value is None) == (backed is None)
        if backed is not None:
            b, s = backed
            expected = loss([history[j][s[j]] for j in range(K)], *data[b])
            np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_the_hand_computation_can_fail():
    """DDG's stage 0 at fresh weights (the rule without its staleness) is another run, and
    so is FDG's stage 0 at K = 3 shrunk by beta once, not by beta ** (K - 1 - k)."""
    ref = reference_run(
        build_stages("mlp", 2), batches("mlp", STEPS), method="ddg", optimizer=optax.sgd(LR)
    )
    fresh = _by_hand(2, lambda K, k, t: (t - 1, [t, t]) if k == 0 and t >= 1 else ddg(K, k, t))
    assert max_relative_error(ref.history[0][-1], fresh[0][-1]) > 1e-3
    assert max_relative_error(ref.history[0][-1], _by_hand(2, ddg)[0][-1]) < 1e-5
    shrunk = reference_run(
        build_stages("mlp", 3),
        batches("mlp", STEPS),
        method="fdg",
        optimizer=optax.sgd(LR),
        beta=0.5,
    )
    once = _by_hand(3, fdg, beta=0.5 ** (1 / 2))  # stage 0: 0.5 ** 1, not 0.5 ** 2
    assert max_relative_error(shrunk.history[0][-1], once[0][-1]) > 1e-3


def test_max_relative_error_is_the_worst_leaf():
    a = {"w": np.array([1.0, 2.0]), "b": np.array([4.0])}
    b = {"w": np.array([1.0, 2.2]), "b": np.array([4.0])}
    assert max_relative_error(a, b) == pytest.approx(0.2 / 2.2, rel=1e-6)
    assert max_relative_error(a, a) == 0.0
