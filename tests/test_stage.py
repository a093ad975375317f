"""dgrad.stage: each stage function compiles once, and a stage keeps a copy of its weights
per record only where something reads it."""

import jax
import optax
import pytest
from helpers import batches, run_pipeline

import dgrad
from dgrad.measure.benchmark import state_bytes_per_device
from dgrad.stage import Given, ResidualLayout, StageFunctions, Vars, shape_dtype

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


def _resnet_stage_and_input():
    from dgrad import models

    first, second = models.cifar_resnet(8, num_stages=2, width=4)
    x = jax.random.normal(jax.random.key(1), (4, 32, 32, 3))
    return first, x


def test_a_record_keeps_fewer_arrays_and_gives_the_vjp_bit_for_bit():
    """Packing the VJP's small leaves changes how many arrays a record holds, never what
    the backward computes: the VJP packed and unpacked again equals jax.vjp's own, to the bit
    (both run the same eager operations, so no compiler's choice can tell them apart)."""
    import jax.numpy as jnp
    import numpy as np

    stage, x = _resnet_stage_and_input()
    fns = StageFunctions(stage, optax.sgd(0.1), first=True)
    layout = fns.residual_layout(fns.params, fns.rest, x)
    _, out = fns.compile(layout).forward(Vars(), Given(params=fns.params, rest=fns.rest, x=x))
    y, record = out.y, out.record
    assert layout.packed and len(record.residuals) < layout.num_leaves
    assert len(record.residuals) == layout.num_leaves - len(layout.packed) + 1  # one dtype
    again = layout.pack(jax.tree.leaves(layout.unpack(record.residuals)))
    for got, want in zip(again, record.residuals, strict=True):  # the record, unpacked and
        np.testing.assert_array_equal(got, want)  # packed again, is the record

    cotangent = jax.random.normal(jax.random.key(2), y.shape)
    _, vjp, _ = fns._vjp(fns.params, fns.rest, x)  # eager: its leaves are not the jitted ones
    _, twice, _ = fns._vjp(fns.params, fns.rest, jnp.concatenate([x, x]))
    shapes = jax.tree.map(shape_dtype, (vjp, twice))
    layout = ResidualLayout.of(*shapes, rows=x.shape[0])
    assert layout.packed
    grads = layout.unpack(layout.pack(jax.tree.leaves(vjp)))(cotangent)[0]
    expected = vjp(cotangent)[0]
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)

    # control: the same arrays unpacked in another order give other gradients
    swapped = ResidualLayout(layout.treedef, layout.batch_major, layout.packed[::-1])
    wrong = swapped.unpack(layout.pack(jax.tree.leaves(vjp)))(cotangent)[0]
    assert any(
        not jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(wrong), jax.tree.leaves(grads))
    )


def test_calls_take_only_what_they_read():
    """A forward takes no optimizer state unless it predicts weights, and a backward from
    kept residuals no weights: the engine's calls are called with None there."""
    stage, x = _resnet_stage_and_input()
    plain = StageFunctions(stage, optax.sgd(0.1, momentum=0.9), first=True)
    opt_state = plain.optimizer.init(plain.params)
    assert plain.forward_reads(opt_state) is None
    assert plain.backward_reads(plain.params, plain.rest) == (None, None)
    predicting = StageFunctions(
        stage,
        optax.sgd(0.1, momentum=0.9),
        first=True,
        options=dgrad.Options(predict="momentum", predict_lr=0.1),
        staleness=2,
    )
    assert predicting.forward_reads(opt_state) is opt_state
    replaying = StageFunctions(
        stage, optax.sgd(0.1), first=True, options=dgrad.Options(memory="recompute")
    )
    assert replaying.backward_reads(replaying.params, replaying.rest) == (
        replaying.params,
        replaying.rest,
    )
