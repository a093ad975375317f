"""The timetable against the papers' table, and the shrinking transform by hand."""

import jax
import jax.numpy as jnp
import optax
import pytest

from dgrad.optim import shrink
from dgrad.schedule import Schedule


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
def test_schedule_matches_the_design_table(K):
    t = 20
    for k in range(K):
        bp, ddg, fdg = (Schedule(m, K) for m in ("bp", "ddg", "fdg"))
        assert (bp.forward_batch(k, t), bp.backward_batch(k, t), bp.weight_staleness(k)) == (
            t,
            t,
            0,
        )
        assert (ddg.forward_batch(k, t), ddg.backward_batch(k, t)) == (t, t - (K - 1 - k))
        assert ddg.weight_staleness(k) == K - 1 - k
        assert (fdg.forward_batch(k, t), fdg.backward_batch(k, t)) == (t - k, t - 2 * K + 2 + k)
        assert fdg.gradient_delay(k) == 2 * (K - 1 - k)
        assert fdg.weight_staleness(k) == (2 * (K - 1 - k) - 1 if k < K - 1 else 0)
        assert fdg.shrink_depth(k) == K - 1 - k


def test_fdg_example_from_the_design_note():
    s, t = Schedule("fdg", 3), 10
    assert [(s.backward_batch(k, t), s.forward_batch(k, t)) for k in range(3)] == [
        (t - 4, t),
        (t - 3, t - 1),
        (t - 2, t - 2),
    ]


def test_fill_has_no_batches():
    s = Schedule("fdg", 3)
    assert [s.forward_batch(2, t) for t in range(3)] == [None, None, 0]
    assert [s.backward_batch(0, t) for t in range(5)] == [None] * 4 + [0]


@pytest.mark.parametrize("beta,depth", [(0.5, 0), (0.5, 3), (0.2, 1), (1.0, 4)])
def test_shrink_scales_by_beta_to_the_depth_under_jit(beta, depth):
    tx = shrink(beta, depth)
    grads = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(3.0)}
    updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
    assert jnp.allclose(updates["w"], jnp.array([1.0, -2.0]) * beta**depth)
    assert jnp.allclose(updates["b"], 3.0 * beta**depth)


def test_shrink_first_in_a_chain_leaves_the_weight_decay_unscaled():
    """The pipeline chains shrink before the user's optimizer; the engine's order is
    checked against the reference (FDG, beta 0.5, weight decay) in test_equivalence."""
    tx = optax.chain(shrink(0.5, 2), optax.add_decayed_weights(0.1), optax.sgd(1.0))
    params = {"w": jnp.array([2.0])}
    updates, _ = tx.update({"w": jnp.array([4.0])}, tx.init(params), params)
    assert jnp.allclose(updates["w"], -(0.25 * 4.0 + 0.1 * 2.0))


def test_shrink_with_beta_one_is_identity_bit_for_bit():
    grads = {"w": jnp.array([1.2345678, -3.3e-7])}
    updates, _ = shrink(1.0, 3).update(grads, optax.EmptyState())
    assert (updates["w"] == grads["w"]).all()


@pytest.mark.parametrize("depth", [-1, 1.5, True])
def test_shrink_rejects_bad_depth(depth):
    with pytest.raises(ValueError, match="depth must be a non-negative integer"):
        shrink(0.5, depth)
