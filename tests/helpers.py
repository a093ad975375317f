"""What the tests share: tiny models and their data, optimizers, the one pipeline
builder, and one way of comparing trees (chex). Starting and stopping processes is in
`processes`."""

from __future__ import annotations

import functools
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import dgrad
from dgrad import models
from dgrad.reference import reference_run

NUM_CLASSES = 3
BATCH = 8
RTOL, ATOL = 1e-5, 1e-6


def optimizer(k: int) -> optax.GradientTransformation:
    """SGD with momentum and weight decay, a little different per stage."""
    return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05 + 0.01 * k, momentum=0.9))


# The same SGD on every stage. With `optimizer` above, the BatchNorm CNN's training
# reaches a point at step 3 where input noise of 1e-6 moves the update by 1.6e-3
# (measured; 1e-7 moves nothing): a non-smooth point of the ReLU network. Runs whose
# batch reductions are split differently (replicas) then part ways after it, so the
# tests that compare replicated runs with the reference use this optimizer instead.
SMOOTH_OPTIMIZER = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05, momentum=0.9))


def summing(inner: optax.GradientTransformation, every: int) -> optax.GradientTransformation:
    """ADL's accumulation written plainly: add up the gradients; at every `every`-th,
    step `inner` with the sum and start again; make no update in between."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params), 0, inner.init(params)

    def update(grads, state, params=None, **extra):
        total, count, inner_state = state
        total, count = jax.tree.map(jnp.add, total, grads), count + 1
        if count < every:
            return jax.tree.map(jnp.zeros_like, grads), (total, count, inner_state)
        updates, inner_state = inner.update(total, inner_state, params)
        return updates, (jax.tree.map(jnp.zeros_like, total), 0, inner_state)

    return optax.GradientTransformation(init, update)


def build_stages(model: str, num_stages: int):
    if model == "mlp":
        return models.mlp([6, 16, 16, 16, NUM_CLASSES], num_stages=num_stages, rngs=1)
    if model == "deep mlp":  # six blocks: K = 2 groups of V = 3 chunks
        return models.mlp([6, 16, 16, 16, 16, 16, NUM_CLASSES], num_stages=num_stages, rngs=1)
    if model == "cnn":  # ResNet-8 with 4 channels: five blocks, BatchNorm everywhere
        return models.cifar_resnet(
            8, NUM_CLASSES, num_stages, width=4, in_channels=1, split="balanced", rngs=1
        )
    if model == "gpt":  # 3 blocks of dim 8, 2 heads; the chain embedding, blocks, head
        return models.gpt(VOCAB, 3, 2, 8, CONTEXT, num_stages, split="balanced", rngs=1)
    raise ValueError(model)


VOCAB, CONTEXT = 11, 6  # the test GPT's tokens and window


def chained(stages, x):
    """`x` through the stages in order (the model they cut, called eagerly)."""
    for stage in stages:
        x = stage(x)
    return x


def whole_model_loss(stages):
    """`loss(params, x, y)`: the mean cross-entropy of the model the `stages` cut, with
    stage k's parameters `params[k]` (plain dicts, as the reference's history holds)."""
    graphs = [nnx.split(stage, nnx.Param, ...) for stage in stages]

    def loss(params, x, y):
        merged = [nnx.merge(graph, p, rest) for (graph, _, rest), p in zip(graphs, params)]
        return optax.softmax_cross_entropy_with_integer_labels(chained(merged, x), y).mean()

    return loss


def input_shape(model: str):
    return {"mlp": (BATCH, 6), "deep mlp": (BATCH, 6), "gpt": (BATCH, CONTEXT)}.get(
        model, (BATCH, 8, 8, 1)
    )


def batches(model: str, count: int, seed: int = 0):
    """`count` batches of random inputs and labels; the GPT's are token windows whose
    labels are the next tokens."""
    rng = np.random.default_rng(seed)
    if model == "gpt":
        windows = [rng.integers(0, VOCAB, (BATCH, CONTEXT + 1)) for _ in range(count)]
        return [
            (jnp.asarray(w[:, :-1], jnp.int32), jnp.asarray(w[:, 1:], jnp.int32)) for w in windows
        ]
    return [
        (
            jnp.asarray(rng.normal(size=input_shape(model)), jnp.float32),
            jnp.asarray(rng.integers(0, NUM_CLASSES, BATCH), jnp.int32),
        )
        for _ in range(count)
    ]


def num_steps(num_stages: int) -> int:
    return 3 * num_stages + 2


@functools.lru_cache(maxsize=None)
def reference(model, num_stages, method, weights="stash", beta=1.0, optimizer=optimizer, **options):
    """The reference run of a test model on its standard data stream, with `method` and any
    of `reference_run`'s options (cached: a run is a pure function of its arguments)."""
    data = batches(model, num_steps(num_stages))
    return reference_run(
        build_stages(model, num_stages),
        data,
        method=method,
        optimizer=optimizer,
        beta=beta,
        weights=weights,
        **options,
    )


def layouts(num_stages: int, replicas: int | None = None) -> dict[str, dict]:
    """The device layouts the reference tests run on: one device; one device per stage;
    and, where the devices allow (4 in the tests), `replicas` per stage (default
    devices // K)."""
    devices = jax.devices()
    found = {
        "one device": dict(devices=devices[:1]),
        "a device per stage": dict(devices=devices[:num_stages], placement="one_per_device"),
    }
    replicas = replicas or len(devices) // num_stages
    if replicas >= 2 and replicas * num_stages <= len(devices):
        found[f"{replicas} replicas per stage"] = dict(
            devices=devices[: replicas * num_stages], data_parallel=replicas
        )
    return found


def layouts_and_optimizers(num_stages: int, replicas: int | None = None):
    """(name, layout, optimizer) of every layout of `layouts`: the test optimizer, and on
    replicated layouts the smooth one (see SMOOTH_OPTIMIZER)."""
    for name, layout in layouts(num_stages, replicas).items():
        yield name, layout, SMOOTH_OPTIMIZER if "replicas" in name else optimizer


def build_pipeline(model: str, num_stages: int, stages=None, **kwargs) -> dgrad.Pipeline:
    """The one way the tests make a pipeline: a test model (or its `stages` as given, e.g.
    with auxiliary heads), the test optimizer, `kwargs`."""
    stages = build_stages(model, num_stages) if stages is None else stages
    return dgrad.Pipeline(stages, **{"optimizer": optimizer, **kwargs})


def run_pipeline(model, num_stages, steps=None, data=None, **kwargs):
    """Trains a fresh pipeline; returns (pipeline, final state, metrics of every step)."""
    data = data if data is not None else batches(model, steps or num_steps(num_stages))
    pipe = build_pipeline(model, num_stages, **kwargs)
    state = pipe.init(data[0])
    history = []
    for batch in data:
        state, metrics = pipe.step(state, batch)
        history.append(metrics)
    return pipe, state, history


def params_of(state):
    return [jax.device_get(s.params) for s in state.stages]


def rests_of(state):
    return [jax.device_get(s.rest) for s in state.stages]


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    """Every leaf of two trees equal to float tolerance (one comparison for the suite)."""
    chex.assert_trees_all_close(
        jax.device_get(actual), jax.device_get(expected), rtol=rtol, atol=atol
    )


def assert_equal(actual, expected):
    """Every leaf of two trees equal bit for bit."""
    chex.assert_trees_all_equal(jax.device_get(actual), jax.device_get(expected))


def assert_matches_reference(state, history, ref, rtol=RTOL, atol=ATOL):
    """Parameters, BatchNorm statistics and every step's loss as the reference computed."""
    assert_close(params_of(state), ref.params, rtol, atol)
    assert_close(rests_of(state), ref.rests, rtol, atol)
    assert [m == {} for m in history] == [loss is None for loss in ref.losses]
    losses = [(m["loss"], loss) for m, loss in zip(history, ref.losses) if loss is not None]
    assert_close([a for a, _ in losses], [b for _, b in losses], rtol, atol)


ROOT = pathlib.Path(__file__).resolve().parents[1]


def check_on_layouts(
    model, num_stages, method, names=None, memory="residuals", replicas=2, **options
):
    """The pipeline of `method` with `options` (and `memory`) matches the reference on every
    layout of `layouts(num_stages, replicas)` (or those `names`d); replicated layouts use
    the smooth optimizer (see SMOOTH_OPTIMIZER)."""
    found = list(layouts_and_optimizers(num_stages, replicas))
    missing = set(names or ()) - {name for name, _, _ in found}
    assert not missing, f"no layout {sorted(missing)} on {len(jax.devices())} devices"
    for name, layout, tx in found:
        if names and name not in names:
            continue
        ref = reference(model, num_stages, method=method, optimizer=tx, **options)
        _, state, history = run_pipeline(
            model, num_stages, method=method, memory=memory, optimizer=tx, **options, **layout
        )
        assert state.step == len(history)
        try:
            assert_matches_reference(state, history, ref)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
