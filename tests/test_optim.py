"""dgrad.optim against hand computation, under jit, and plugged into the engine."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_close,
    assert_equal,
    batches,
    build_stages,
    layouts,
    params_of,
    reference,
    run_pipeline,
)

import dgrad
from dgrad import optim


def _run(tx, grads, params=None, jit=True, **extra):
    params = jnp.zeros_like(grads[0]) if params is None else params
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    out = []
    for g in grads:
        updates, state = update(g, state, params, **extra)
        out.append(updates)
    return out, state


@pytest.mark.parametrize("tau", [1, 2, 3])
def test_delay_applies_the_gradient_from_tau_updates_ago(tau):
    grads = [jnp.array([float(i + 1), -float(i)]) for i in range(8)]
    out, _ = _run(optim.delay(optax.sgd(0.5), tau), grads)
    for t, updates in enumerate(out):
        expected = -0.5 * grads[t - tau] if t >= tau else jnp.zeros(2)
        assert jnp.array_equal(updates, expected), (t, updates, expected)


def test_delay_makes_no_inner_step_while_filling():
    """While the buffer fills, the inner state stands still (Adam's step count too), so
    the first real update is Adam's very first update of the oldest gradient."""
    inner = optax.adam(0.1)
    tx = optim.delay(inner, 2)
    params = jnp.array([1.0, -2.0])
    grads = [jnp.array([1.0, 3.0]), jnp.array([10.0, -1.0]), jnp.array([100.0, 5.0])]
    state = tx.init(params)
    for g in grads[:2]:
        updates, state = jax.jit(tx.update)(g, state, params)
        assert_equal(updates, jnp.zeros(2))
        assert_equal(state.inner_state, inner.init(params))  # nothing moved while filling
    updates, state = jax.jit(tx.update)(grads[2], state, params)
    first, _ = inner.update(grads[0], inner.init(params), params)
    assert_equal(updates, first)


def test_delay_zero_is_the_inner_optimizer_bit_for_bit():
    inner = optax.adam(1e-3)
    grads = [jnp.array([0.1 * i, -0.3, 1e-7 * i]) for i in range(5)]
    delayed_out, _ = _run(optim.delay(inner, 0), grads)
    inner_out, _ = _run(inner, grads)
    for a, b in zip(delayed_out, inner_out):
        assert jnp.array_equal(a, b)


def test_delayed_outputs_old_gradients():
    grads = [jnp.array([float(i)]) for i in range(1, 5)]
    out, _ = _run(optim.delayed(2), grads)
    assert [float(u[0]) for u in out] == [0.0, 0.0, 1.0, 2.0]


@pytest.mark.parametrize("tau", [-1, 1.5, True])
def test_delay_rejects_bad_tau(tau):
    with pytest.raises(ValueError, match="tau must be a non-negative integer"):
        optim.delay(optax.sgd(0.1), tau)


def test_pipeline_delays():
    assert optim.pipeline_delays("bp", 3) == [0, 0, 0]
    assert optim.pipeline_delays("ddg", 4) == [3, 2, 1, 0]
    assert optim.pipeline_delays("fdg", 4) == [5, 3, 1, 0]


@pytest.mark.parametrize("num_stages", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_staged_delay_on_one_device_equals_the_ddg_pipeline(num_stages):
    """DDG with stashed weights applies stage k the gradient of the whole model at the
    weights of K-1-k steps ago: what staged_delay simulates on one device."""
    tx = optax.sgd(0.1, momentum=0.9)
    data = batches("mlp", 3 * num_stages + 2)
    _, state, _ = run_pipeline(
        "mlp", num_stages, data=data, method="ddg", optimizer=tx, devices=jax.devices()[:num_stages]
    )
    stages = build_stages("mlp", num_stages)
    from flax import nnx

    graphs, params, rests = zip(*(nnx.split(s, nnx.Param, ...) for s in stages))
    params = list(params)

    def loss(params, x, y):
        for graph, p, r in zip(graphs, params, rests):
            x = nnx.merge(graph, p, r, copy=True)(x)
        return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

    simulation = optim.staged_delay(tx, "ddg", num_stages)
    opt_state = simulation.init(params)
    for x, y in data:
        updates, opt_state = simulation.update(jax.grad(loss)(params, x, y), opt_state, params)
        params = optax.apply_updates(params, updates)
    assert_close(params_of(state), [nnx.to_pure_dict(p) for p in params])  # a pipeline's form


def test_delay_compensation_by_hand():
    g, now, stale = jnp.array([2.0, -1.0]), jnp.array([1.0, 1.0]), jnp.array([0.5, 3.0])
    tx = optim.delay_compensation(0.5)
    updates, _ = jax.jit(tx.update)(g, tx.init(now), now, stale_params=stale)
    assert jnp.allclose(updates, g + 0.5 * g * g * (now - stale))
    zero, _ = optim.delay_compensation(0.0).update(g, tx.init(now), now, stale_params=stale)
    assert jnp.array_equal(zero, g)


def test_adaptive_delay_compensation_by_hand():
    tx = optim.delay_compensation(0.5, adaptive=True, decay=0.9, eps=0.0)
    now, stale = jnp.array([1.0]), jnp.array([0.0])
    state = tx.init(now)
    ms = 0.0
    for g in [2.0, 4.0]:
        updates, state = tx.update(jnp.array([g]), state, now, stale_params=stale)
        ms = 0.9 * ms + 0.1 * g * g
        assert jnp.allclose(updates, g + 0.5 / np.sqrt(ms) * g * g * 1.0)


def test_delay_compensation_needs_stale_params():
    tx = optim.delay_compensation(0.5)
    with pytest.raises(ValueError, match="stale_params"):
        tx.update(jnp.ones(1), tx.init(jnp.ones(1)), jnp.ones(1))


def test_reads_stale_params_finds_the_transforms_that_use_them():
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    ignores = [
        optax.sgd(0.1, momentum=0.9),
        optax.adamw(1e-3),
        optim.async_nesterov(0.1, delay=2, num_stages=3),
        optim.delay(optax.sgd(0.1), tau=2),
    ]
    assert not any(optim.reads_stale_params(tx, params) for tx in ignores)
    assert not optim.reads_stale_params(optax.sgd(0.1), {})  # a stage without weights

    def clipped_update(updates, state, params=None, *, stale_params=None, **extra_args):
        moved = jax.tree.map(lambda now, old: jnp.abs(now - old) > 1.0, params, stale_params)
        return jax.tree.map(lambda g, m: jnp.where(m, 0.0, g), updates, moved), state

    def ignoring_update(updates, state, params=None, *, stale_params=None, **extra_args):
        return updates, state

    def transform(update):
        return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

    reads = [
        optim.delay_compensation(0.5),
        optax.chain(optax.add_decayed_weights(5e-4), optim.delay_compensation(0.0, adaptive=True)),
        optax.chain(transform(clipped_update), optax.sgd(0.1)),
    ]
    assert all(optim.reads_stale_params(tx, params) for tx in reads)
    assert not optim.reads_stale_params(transform(ignoring_update), params)


@pytest.mark.parametrize("method,memory", [("ddg", "residuals"), ("fdg", "recompute")])
def test_delay_compensation_in_the_engine_matches_the_reference(method, memory):
    K = 3
    tx = optax.chain(optim.delay_compensation(2.0), optax.sgd(0.1, momentum=0.9))
    ref = reference("mlp", K, method=method, optimizer=tx)
    _, state, _ = run_pipeline(
        "mlp", K, method=method, memory=memory, optimizer=tx, devices=jax.devices()[:K]
    )
    assert_close(params_of(state), ref.params)
    _, plain, _ = run_pipeline(
        "mlp", K, method=method, memory=memory, optimizer=optax.sgd(0.1, momentum=0.9)
    )
    with pytest.raises(AssertionError):  # compensation acted
        assert_close(params_of(plain), ref.params)


def test_predict_weights_by_hand():
    tx = optax.sgd(0.1, momentum=0.9)
    params = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(params)
    for g in ([1.0, 0.0], [1.0, 2.0]):
        _, state = tx.update({"w": jnp.array(g)}, state, params)
    velocity = jnp.array([1.0 * 0.9 + 1.0, 0.0 * 0.9 + 2.0])
    predicted = jax.jit(optim.predict_weights, static_argnums=(2, 3))(params, state, 2, 0.1)
    assert jnp.allclose(predicted["w"], params["w"] - 2 * 0.1 * velocity)
    assert jnp.array_equal(optim.predict_weights(params, state, 0, 0.1)["w"], params["w"])
    with pytest.raises(ValueError, match="momentum"):
        optim.predict_weights(params, optax.adam(0.1).init(params), 2, 0.1)


def test_pipemare_rescale():
    out, _ = _run(optim.pipemare_rescale(tau=9, horizon=4), [jnp.ones(1)] * 6)
    expected = [9.0 ** -(1 - t / 4) if t < 4 else 1.0 for t in range(6)]
    np.testing.assert_allclose([float(u[0]) for u in out], expected, rtol=1e-6)
    same, _ = _run(optim.pipemare_rescale(tau=0, horizon=4), [jnp.full(2, 3.0)] * 3)
    assert all(jnp.array_equal(u, jnp.full(2, 3.0)) for u in same)
    with pytest.raises(ValueError, match="horizon"):
        optim.pipemare_rescale(2, 0)


def test_accumulate_averages_before_each_step():
    out, _ = _run(
        optim.accumulate(optax.sgd(1.0), 2), [jnp.array([x]) for x in (1.0, 3.0, 5.0, 9.0)]
    )
    assert [float(u[0]) for u in out] == [0.0, -2.0, 0.0, -7.0]


@pytest.mark.parametrize(
    "transform",
    [pytest.param(t, marks=pytest.mark.slow) for t in ("delay", "pipemare", "accumulate")]
    + ["shrink"],
)
def test_transforms_plug_into_the_engine_per_stage(transform):
    K = 3
    factories = {
        "delay": lambda k: optim.delay(optax.sgd(0.1), k),
        "pipemare": lambda k: optax.chain(optax.sgd(0.1), optim.pipemare_rescale(K - 1 - k, 5)),
        "accumulate": lambda k: optim.accumulate(optax.sgd(0.1, momentum=0.9), 2),
        "shrink": lambda k: optax.chain(optim.shrink(0.5, K - 1 - k), optax.sgd(0.1)),
    }
    ref = reference(
        "mlp",
        K,
        method="ddg",
        optimizer=factories[transform],
    )
    _, state, _ = run_pipeline(
        "mlp", K, method="ddg", optimizer=factories[transform], devices=jax.devices()[:K]
    )
    assert_close(params_of(state), ref.params)


@pytest.mark.parametrize(
    "method,weights,memory",
    [("ddg", "stash", "residuals"), ("fdg", "stash", "recompute"), ("fdg", "current", "recompute")],
)
def test_weight_prediction_in_the_engine_matches_the_reference(method, weights, memory):
    K, lr = 3, 0.1
    tx = optax.sgd(lr, momentum=0.9)
    ref = reference(
        "mlp",
        K,
        method=method,
        optimizer=tx,
        weights=weights,
        predict_lr=lr,
    )
    _, state, _ = run_pipeline(
        "mlp",
        K,
        method=method,
        weights=weights,
        memory=memory,
        optimizer=tx,
        predict_lr=lr,
        devices=jax.devices()[:K],
    )
    assert_close(params_of(state), ref.params)
    plain = reference("mlp", K, method=method, optimizer=tx, weights=weights)
    with pytest.raises(AssertionError):  # prediction acted
        assert_close(params_of(state), plain.params)


def test_extrapolate_weights_by_hand():
    tx = optim.remember_update(optax.adam(0.1))
    params = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(params)
    assert jnp.array_equal(optim.extrapolate_weights(params, state, 3)["w"], params["w"])
    for g in ([1.0, -2.0], [0.5, 1.0]):
        updates, state = jax.jit(tx.update)({"w": jnp.array(g)}, state, params)
        before, params = params, optax.apply_updates(params, updates)
    predicted = jax.jit(optim.extrapolate_weights, static_argnums=2)(params, state, 2)
    assert jnp.allclose(predicted["w"], params["w"] + 2 * (params["w"] - before["w"]))
    with pytest.raises(ValueError, match="remember_update"):
        optim.extrapolate_weights(params, optax.adam(0.1).init(params), 2)


def test_remember_update_passes_extra_arguments_on():
    tx = optim.remember_update(optim.delay_compensation(0.5))
    params, stale = jnp.array([1.0]), jnp.array([0.0])
    updates, state = tx.update(jnp.array([2.0]), tx.init(params), params, stale_params=stale)
    assert jnp.allclose(updates, 2.0 + 0.5 * 2.0 * 2.0 * 1.0)
    assert jnp.array_equal(state.last_update, updates)


@pytest.mark.parametrize(
    "method,name",
    [
        ("ddg", "adamw"),
        pytest.param("fdg", "adamw", marks=pytest.mark.slow),
        pytest.param("ddg", "muon", marks=pytest.mark.slow),
        pytest.param("fdg", "muon", marks=pytest.mark.slow),
    ],
)
def test_extrapolation_in_the_engine_matches_the_reference(method, name):
    """predict=update (w + tau * last update) on AdamW and Muon, on every layout."""
    K = 2
    tx = {"adamw": optax.adamw(1e-2), "muon": optax.contrib.muon(1e-2)}[name]
    ref = reference("mlp", K, method=method, optimizer=tx, predict="update")
    plain = reference("mlp", K, method=method, optimizer=tx)
    for layout in layouts(K).values():
        _, state, _ = run_pipeline(
            "mlp", K, method=method, optimizer=tx, predict="update", **layout
        )
        assert_close(params_of(state), ref.params)
        with pytest.raises(AssertionError):  # prediction acted
            assert_close(params_of(state), plain.params)


def test_weight_prediction_needs_momentum_and_a_positive_rate():
    with pytest.raises(ValueError, match="predict_lr must be a positive"):
        run_pipeline("mlp", 2, method="ddg", predict_lr=0.0)
    with pytest.raises(ValueError, match="momentum"):
        run_pipeline("mlp", 2, method="ddg", optimizer=optax.adam(0.1), predict_lr=0.1)
    with pytest.raises(ValueError, match="set predict_lr"):
        run_pipeline("mlp", 2, method="ddg", predict="momentum")
    with pytest.raises(ValueError, match="leave predict_lr unset"):
        run_pipeline("mlp", 2, method="ddg", predict="update", predict_lr=0.1)
    with pytest.raises(ValueError, match="Unknown predict 'velocity'"):
        run_pipeline("mlp", 2, method="ddg", predict="velocity")
    for method in ("bp", "gpipe", "fr", "dgl"):
        with pytest.raises(ValueError, match=f"nothing to predict under method={method}"):
            dgrad.Options(method=method, predict="update")


def test_extrapolation_replays_its_weights_under_recompute():
    """weights=current with memory=recompute: the backward's forward runs again at the
    current weights, the first forward at the extrapolated ones."""
    tx = optax.adamw(1e-2)
    ref = reference("mlp", 3, method="ddg", optimizer=tx, weights="current", predict="update")
    _, state, _ = run_pipeline(
        "mlp",
        3,
        method="ddg",
        weights="current",
        memory="recompute",
        optimizer=tx,
        predict="update",
        devices=jax.devices()[:3],
    )
    assert_close(params_of(state), ref.params)


def test_accumulate_and_staged_delay_pass_stale_params_to_what_they_wrap():
    dc = optax.chain(optim.delay_compensation(0.5), optax.sgd(0.1))
    now, stale, g = jnp.array([1.0]), jnp.array([0.0]), jnp.array([1.0])
    expected = -0.1 * (1.0 + 0.5 * 1.0 * 1.0 * (1.0 - 0.0))
    tx = optim.accumulate(dc, every=1)
    assert optim.reads_stale_params(tx, now) and not optim.reads_stale_params(
        optim.accumulate(optax.sgd(0.1), every=2), now
    )
    chained = optax.chain(tx)  # chain passes extra args only to ExtraArgs transforms
    updates, _ = chained.update(g, chained.init(now), now, stale_params=stale)
    assert jnp.allclose(updates, expected)
    staged = optim.staged_delay(dc, "bp", num_stages=2)
    for params in ([now, now], (now, now)):  # a list or a tuple of stages
        out, _ = staged.update(
            type(params)([g, g]),
            staged.init(params),
            params,
            stale_params=type(params)([stale] * 2),
        )
        assert type(out) is type(params) and all(jnp.allclose(u, expected) for u in out)
    with pytest.raises(ValueError, match="a list of 2 per-stage parameter trees, got dict"):
        staged.init({"a": now, "b": now})


def test_a_pipeline_refuses_accumulation_with_an_update_that_reads_stale_params():
    dc = optax.chain(optim.delay_compensation(0.5), optax.sgd(0.1))
    with pytest.raises(ValueError, match="accumulate=2 steps once per 2 gradients"):
        run_pipeline("mlp", 2, steps=1, method="ddg", optimizer=dc, accumulate=2)


def test_the_transforms_take_injected_hyperparameters_numpy_integers_and_mixed_dtypes():
    params = jnp.zeros(2)
    plain = optim.async_nesterov(1e-2, delay=1, num_stages=4)
    injected = optax.inject_hyperparams(optim.async_nesterov, static_args=("delay", "num_stages"))(
        learning_rate=1e-2, delay=1, num_stages=4
    )
    g = jnp.array([1.0, -2.0])
    a, _ = plain.update(g, plain.init(params), params)
    b, _ = jax.jit(injected.update)(g, injected.init(params), params)
    assert jnp.allclose(a, b, atol=1e-6)
    tx = optax.inject_hyperparams(optim.delay_compensation)(strength=0.5)
    assert jnp.allclose(
        tx.update(g, tx.init(params), params, stale_params=params)[0], g
    )  # no drift, no change
    assert optim.delay(optax.sgd(1.0), np.int64(2)).init(params).buffer.shape == (2, 2)
    assert optim.accumulate(optax.sgd(1.0), np.int64(2)) is not None
    bf16 = jnp.zeros(1, jnp.bfloat16)
    tx = optim.delay(optax.sgd(1.0), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX warns of an unsafe cast into the buffer
        _, state = tx.update(jnp.ones(1, jnp.float32), tx.init(bf16), bf16)
    assert state.buffer.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optim.delay(optax.sgd, 2), "delay wraps an optax transformation"),
        (lambda: optim.async_nesterov_for(1e-3, "ddg", 3)(3), r"a stage index in 0..2"),
        (lambda: optim.async_nesterov_for(1e-3, "ddg", 3)(-1), r"a stage index in 0..2"),
        (
            lambda: optim.delay_compensation(float("inf")),
            "strength \\(lambda\\) must be a non-negative number",
        ),
        (lambda: optim.delay_compensation(0.5, decay=1.5), r"decay must be a number in \[0, 1\)"),
        (lambda: optim.delay_compensation("0.5"), "strength \\(lambda\\) must be a non-negative"),
    ],
)
def test_misuse_of_the_transforms_says_what_is_wrong(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.parametrize("beta,depth", [(0.5, 0), (0.5, 3), (0.2, 1), (1.0, 4)])
def test_shrink_scales_by_beta_to_the_depth_under_jit(beta, depth):
    tx = optim.shrink(beta, depth)
    grads = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(3.0)}
    updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
    assert jnp.allclose(updates["w"], jnp.array([1.0, -2.0]) * beta**depth)
    assert jnp.allclose(updates["b"], 3.0 * beta**depth)


def test_shrink_first_in_a_chain_leaves_the_weight_decay_unscaled():
    """The pipeline chains shrink before the user's optimizer; the engine's order is
    checked against the reference (FDG, beta 0.5, weight decay) in test_pipeline."""
    tx = optax.chain(optim.shrink(0.5, 2), optax.add_decayed_weights(0.1), optax.sgd(1.0))
    params = {"w": jnp.array([2.0])}
    updates, _ = tx.update({"w": jnp.array([4.0])}, tx.init(params), params)
    assert jnp.allclose(updates["w"], -(0.25 * 4.0 + 0.1 * 2.0))


def test_shrink_with_beta_one_is_identity_bit_for_bit():
    grads = {"w": jnp.array([1.2345678, -3.3e-7])}
    updates, _ = optim.shrink(1.0, 3).update(grads, optax.EmptyState())
    assert (updates["w"] == grads["w"]).all()


@pytest.mark.parametrize("depth", [-1, 1.5, True])
def test_shrink_rejects_bad_depth(depth):
    with pytest.raises(ValueError, match="depth must be a non-negative integer"):
        optim.shrink(0.5, depth)
