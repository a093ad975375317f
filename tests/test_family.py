"""The decoupled-learning family in the one engine: Features Replay, DGL and ADL
(accumulation), each against its plain reference (the staleness probe: test_probe)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    NUM_CLASSES,
    assert_close,
    assert_equal,
    assert_matches_reference,
    batches,
    build_stages,
    input_shape,
    layouts_and_optimizers,
    num_steps,
    optimizer,
    params_of,
    reference,
    run_pipeline,
    summing,
)

import dgrad
from dgrad import models
from dgrad.reference import reference_run
from dgrad.train import export
from dgrad.train.checkpoint import Checkpointer


def dgl_stages(model, num_stages):
    example = jnp.zeros(input_shape(model))
    return models.with_aux_heads(build_stages(model, num_stages), NUM_CLASSES, example)


def run_dgl(model, num_stages, data=None, **kwargs):
    stages = dgl_stages(model, num_stages)
    return run_pipeline(model, num_stages, data=data, stages=stages, method="dgl", **kwargs)


SIZES = [
    pytest.param("mlp", 1, marks=pytest.mark.slow),
    ("mlp", 2),
    pytest.param("mlp", 3, marks=pytest.mark.slow),
    pytest.param("mlp", 4, marks=pytest.mark.slow),
    pytest.param("cnn", 2, marks=pytest.mark.slow),
    pytest.param("cnn", 1, marks=pytest.mark.slow),
    pytest.param("cnn", 3, marks=pytest.mark.slow),
    pytest.param("cnn", 4, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model, num_stages", SIZES)
def test_features_replay_is_its_papers_rule_and_a_preset_of_ddg(model, num_stages):
    """The paper's rule, written out module by module in the reference, equals the
    engine's fr, which is bit for bit ddg with current weights and recomputation."""
    for _, layout, tx in layouts_and_optimizers(num_stages):
        ref = reference(model, num_stages, "fr", optimizer=tx)
        _, state, history = run_pipeline(model, num_stages, method="fr", optimizer=tx, **layout)
        assert_matches_reference(state, history, ref)
        _, preset, _ = run_pipeline(
            model,
            num_stages,
            method="ddg",
            weights="current",
            memory="recompute",
            optimizer=tx,
            **layout,
        )
        assert_equal(params_of(state), params_of(preset))
    if num_stages > 1:  # control: replaying on current weights is not stashing
        with pytest.raises(AssertionError):
            assert_matches_reference(state, history, reference(model, num_stages, "ddg"))


@pytest.mark.parametrize("model, num_stages", SIZES)
def test_dgl_matches_the_greedy_reference(model, num_stages):
    data = batches(model, num_steps(num_stages))
    for _, layout, tx in layouts_and_optimizers(num_stages):
        ref = reference_run(dgl_stages(model, num_stages), data, method="dgl", optimizer=tx)
        _, state, history = run_dgl(model, num_stages, data, optimizer=tx, **layout)
        assert_matches_reference(state, history, ref)
    if num_stages > 1:  # control: the greedy objective is not backprop's
        bp = reference_run(dgl_stages(model, num_stages), data, method="bp", optimizer=optimizer)
        with pytest.raises(AssertionError):
            assert_close(params_of(state), bp.params)


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
def test_dgl_on_one_stage_is_backprop(model):
    _, dgl, _ = run_dgl(model, 1)
    _, bp, _ = run_pipeline(model, 1, method="bp", fused=True)
    assert_close(params_of(dgl), params_of(bp), 1e-6, 1e-7)


def test_dgl_export_drops_the_heads(tmp_path):
    data = batches("mlp", 5)
    pipe, state, _ = run_dgl("mlp", 2, data, devices=jax.devices()[:2])
    model = export.merge(pipe, state)
    assert not any(isinstance(m, models.AuxStage) for m in model.layers)
    np.testing.assert_allclose(
        np.asarray(model(data[0][0])), np.asarray(pipe.predict(state, data[0][0])), rtol=1e-5
    )
    path = export.save(model, tmp_path / "model")
    loaded = export.load(build_stages("mlp", 2), path)
    assert_equal(loaded(data[0][0]), model(data[0][0]))


@pytest.mark.parametrize(
    "method, K, layout",
    [
        ("fdg", 3, "spread"),
        *[
            pytest.param("fdg", k, layout, marks=pytest.mark.slow)
            for k in (1, 2, 3, 4)
            for layout in ("one", "spread")
            if (k, layout) != (3, "spread")
        ],
        pytest.param("ddg", 3, "spread", marks=pytest.mark.slow),
    ],
)
def test_adl_sums_every_m_gradients_and_matches_the_reference(method, K, layout):
    """accumulate=M: each stage sums M gradients and steps once (the ADL authors' code),
    against the reference with the sum written out, on one device and on K."""
    every = 2
    data = batches("mlp", 4 * K + 2)
    ref = reference_run(
        build_stages("mlp", K), data, method=method, optimizer=lambda k: summing(optimizer(k), 2)
    )
    devices = jax.devices()[:1] if layout == "one" else jax.devices()[:K]
    _, state, history = run_pipeline(
        "mlp", K, data=data, method=method, accumulate=every, devices=devices
    )
    assert_matches_reference(state, history, ref)
    plain = reference_run(build_stages("mlp", K), data, method=method, optimizer=optimizer)
    with pytest.raises(AssertionError):
        assert_close(params_of(state), plain.params)


def test_adl_moves_the_weights_every_m_steps_only():
    K, every = 2, 3
    pipe = dgrad.Pipeline(
        build_stages("mlp", K), method="fdg", optimizer=optax.sgd(0.1), accumulate=every
    )
    data = batches("mlp", 12)
    state, moved = pipe.init(data[0]), []
    for t, batch in enumerate(data):
        before = params_of(state)[1]
        state, _ = pipe.step(state, batch)
        after = params_of(state)[1]
        if any(np.any(a != b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))):
            moved.append(t)
    # The last stage takes its first batch at step 1 (FDG), then steps after every third.
    assert moved == [3, 6, 9]


@pytest.mark.parametrize(
    "method, options",
    [
        pytest.param("fr", {}, marks=pytest.mark.slow),
        ("dgl", {}),
        ("fdg", dict(accumulate=2)),
        pytest.param("ddg", dict(probe_every=3), marks=pytest.mark.slow),
    ],
)
def test_the_family_resumes_bit_identically(tmp_path, method, options):
    data = batches("mlp", 11)
    stages = dgl_stages if method == "dgl" else build_stages

    def make(devices):
        return dgrad.Pipeline(
            stages("mlp", 3), method=method, optimizer=optimizer, devices=devices, **options
        )

    pipe = make(jax.devices()[:3])
    state = pipe.init(data[0])
    for batch in data[:5]:
        state, _ = pipe.step(state, batch)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
    whole = state
    for batch in data[5:]:
        whole, _ = pipe.step(whole, batch)
    fresh = make(jax.devices()[::-1][:3])
    fresh.init(data[0])
    with Checkpointer(tmp_path) as checkpoints:
        restored, _ = checkpoints.restore(fresh)
    for batch in data[5:]:
        restored, _ = fresh.step(restored, batch)
    assert_equal(jax.device_get(restored), jax.device_get(whole))


def test_the_timetables_of_the_family():
    fr, dgl = dgrad.Schedule("fr", 3), dgrad.Schedule("dgl", 3)
    assert [fr.backward_batch(k, 5) for k in range(3)] == [3, 4, 5]  # as DDG
    assert [fr.weight_staleness(k) for k in range(3)] == [0, 0, 0]  # gradients at current w
    assert [fr.input_staleness(k) for k in range(3)] == [2, 1, 0]
    assert [dgl.forward_batch(k, 5) for k in range(3)] == [5, 4, 3]  # as FDG
    assert [dgl.backward_batch(k, 5) for k in range(3)] == [5, 4, 3]  # at once
    assert [dgl.weight_staleness(k) for k in range(3)] == [0, 0, 0]
