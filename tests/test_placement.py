"""dgrad.Placement: stages on groups of devices, replicas inside stages; the layouts, what
cannot work and why, and what is replicated and what is split along the batch."""

import jax
import numpy as np
import optax
import pytest
from helpers import (
    batches,
    build_pipeline,
    input_shape,
)

import dgrad


def test_layouts_of_stages_and_replicas():
    devices = jax.devices()
    spread = dgrad.Placement(2, devices, data_parallel=2)
    assert [[d.id for d in g] for g in spread.groups] == [[0, 1], [2, 3]]
    interleaved = dgrad.Placement(2, devices, "interleaved", data_parallel=2)
    assert [[d.id for d in g] for g in interleaved.groups] == [[0, 2], [1, 3]]
    assert dgrad.Placement(2, devices, data_parallel=-1).data_parallel == 2
    assert dgrad.Placement(1, devices, data_parallel=-1).data_parallel == 4
    fused = dgrad.Placement(3, devices, data_parallel=4, fused=True)
    assert fused.groups == (tuple(devices),) * 3
    explicit = dgrad.Placement(2, devices, [[3, 2], [1, 0]])
    assert explicit.data_parallel == 2 and explicit.groups[0] == (devices[3], devices[2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_stages=3, data_parallel=2), "3 stages x 2 replicas need 6 devices"),
        (dict(num_stages=2, placement=[[0, 1], [2]]), "same number of devices"),
        (dict(num_stages=2, placement=[[0, 1], [1, 2]]), "overlap"),
        (dict(num_stages=2, placement=[[0, 1], [2, 3]], data_parallel=4), "make them agree"),
        (dict(num_stages=1, data_parallel=8, fused=True, method="bp"), "needs 8 devices"),
        (dict(num_stages=2, data_parallel=0), "data_parallel must be an integer >= 1"),
        (
            dict(num_stages=4, method="zb", virtual_stages=2, placement=[0, 1, 2, 3]),
            r"placement lists 4 entries for 4 chunks = 2 device groups x virtual_stages=2",
        ),
    ],
)
def test_layouts_that_cannot_work_say_why(kwargs, match):
    num_stages = kwargs.pop("num_stages")
    with pytest.raises(ValueError, match=match):
        build_pipeline("mlp", num_stages, devices=jax.devices(), **kwargs)


@pytest.mark.parametrize(
    "method, order",
    [("1f1b", [0, 1, 0, 1]), ("zb", [0, 1, 1, 0])],  # interleaved; ZB-V's V
)
def test_a_placement_list_with_virtual_stages_names_the_device_groups(method, order):
    """With V > 1 an explicit list gives the K groups, and each chunk goes to the group its
    schedule runs it on: listing [[3, 2], [1, 0]] moves the groups, not the order."""
    devices = jax.devices()
    pipe = build_pipeline(
        "mlp",
        4,
        method=method,
        virtual_stages=2,
        microbatches=2,
        devices=devices,
        placement=[[3, 2], [1, 0]],
    )
    listed = [(devices[3], devices[2]), (devices[1], devices[0])]
    assert pipe.placement.groups == tuple(listed[g] for g in order)
    assert [pipe.schedule.device_of(j) for j in range(4)] == order


def test_a_batch_that_does_not_split_between_replicas():
    pipe = build_pipeline("mlp", 2, devices=jax.devices(), data_parallel=2)
    odd = (np.zeros((7, 6), np.float32), np.zeros(7, np.int32))
    with pytest.raises(ValueError, match="divisible by 2"):
        pipe.init(odd)


def test_a_replicated_pipeline_initialises_again_after_it_trained():
    """`init` places copies of each stage's initial weights: training from one state (whose
    calls donate the weights) leaves them for the next `init`, on replicas too, and the
    second run repeats the first."""
    pipe = build_pipeline("mlp", 2, method="fdg", devices=jax.devices(), data_parallel=2)
    data = batches("mlp", 4)
    finals = []
    for _ in range(2):
        state = pipe.init(data[0])
        for batch in data:
            state, _ = pipe.step(state, batch)
        finals.append(jax.device_get(state.stages[0].params))
    for once, again in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1]), strict=True):
        np.testing.assert_array_equal(once, again)


def test_fused_backprop_is_data_parallel_over_its_group():
    pipe = build_pipeline("cnn", 1, method="bp", fused=True, devices=jax.devices(), data_parallel=4)
    state = pipe.init(batches("cnn", 1)[0])
    state, metrics = pipe.step(state, batches("cnn", 1)[0])
    assert jax.tree.leaves(state.stages[0].params)[0].devices() == set(jax.devices())
    assert np.isfinite(metrics["loss"])


ROWS = 24  # no weight of the test models is 24 long, so a leading 24 is the batch


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "method, memory", [("fdg", "residuals"), ("fdg", "dots"), ("fdg", "recompute"), ("ddg", None)]
)
def test_what_is_replicated_and_what_is_split_along_the_batch(model, method, memory):
    """Weights, statistics and optimizer state whole on each replica; the batch's arrays
    (in flight, and every leaf of what a stage keeps that is batch-major) split."""
    pipe = build_pipeline(
        model, 2, method=method, memory=memory, devices=jax.devices(), data_parallel=2
    )
    rng = np.random.default_rng(0)
    batch = (
        rng.normal(size=(ROWS, *input_shape(model)[1:])).astype(np.float32),
        np.zeros(ROWS, np.int32),
    )
    state = pipe.init(batch)
    for _ in range(3):
        state, _ = pipe.step(state, batch)

    def split(leaf, k):
        return leaf.sharding.spec[:1] == ("data",) and leaf.devices() == set(
            pipe.placement.groups[k]
        )

    in_flight = [  # activations[k] and cotangents[k] wait for stage k
        (message, k)
        for k, messages in enumerate(zip(state.activations, state.cotangents))
        for message in messages
        if message is not None
    ]
    assert in_flight
    assert all(split(leaf, k) for message, k in in_flight for leaf in jax.tree.leaves(message))
    for stage in state.stages:
        for leaf in jax.tree.leaves((stage.params, stage.rest, stage.opt_state)):
            assert leaf.sharding.is_fully_replicated and len(leaf.devices()) == 2
    kept = jax.tree.leaves(state.stages[0].kept)
    batch_major = [leaf for leaf in kept if leaf.ndim and leaf.shape[0] == ROWS]
    assert batch_major and all(split(leaf, 0) for leaf in batch_major)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            dict(devices=jax.devices()[:1], placement="one_per_device"),
            ValueError,
            "2 stages x 1 replicas need 2 devices, got 1.*jax_num_cpu_devices",
        ),
        (dict(placement="everywhere"), ValueError, "Unknown placement 'everywhere'"),
        (dict(placement=[0]), ValueError, "1 entries for 2 stages"),
        (dict(placement=[0, 9]), ValueError, "index 9 is not a valid index into 4 devices"),
        (dict(devices=["gpu0"]), TypeError, "jax.Device"),
    ],
)
def test_bad_placement_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        build_pipeline("mlp", 2, optimizer=optax.sgd(0.1), **kwargs)
