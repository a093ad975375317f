"""Properties that must hold whatever the reference says: K=1 is backprop, layouts and
replicas do not change numbers, the papers' delays, no update during fill, a non-finite
loss is flagged (one compile per function: test_stage)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    SMOOTH_OPTIMIZER,
    assert_close,
    assert_equal,
    batches,
    build_pipeline,
    params_of,
    rests_of,
    run_pipeline,
)

import dgrad
from dgrad import models

SLOW = pytest.mark.slow


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=SLOW)])
def test_one_stage_is_backprop_for_every_method(model):
    _, bp_state, bp_metrics = run_pipeline(model, 1, steps=6, method="bp", fused=True)
    for method, weights, memory in [
        ("bp", "stash", "residuals"),
        ("ddg", "stash", "residuals"),
        ("ddg", "current", "recompute"),
        ("fdg", "stash", "recompute"),
    ]:
        _, state, history = run_pipeline(
            model,
            1,
            steps=6,
            method=method,
            weights=weights,
            memory=memory,
            beta=0.5 if method == "fdg" else 1.0,
        )
        assert_close(params_of(state), params_of(bp_state), 1e-6, 1e-7)
        assert_close(rests_of(state), rests_of(bp_state), 1e-6, 1e-7)
        assert [m["batch"] for m in history] == list(range(6))
        assert_close([m["loss"] for m in history], [m["loss"] for m in bp_metrics], 1e-6, 1e-7)


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=SLOW)])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_staged_backprop_equals_fused_backprop(model, num_stages):
    _, fused, _ = run_pipeline(
        model, num_stages, steps=5, method="bp", fused=True, devices=jax.devices()[:1]
    )
    _, staged, _ = run_pipeline(
        model, num_stages, steps=5, method="bp", devices=jax.devices()[:num_stages]
    )
    assert_close(params_of(staged), params_of(fused), rtol=1e-5, atol=1e-6)
    assert_close(rests_of(staged), rests_of(fused), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,weights,memory", [("ddg", "stash", "residuals"), ("fdg", "current", "recompute")]
)
def test_device_mapping_does_not_change_numbers(method, weights, memory):
    devices = jax.devices()
    layouts = [
        dict(devices=devices[:1]),
        dict(devices=devices[:4]),
        dict(devices=devices[:2]),  # two stages per device
        dict(devices=devices, placement=[3, 2, 1, 0]),
        dict(devices=devices, placement=[0, 1, 0, 1]),
        dict(devices=devices, placement=[[0, 1], [0, 1], [2, 3], [2, 3]]),  # 2 replicas
    ]
    results = []
    for layout in layouts:
        pipe, state, _ = run_pipeline(
            "cnn",
            4,
            method=method,
            weights=weights,
            memory=memory,
            beta=0.7 if method == "fdg" else 1.0,
            optimizer=SMOOTH_OPTIMIZER,
            **layout,
        )
        for group, stage in zip(pipe.placement.groups, state.stages):
            assert all(leaf.devices() == set(group) for leaf in jax.tree.leaves(stage))
        results.append((params_of(state), rests_of(state)))
    for other in results[1:]:
        assert_close(other, results[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["bp", "ddg", "fdg"])
def test_replicas_do_not_change_numbers(method):
    """K=2 x D=2 and K=1 x D=4 against D=1 with the same global batch; fused BP over 4."""
    options = dict(method=method, beta=0.5 if method == "fdg" else 1.0, optimizer=SMOOTH_OPTIMIZER)
    _, single, _ = run_pipeline("cnn", 2, devices=jax.devices()[:2], **options)
    pipe, replicated, _ = run_pipeline("cnn", 2, devices=jax.devices(), data_parallel=2, **options)
    assert [len(group) for group in pipe.placement.groups] == [2, 2]
    assert_close(params_of(replicated), params_of(single))
    assert_close(rests_of(replicated), rests_of(single))
    _, one, _ = run_pipeline("cnn", 1, devices=jax.devices()[:1], **options)
    _, four, _ = run_pipeline("cnn", 1, devices=jax.devices(), data_parallel=-1, **options)
    assert_close(params_of(four), params_of(one))
    if method == "bp":
        options["fused"] = True
        _, fused, _ = run_pipeline("cnn", 1, devices=jax.devices(), data_parallel=4, **options)
        assert_close(params_of(fused), params_of(one))


def _marked_stream(num_batches, marked, width=5):
    """Batches whose loss weight is zero except for batch `marked`."""
    rng = np.random.default_rng(1)
    return [
        (
            jnp.asarray(rng.normal(size=(4, width)), jnp.float32),
            jnp.full((4,), 1.0 if t == marked else 0.0, jnp.float32),
        )
        for t in range(num_batches)
    ]


def _weighted_sum_loss(outputs, weights):
    return jnp.mean(outputs.sum(axis=-1) * weights), {}


def _steps_where_params_change(num_stages, method, stream, optimizer, **kwargs):
    stages = models.mlp([5, 7, 7, 7, 7, 3][: num_stages + 1] + [3], num_stages=num_stages, rngs=2)
    pipe = dgrad.Pipeline(
        stages,
        method=method,
        optimizer=optimizer,
        loss_fn=_weighted_sum_loss,
        devices=jax.devices()[:num_stages],
        **kwargs,
    )
    state = pipe.init(stream[0])
    changed = [[] for _ in range(num_stages)]
    for t, batch in enumerate(stream):
        before = params_of(state)
        state, _ = pipe.step(state, batch)
        for k, (old, new) in enumerate(zip(before, params_of(state))):
            if any(np.any(a != b) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))):
                changed[k].append(t)
    return changed


@pytest.mark.parametrize(
    "num_stages", [pytest.param(2, marks=SLOW), 3, pytest.param(4, marks=SLOW)]
)
@pytest.mark.parametrize("method", ["bp", "ddg", "fdg"])
@pytest.mark.parametrize("weights,memory", [("stash", "residuals"), ("current", "recompute")])
def test_each_stage_applies_the_gradient_of_the_papers_batch(num_stages, method, weights, memory):
    """Only batch 2 carries a gradient, so stage k's weights move exactly when it is applied:
    DDG K-1-k steps after the batch entered, FDG 2(K-1-k)+k steps after (its forward at k)."""
    marked, K = 2, num_stages
    stream = _marked_stream(2 * K + 4, marked)
    changed = _steps_where_params_change(
        K, method, stream, optax.sgd(0.1), weights=weights, memory=memory
    )
    delay = {"bp": lambda k: 0, "ddg": lambda k: K - 1 - k, "fdg": lambda k: k + 2 * (K - 1 - k)}[
        method
    ]
    assert changed == [[marked + delay(k)] for k in range(K)]


@pytest.mark.parametrize("method", ["ddg", "fdg"])
def test_no_update_during_fill(method):
    """With weight decay every real update moves the weights; during fill none may."""
    K = 3
    stream = _marked_stream(9, marked=-1)
    changed = _steps_where_params_change(
        K, method, stream, optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1))
    )
    first = {"ddg": lambda k: K - 1 - k, "fdg": lambda k: 2 * K - 2 - k}[method]
    assert changed == [list(range(first(k), 9)) for k in range(K)]


def test_learning_rate_schedules_count_each_stages_own_updates():
    schedule = optax.piecewise_constant_schedule(0.1, {3: 0.0})
    K, stream = 3, _marked_stream(12, marked=-1)
    changed = _steps_where_params_change(
        K, "fdg", stream, optax.chain(optax.add_decayed_weights(0.1), optax.sgd(schedule))
    )
    # Three updates each, starting when the stage's pipeline fill ends.
    assert changed == [list(range(2 * K - 2 - k, 2 * K + 1 - k)) for k in range(K)]


def test_nonfinite_loss_is_flagged():
    data = batches("mlp", 4)
    pipe = build_pipeline("mlp", 2, method="ddg", optimizer=optax.sgd(0.1))
    state = pipe.init(data[0])
    state, _ = pipe.step(state, data[0])
    pipe.check_finite(state)
    bad = (data[1][0].at[0, 0].set(jnp.nan), data[1][1])
    state, metrics = pipe.step(state, bad)
    assert not np.isfinite(metrics["loss"])
    state, _ = pipe.step(state, data[2])
    with pytest.raises(FloatingPointError, match="NaN or infinite"):
        pipe.check_finite(state)


@pytest.mark.parametrize(
    "model, options",
    [
        ("mlp", dict(method="fdg", beta=0.7)),
        pytest.param("cnn", dict(method="ddg"), marks=SLOW),
        pytest.param("mlp", dict(method="2bw", microbatches=2), marks=SLOW),
        pytest.param("mlp", dict(method="fdg", predict="momentum", predict_lr=0.05), marks=SLOW),
    ],
)
def test_keeping_the_records_sources_changes_no_number(model, options):
    """record_sources (the training command's) only adds what the records were computed
    from: weights, statistics, optimizer states and losses are those of a pipeline without
    it, bit for bit; the control: the records do differ, by those sources."""
    _, plain, plain_history = run_pipeline(model, 3, steps=7, **options)
    _, kept, kept_history = run_pipeline(model, 3, steps=7, record_sources=True, **options)
    for a, b in zip(plain.stages, kept.stages):
        assert_equal((a.params, a.rest, a.opt_state), (b.params, b.rest, b.opt_state))
    assert_equal(plain_history, kept_history)
    records = [r for s in kept.stages for r in s.kept]
    assert records and all(r.source is not None for r in records)
    assert all(r.source is None for s in plain.stages for r in s.kept)
