"""dgrad.probe: the staleness probe against a hand computation, how often it runs, and that
it reads the same timetable as the step."""

import jax
import numpy as np
import optax
import pytest
from helpers import (
    assert_equal,
    batches,
    build_pipeline,
    build_stages,
    params_of,
    run_pipeline,
    whole_model_loss,
)

import dgrad
from dgrad.reference import reference_run


def test_the_probe_measures_against_a_hand_computation():
    """DDG, K = 2, weights=stash, at step t: stage 0 applies the gradient of batch t-1 at
    the weights of t-1; the probe compares it with that batch's gradient at the weights
    of now, and the weights of now with those of t-1."""
    t, data = 5, batches("mlp", 6)
    pipe = dgrad.Pipeline(
        build_stages("mlp", 2), method="ddg", optimizer=optax.sgd(0.1), probe_every=1
    )
    state = pipe.init(data[0])
    for batch in data[:t]:
        state, _ = pipe.step(state, batch)
    probe = jax.device_get(pipe.probe(state, data[t]))
    ref = reference_run(build_stages("mlp", 2), data[:t], method="ddg", optimizer=optax.sgd(0.1))
    loss = whole_model_loss(build_stages("mlp", 2))
    x, y = data[t - 1]
    fresh = jax.grad(loss)([ref.history[0][t], ref.history[1][t]], x, y)[0]
    applied = jax.grad(loss)([ref.history[0][t - 1], ref.history[1][t - 1]], x, y)[0]
    flat = lambda tree: np.concatenate([np.ravel(a) for a in jax.tree.leaves(tree)])
    a, f = flat(applied), flat(fresh)
    now, then = flat(ref.history[0][t]), flat(ref.history[0][t - 1])
    np.testing.assert_allclose(
        probe[0]["cosine"], a @ f / np.linalg.norm(a) / np.linalg.norm(f), rtol=1e-4
    )
    np.testing.assert_allclose(
        probe[0]["relative_difference"], np.linalg.norm(a - f) / np.linalg.norm(f), rtol=1e-4
    )
    np.testing.assert_allclose(
        probe[0]["weight_drift"], np.linalg.norm(now - then) / np.linalg.norm(now), rtol=1e-4
    )
    assert probe[0]["cosine"] < 0.9999  # stale, so the check above can fail
    assert probe[1]["cosine"] == pytest.approx(1.0) and probe[1]["weight_drift"] == 0.0


def test_the_probe_runs_every_n_steps_only_and_leaves_the_numbers_alone():
    data = batches("mlp", 10)
    _, probed, history = run_pipeline("mlp", 3, data=data, method="fdg", probe_every=4)
    _, plain, _ = run_pipeline("mlp", 3, data=data, method="fdg")
    assert_equal(params_of(probed), params_of(plain))
    # Steps 0, 4, 8 are probed; at step 0 no FDG stage applies a gradient yet.
    assert [t for t, m in enumerate(history) if "probe" in m] == [4, 8]
    assert [m["probe_step"] for m in history if "probe" in m] == [4, 8]
    _, bp, history = run_pipeline("mlp", 3, data=data, method="bp", probe_every=3)
    probed = [m["probe"] for m in history if "probe" in m]
    assert len(probed) == 4  # steps 0, 3, 6, 9: BP applies a gradient from the first step
    for probe in probed:
        assert all(float(v["cosine"]) == pytest.approx(1.0) for v in probe.values())


@pytest.mark.parametrize("method", ["gpipe", "2bw"])
def test_the_probe_reads_the_same_timetable(method):
    pipe = build_pipeline(
        "mlp", 2, method=method, microbatches=2, probe_every=1, devices=jax.devices()[:2]
    )
    data = batches("mlp", 3)
    state = pipe.init(data[0])
    for batch in data[:2]:
        state, _ = pipe.step(state, batch)
    probe = pipe.probe(state, data[2])
    cosines = [float(probe[k]["cosine"]) for k in range(2)]
    if method == "gpipe":  # fresh gradients
        np.testing.assert_allclose(cosines, 1.0, rtol=1e-5)
    else:  # one version old, on every stage
        assert all(c < 1 - 1e-6 for c in cosines), cosines
        assert all(float(probe[k]["weight_drift"]) > 0 for k in range(2))
