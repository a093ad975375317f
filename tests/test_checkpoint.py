"""Checkpoints hold everything in flight: a run saved after step n and resumed in a
fresh pipeline (on the same or another device layout) is bit-identical at step m."""

import os
import shutil

import jax
import numpy as np
import pytest
from helpers import batches, build_stages, optimizer

import dgrad
from dgrad.checkpoint import Checkpointer, flatten_state

STEPS, SAVE_AT = 11, 5


def make_pipeline(model, num_stages, devices=None, **kwargs):
    return dgrad.Pipeline(
        build_stages(model, num_stages),
        optimizer=optimizer,
        devices=devices or jax.devices()[:num_stages],
        **kwargs,
    )


def snapshot(state):
    """The state's arrays copied to the host (safe from later donation), and its layout."""
    arrays, layout = flatten_state(state)
    return jax.device_get(arrays), layout


def assert_states_equal(a, b):
    arrays_a, layout_a = a if isinstance(a, tuple) else snapshot(a)
    arrays_b, layout_b = b if isinstance(b, tuple) else snapshot(b)
    assert layout_a == layout_b
    assert arrays_a.keys() == arrays_b.keys()
    for name in arrays_a:
        np.testing.assert_array_equal(np.asarray(arrays_a[name]), np.asarray(arrays_b[name]), name)


def run(pipe, state, data):
    for batch in data:
        state, _ = pipe.step(state, batch)
    return state


@pytest.mark.parametrize(
    "model, num_stages, method, weights, memory",
    [
        ("mlp", 3, "fdg", "stash", "residuals"),
        ("mlp", 3, "fdg", "current", "recompute"),
        ("mlp", 3, "ddg", "stash", "recompute"),
        ("mlp", 2, "bp", "stash", "residuals"),
        ("cnn", 2, "fdg", "stash", "residuals"),
        ("cnn", 3, "ddg", "stash", "residuals"),
    ],
)
def test_resume_is_bit_identical_on_another_layout(
    tmp_path, model, num_stages, method, weights, memory
):
    data = batches(model, STEPS)
    options = dict(method=method, weights=weights, memory=memory)
    if method == "fdg":
        options["beta"] = 0.7
    pipe = make_pipeline(model, num_stages, **options)
    state = run(pipe, pipe.init(data[0]), data[:SAVE_AT])
    assert any(s.pending for s in state.stages) or method == "bp"
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, {"note": "mid-run"})
    uninterrupted = run(pipe, state, data[SAVE_AT:])

    # A fresh pipeline, as in a new process, with the stages in reverse device order.
    devices = jax.devices()[:num_stages][::-1]
    fresh = make_pipeline(model, num_stages, devices=devices, **options)
    with Checkpointer(tmp_path) as checkpoints:
        restored, extra = checkpoints.restore(fresh, fresh.init(data[0]))
    assert extra == {"note": "mid-run"} and restored.step == SAVE_AT
    for k, stage in enumerate(restored.stages):
        assert jax.tree.leaves(stage.params)[0].devices() == {devices[k]}
    assert_states_equal(run(fresh, restored, data[SAVE_AT:]), uninterrupted)


def test_fused_backprop_resumes_bit_identically(tmp_path):
    data = batches("cnn", STEPS)
    pipe = make_pipeline("cnn", 1, method="bp", fused=True)
    state = run(pipe, pipe.init(data[0]), data[:SAVE_AT])
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
    uninterrupted = run(pipe, state, data[SAVE_AT:])
    fresh = make_pipeline("cnn", 1, devices=jax.devices()[2:3], method="bp", fused=True)
    with Checkpointer(tmp_path) as checkpoints:
        restored, _ = checkpoints.restore(fresh, fresh.init(data[0]))
    assert_states_equal(run(fresh, restored, data[SAVE_AT:]), uninterrupted)


def test_restores_onto_one_device(tmp_path):
    data = batches("mlp", STEPS)
    pipe = make_pipeline("mlp", 3, method="fdg")
    state = run(pipe, pipe.init(data[0]), data[:SAVE_AT])
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state)
    uninterrupted = run(pipe, state, data[SAVE_AT:])
    single = make_pipeline("mlp", 3, devices=jax.devices()[3:], method="fdg")
    with Checkpointer(tmp_path) as checkpoints:
        restored, _ = checkpoints.restore(single, single.init(data[0]))
    assert_states_equal(run(single, restored, data[SAVE_AT:]), uninterrupted)


def test_a_save_cut_short_is_ignored(tmp_path):
    """Orbax writes into a temporary directory and renames it when complete; what a
    process killed mid-write leaves behind is never taken for a checkpoint."""
    data = batches("mlp", 6)
    pipe = make_pipeline("mlp", 2, method="fdg")
    state = pipe.init(data[0])
    with Checkpointer(tmp_path) as checkpoints:
        state = run(pipe, state, data[:3])
        checkpoints.save(state)
        good = snapshot(state)
        state = run(pipe, state, data[3:])
        checkpoints.save(state)
    # Turn checkpoint 6 into what a kill during its write leaves: a partial temporary directory.
    partial = tmp_path / "6.orbax-checkpoint-tmp-1764490000000000"
    os.rename(tmp_path / "6", partial)
    for path in sorted(partial.rglob("*"), reverse=True):
        if path.is_file() and path.stat().st_size > 0:
            path.unlink()
            break
    with Checkpointer(tmp_path) as checkpoints:
        assert checkpoints.latest_step() == 3
        restored, _ = checkpoints.restore(pipe, pipe.init(data[0]))
    assert_states_equal(restored, good)


def test_restoring_into_another_model_says_so(tmp_path):
    data = batches("mlp", 3)
    pipe = make_pipeline("mlp", 2, method="fdg")
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(run(pipe, pipe.init(data[0]), data))
    three = make_pipeline("mlp", 3, method="fdg")
    with Checkpointer(tmp_path) as checkpoints, pytest.raises(ValueError, match="stages"):
        checkpoints.restore(three, three.init(data[0]))
    other_split = dgrad.Pipeline(
        dgrad.models.mlp([6, 16, 16, 16, 3], num_stages=2, split=[3]),
        optimizer=optimizer,
        method="fdg",
    )
    with Checkpointer(tmp_path) as checkpoints, pytest.raises(ValueError, match="another model"):
        checkpoints.restore(other_split, other_split.init(data[0]))


def test_missing_checkpoint_says_where_it_looked(tmp_path):
    pipe = make_pipeline("mlp", 2, method="fdg")
    data = batches("mlp", 1)
    with Checkpointer(tmp_path / "empty") as checkpoints:
        assert checkpoints.latest_step() is None
        with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
            checkpoints.restore(pipe, pipe.init(data[0]))
    shutil.rmtree(tmp_path / "empty")
