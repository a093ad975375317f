"""dgrad.stage: each stage function compiles once, and a stage keeps a copy of its weights
per record only where something reads it."""

import jax
import optax
import pytest
from helpers import batches, run_pipeline

import dgrad
from dgrad.benchmark import state_bytes_per_device

SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "model,method,weights,memory,fused",
    [
        pytest.param("cnn", "bp", "stash", "residuals", True, marks=SLOW),
        pytest.param("cnn", "bp", "stash", "recompute", False, marks=SLOW),
        pytest.param("cnn", "ddg", "stash", "residuals", False, marks=SLOW),
        pytest.param("cnn", "ddg", "current", "recompute", False, marks=SLOW),
        pytest.param("cnn", "fdg", "stash", "recompute", False, marks=SLOW),
        pytest.param("cnn", "fdg", "stash", "residuals", False, marks=SLOW),
        pytest.param("cnn", "fdg", "stash", "dots", False, marks=SLOW),
        ("mlp", "ddg", "current", "recompute", False),
        ("mlp", "fdg", "stash", "residuals", False),
    ],
)
def test_each_stage_function_compiles_once(model, method, weights, memory, fused):
    K = 1 if fused else 3
    devices = jax.devices()[:1] if fused else jax.devices()[:K]
    pipe, state, _ = run_pipeline(
        model,
        K,
        steps=3 * K + 2,
        method=method,
        weights=weights,
        memory=memory,
        fused=fused,
        devices=devices,
    )
    counts = _compile_counts(pipe)
    assert max(counts.values()) == 1, counts
    for batch in batches(model, 2, seed=5):
        state, _ = pipe.step(state, batch)
    assert _compile_counts(pipe) == counts


def _compile_counts(pipe):
    counts = {
        (k, name): fn._cache_size()
        for k, calls in enumerate(pipe._calls)
        for name, fn in zip(calls._fields, calls)
    }
    return {**counts, (0, "fused_step"): pipe._fused._cache_size()}


@pytest.mark.parametrize("method, memory", [("fdg", "residuals"), ("ddg", "dots")])
def test_kept_records_hold_the_weights_only_where_something_reads_them(method, memory):
    """The VJP's leaves hold what the backward needs; a copy of the weights per kept
    batch is kept only for an update that reads `stale_params` or for the probe."""
    compensated = optax.chain(dgrad.optim.delay_compensation(0.5), optax.sgd(0.05))
    states = {}
    for name, options in [
        ("plain", dict(optimizer=optax.sgd(0.05))),
        ("compensated", dict(optimizer=compensated)),
        ("probed", dict(optimizer=optax.sgd(0.05), probe_every=100)),
    ]:
        _, states[name], _ = run_pipeline(
            "mlp", 3, steps=4, method=method, memory=memory, **options
        )
    plain, compensated, probed = (states[n].stages[0] for n in ("plain", "compensated", "probed"))
    assert plain.kept and all(record.params is None for record in plain.kept)
    for stage in (compensated, probed):
        assert all(
            jax.tree.structure(record.params) == jax.tree.structure(stage.params)
            for record in stage.kept
        )
    weights = sum(a.nbytes for a in jax.tree.leaves(plain.params))
    held = [sum(state_bytes_per_device(s).values()) for s in (plain, probed)]
    assert held[1] - held[0] == len(plain.kept) * weights
