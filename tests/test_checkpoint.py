"""Checkpoints hold everything in flight: a run saved after step n and resumed in a
fresh pipeline (on the same or another device layout, or number of replicas) continues
as if it had never stopped."""

import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from damage import DAMAGES, damage
from helpers import (
    assert_close,
    assert_equal,
    batches,
    build_pipeline,
    build_stages,
    optimizer,
)

import dgrad
from dgrad.options import MICROBATCHED
from dgrad.stage import Given, Residuals, Vars
from dgrad.train.checkpoint import (
    FORMAT,
    Checkpointer,
    OtherFormat,
    Unrestorable,
    state_mib,
    stored,
)

STEPS, SAVE_AT = 11, 5


def run(pipe, state, data):
    for batch in data:
        state, _ = pipe.step(state, batch)
    return state


def saved_and_continued(tmp_path, model, num_stages, **options):
    """Saves after SAVE_AT steps; returns the data and the uninterrupted end state (on host)."""
    data = batches(model, STEPS)
    pipe = build_pipeline(model, num_stages, devices=jax.devices()[:num_stages], **options)
    state = run(pipe, pipe.init(data[0]), data[:SAVE_AT])
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, {"note": "mid-run"})
    return data, jax.device_get(run(pipe, state, data[SAVE_AT:]))


def restored(tmp_path, pipe, data):
    pipe.init(data[0])
    with Checkpointer(tmp_path) as checkpoints:
        state, extra = checkpoints.restore(pipe)
    assert extra == {"note": "mid-run"} and state.step == SAVE_AT
    return state


@pytest.mark.parametrize(
    "model, num_stages, method, weights, memory",
    [
        ("mlp", 3, "fdg", "stash", "residuals"),
        pytest.param("mlp", 3, "fdg", "current", "recompute", marks=pytest.mark.slow),
        pytest.param("mlp", 3, "ddg", "stash", "recompute", marks=pytest.mark.slow),
        ("mlp", 3, "ddg", "stash", "dots"),
        ("mlp", 2, "bp", "stash", "residuals"),
        pytest.param("mlp", 3, "gpipe", "stash", "residuals", marks=pytest.mark.slow),
        ("mlp", 3, "1f1b", "stash", "recompute"),
        pytest.param("mlp", 3, "pipedream", "stash", "residuals", marks=pytest.mark.slow),
        ("mlp", 3, "2bw", "stash", "residuals"),
        ("mlp", 3, "zb", "stash", "residuals"),
        pytest.param("cnn", 2, "fdg", "stash", "residuals", marks=pytest.mark.slow),
        pytest.param("cnn", 2, "2bw", "stash", "recompute", marks=pytest.mark.slow),
        pytest.param("cnn", 3, "ddg", "stash", "residuals", marks=pytest.mark.slow),
    ],
)
def test_resume_is_bit_identical_on_another_layout(
    tmp_path, model, num_stages, method, weights, memory
):
    options = dict(method=method, weights=weights, memory=memory)
    if method == "fdg":
        options["beta"] = 0.7
    if method in MICROBATCHED:
        options["microbatches"] = 2
    data, uninterrupted = saved_and_continued(tmp_path, model, num_stages, **options)
    devices = jax.devices()[:num_stages][::-1]  # a fresh pipeline, stages in reverse order
    fresh = build_pipeline(model, num_stages, devices=devices, **options)
    state = restored(tmp_path, fresh, data)
    synchronous = method in ("bp", "gpipe", "1f1b", "zb")  # nothing in flight between steps
    assert any(s.kept for s in state.stages) or synchronous
    if method == "2bw":  # no flush: b_t's last backwards and a gradient sum carry over
        assert all(s.previous is not None for s in state.stages)
        assert any(s.gradient_sum is not None for s in state.stages)
    for k, stage in enumerate(state.stages):
        assert jax.tree.leaves(stage.params)[0].devices() == {devices[k]}
    assert_equal(run(fresh, state, data[SAVE_AT:]), uninterrupted)


@pytest.mark.parametrize(
    "model, num_stages, options",
    [
        ("mlp", 3, dict(method="fdg", beta=0.7)),
        pytest.param(  # BatchNorm: the statistics are kept too
            "cnn", 2, dict(method="fdg", beta=0.7), marks=pytest.mark.slow
        ),
        pytest.param("mlp", 3, dict(method="ddg", memory="dots"), marks=pytest.mark.slow),
        pytest.param("gpt", 3, dict(method="pipedream"), marks=pytest.mark.slow),
        pytest.param("mlp", 3, dict(method="2bw", microbatches=2), marks=pytest.mark.slow),
        pytest.param(
            "mlp",
            3,
            dict(method="fdg", predict="momentum", predict_lr=0.05),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_records_saved_as_their_sources_are_computed_again_bit_for_bit(
    tmp_path, model, num_stages, options
):
    """With record_sources (the training command's), a checkpoint holds each kept VJP as
    the input, weights and statistics of its forward: a fraction of the state's size. The
    restore forwards them again, on another layout, to the same bits; a run resumed from
    it continues as one that never stopped. The control: the same forwards at other
    weights give other records."""
    options = dict(options, record_sources=True)
    data = batches(model, STEPS)
    pipe = build_pipeline(model, num_stages, devices=jax.devices()[:num_stages], **options)
    state = run(pipe, pipe.init(data[0]), data[:SAVE_AT])
    saved = jax.device_get(state)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, {"note": "mid-run"})
    held = stored(state)
    assert not any(isinstance(r, Residuals) for s in held.stages for r in s.kept)
    assert state_mib(state) < sum(a.nbytes for a in jax.tree.leaves(saved)) / 2**20
    uninterrupted = jax.device_get(run(pipe, state, data[SAVE_AT:]))
    devices = jax.devices()[:num_stages][::-1]
    fresh = build_pipeline(model, num_stages, devices=devices, **options)
    state = restored(tmp_path, fresh, data)
    assert all(isinstance(r, Residuals) for s in state.stages for r in s.kept)
    assert any(s.kept for s in state.stages)
    assert_equal(state, saved)
    k = next(k for k, s in enumerate(state.stages) if s.kept)
    kept = state.stages[k].kept[0]
    moved = kept.replace(params=jax.tree.map(jnp.negative, kept.params))
    recompute = fresh.stages[k].compile(fresh.specs[k].residual_layout).recompute
    again = recompute(Vars(), Given(record=moved.source))[1].record
    assert not jax.tree.all(
        jax.tree.map(
            np.array_equal, jax.device_get(again.residuals), saved.stages[k].kept[0].residuals
        )
    )
    assert_equal(run(fresh, state, data[SAVE_AT:]), uninterrupted)


@pytest.mark.parametrize("method", ["1f1b", "zb", "dualpipev"])
def test_chunked_schedules_resume_bit_identically_on_another_layout(tmp_path, method):
    """Interleaved 1F1B, ZB-V and DualPipeV (2 chunks on each of 2 groups) saved mid-run
    and resumed with the groups' devices swapped, then on one device: the same bits as a
    run that never stopped."""
    microbatches = 4 if method == "dualpipev" else 2  # DualPipeV: at least 2K
    options = dict(method=method, microbatches=microbatches, virtual_stages=2)
    data, uninterrupted = saved_and_continued(tmp_path, "mlp", 4, **options)
    for devices in (jax.devices()[1::-1], jax.devices()[:1]):
        fresh = build_pipeline("mlp", 4, devices=devices, **options)
        state = restored(tmp_path, fresh, data)
        assert [g[0] for g in fresh.placement.groups] == [
            devices[fresh.schedule.device_of(j) % len(devices)] for j in range(4)
        ]
        assert_equal(run(fresh, state, data[SAVE_AT:]), uninterrupted)


@pytest.mark.parametrize(
    "model, saved_with, resumed_with, record_sources",
    [
        ("mlp", 1, 2, False),
        pytest.param("cnn", 1, 2, False, marks=pytest.mark.slow),
        pytest.param("cnn", 2, 1, False, marks=pytest.mark.slow),
        pytest.param("cnn", 2, 1, True, marks=pytest.mark.slow),
        pytest.param("mlp", 1, 2, True, marks=pytest.mark.slow),
    ],
)
def test_resume_with_another_number_of_replicas(
    tmp_path, model, saved_with, resumed_with, record_sources
):
    """The same state whatever D: within float tolerance (the batch reductions are split
    differently), the kept residuals included, whether saved or computed again from their
    sources."""
    data = batches(model, STEPS)
    options = dict(method="fdg", beta=0.7, devices=jax.devices(), record_sources=record_sources)
    pipe = build_pipeline(model, 2, data_parallel=saved_with, **options)
    state = run(pipe, pipe.init(data[0]), data[:SAVE_AT])
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, {"note": "mid-run"})
    uninterrupted = jax.device_get(run(pipe, state, data[SAVE_AT:]))
    fresh = build_pipeline(model, 2, data_parallel=resumed_with, **options)
    state = restored(tmp_path, fresh, data)
    assert len(jax.tree.leaves(state.stages[0].params)[0].devices()) == resumed_with
    assert_close(run(fresh, state, data[SAVE_AT:]), uninterrupted, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_of_the_format_before_is_refused_in_one_line(tmp_path):
    """A checkpoint written before the format was (format 1: dgrad 0.2.0, its weights under
    `nnx.Variable`'s `value`) is refused before any array is read, naming its format and
    what to do; every checkpoint written now names format 3."""
    written = pathlib.Path(__file__).parent / "data" / "checkpoint_with_variables"
    shutil.copytree(written, tmp_path / "old")
    pipe = build_pipeline("cnn", 2, devices=jax.devices()[:2], method="fdg", beta=0.7)
    data = batches("cnn", 1)
    pipe.init(data[0])
    with (
        Checkpointer(tmp_path / "old") as checkpoints,
        pytest.raises(OtherFormat) as refused,
    ):
        checkpoints.restore(pipe)
    assert str(refused.value) == (
        f"The checkpoint at step 5 in {tmp_path / 'old'} is of format 1 (written by dgrad "
        "0.2.0 or before); this dgrad reads format 3 only: resume it with the dgrad that "
        "wrote it, or train the experiment again in a new --workdir."
    )
    with Checkpointer(tmp_path / "new") as checkpoints:
        checkpoints.save(pipe.init(data[0]))
        assert checkpoints.meta()["format"] == FORMAT == 3
        checkpoints.restore(pipe)  # the control: today's format restores


@pytest.mark.parametrize("extra", ["stashed weights", "a vjp's leaves apart"])
def test_records_of_another_layout_are_refused_in_one_line(tmp_path, extra):
    """A record holding arrays today's state does not (weights nothing reads, a VJP's
    leaves kept apart where today packs them) does not restore: one line names the first."""
    model = "mlp" if extra == "stashed weights" else "cnn"
    data = batches(model, SAVE_AT)
    pipe = build_pipeline(model, 2, devices=jax.devices()[:2], method="fdg")
    state = run(pipe, pipe.init(data[0]), data)
    layout = pipe.specs[0].residual_layout

    def changed(record):
        if extra == "stashed weights":
            return record.replace(params=state.stages[0].params)
        return record.replace(residuals=jax.tree.leaves(layout.unpack(record.residuals)))

    first = state.stages[0]
    old = state.replace(
        stages=(first.replace(kept=tuple(map(changed, first.kept))), *state.stages[1:])
    )
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(old)
        with pytest.raises(Unrestorable, match="holds stages/0/kept/0/.* beyond this pipeline"):
            checkpoints.restore(pipe)
        checkpoints.save(state.replace(step=state.step + 1))
        checkpoints.restore(pipe)  # the control: the same state as it is restores


def test_a_pipeline_that_keeps_weights_refuses_records_without_them(tmp_path):
    data = batches("mlp", 3)
    pipe = build_pipeline("mlp", 2, method="fdg")
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(run(pipe, pipe.init(data[0]), data))
    probed = build_pipeline("mlp", 2, method="fdg", probe_every=5)
    probed.init(data[0])
    with (
        Checkpointer(tmp_path) as checkpoints,
        pytest.raises(ValueError, match="records hold none"),
    ):
        checkpoints.restore(probed)


@pytest.mark.slow
def test_fused_backprop_resumes_bit_identically(tmp_path):
    data, uninterrupted = saved_and_continued(tmp_path, "cnn", 1, method="bp", fused=True)
    fresh = build_pipeline("cnn", 1, devices=jax.devices()[2:3], method="bp", fused=True)
    assert_equal(run(fresh, restored(tmp_path, fresh, data), data[SAVE_AT:]), uninterrupted)


def test_restores_onto_one_device(tmp_path):
    data, uninterrupted = saved_and_continued(tmp_path, "mlp", 3, method="fdg")
    single = build_pipeline("mlp", 3, devices=jax.devices()[3:], method="fdg")
    assert_equal(run(single, restored(tmp_path, single, data), data[SAVE_AT:]), uninterrupted)


def test_a_save_cut_short_is_ignored(tmp_path):
    """Orbax writes into a temporary directory and renames it when complete; what a
    process killed mid-write leaves behind is never taken for a checkpoint."""
    data = batches("mlp", 6)
    pipe = build_pipeline("mlp", 2, method="fdg")
    state = pipe.init(data[0])
    with Checkpointer(tmp_path) as checkpoints:
        state = run(pipe, state, data[:3])
        checkpoints.save(state)
        good = jax.device_get(state)
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
        state, _ = checkpoints.restore(pipe)
    assert_equal(state, good)


def test_restoring_into_another_model_says_so(tmp_path):
    data = batches("mlp", 3)
    pipe = build_pipeline("mlp", 2, method="fdg")
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(run(pipe, pipe.init(data[0]), data))
    three = build_pipeline("mlp", 3, method="fdg")
    three.init(data[0])
    with Checkpointer(tmp_path) as checkpoints, pytest.raises(ValueError, match="stages"):
        checkpoints.restore(three)
    other_split = dgrad.Pipeline(
        dgrad.models.mlp([6, 16, 16, 16, 3], num_stages=2, split=[3]),
        optimizer=optimizer,
        method="fdg",
    )
    other_split.init(data[0])
    with Checkpointer(tmp_path) as checkpoints, pytest.raises(ValueError, match="another model"):
        checkpoints.restore(other_split)


@pytest.mark.parametrize(
    "other, where",
    [
        ({"predict": "update"}, "holds stages/0/opt_state/1/0/trace/"),
        ({"memory": "recompute"}, "holds stages/0/kept/0/residuals/"),
    ],
)
def test_restoring_with_other_options_names_what_differs(tmp_path, other, where):
    """A checkpoint of another optimizer state or timetable is one line naming the
    first array that differs, not orbax's tree diff."""
    data = batches("mlp", 3)
    pipe = build_pipeline("mlp", 2, method="ddg")
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(run(pipe, pipe.init(data[0]), data))
    changed = build_pipeline("mlp", 2, **{"method": "ddg", **other})
    changed.init(data[0])
    with Checkpointer(tmp_path) as checkpoints, pytest.raises(ValueError, match=where):
        checkpoints.restore(changed)


def test_missing_checkpoint_says_where_it_looked(tmp_path):
    pipe = dgrad.Pipeline(build_stages("mlp", 2), optimizer=optimizer)
    pipe.init(batches("mlp", 1)[0])
    with Checkpointer(tmp_path / "empty") as checkpoints:
        assert checkpoints.latest_step() is None
        with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
            checkpoints.restore(pipe)
    shutil.rmtree(tmp_path / "empty")


def saved_twice(tmp_path):
    """A run saved after steps 3 and 6; the pipeline and its state at step 3 (on host)."""
    data = batches("mlp", 6)
    pipe = build_pipeline("mlp", 2, method="fdg")
    state = run(pipe, pipe.init(data[0]), data[:3])
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, {"note": "at 3"})
        at_3 = jax.device_get(state)
        checkpoints.save(run(pipe, state, data[3:]), {"note": "at 6"})
    return pipe, at_3


@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_one_line_naming_it_and_the_one_before_restores(tmp_path, how):
    pipe, at_3 = saved_twice(tmp_path)
    damage(tmp_path / "6", how)
    with Checkpointer(tmp_path) as checkpoints:
        assert checkpoints.all_steps() == [3, 6]
        with pytest.raises(Unrestorable) as failed:
            checkpoints.restore(pipe)
        state, extra = checkpoints.restore(pipe, 3)
    message = str(failed.value)
    assert message.startswith(f"The checkpoint at step 6 in {tmp_path} does not restore: ")
    assert DAMAGES[how] in failed.value.reason and "\n" not in message and len(message) < 500
    assert failed.value.step == 6 and extra == {"note": "at 3"}
    assert_equal(state, at_3)


def test_a_checkpoint_set_aside_is_kept_and_out_of_the_way_of_later_saves(tmp_path):
    pipe, at_3 = saved_twice(tmp_path)
    damage(tmp_path / "6", "truncated data")
    with Checkpointer(tmp_path, keep=2) as checkpoints:
        where = checkpoints.set_aside(6)
        assert where == str(tmp_path / "damaged" / "6") and checkpoints.all_steps() == [3]
        state, _ = checkpoints.restore(pipe)
        assert_equal(jax.device_get(state), at_3)
        data = batches("mlp", 6)
        state = run(pipe, state, data[3:5])
        checkpoints.save(state)
        checkpoints.save(run(pipe, state, data[5:]))  # step 6 again, over nothing
        assert checkpoints.all_steps() == [5, 6]
        checkpoints.restore(pipe)
    damage(tmp_path / "6", "deleted data")
    with Checkpointer(tmp_path) as checkpoints:  # the same step set aside twice: both kept
        assert checkpoints.set_aside(6) == str(tmp_path / "damaged" / "6-2")
    assert sorted(os.listdir(tmp_path / "damaged")) == ["6", "6-2"]


def hold_array_writes(monkeypatch):
    """Holds orbax's writes of array data (after their copy to host) until the returned
    event is set, so that a test can act while a checkpoint is being written."""
    import asyncio
    import threading

    from orbax.checkpoint._src.serialization import jax_array_handlers

    released, original = threading.Event(), jax_array_handlers._async_serialize_replica_slices

    async def held(*args, **kwargs):
        await asyncio.to_thread(released.wait, 120)
        return await original(*args, **kwargs)

    monkeypatch.setattr(jax_array_handlers, "_async_serialize_replica_slices", held)
    return released


def test_steps_run_while_a_checkpoint_is_written_and_it_restores_bit_identically(
    tmp_path, monkeypatch
):
    """The steps after a save donate the saved state's buffers while its files are still
    being written; the checkpoint holds the state as it was when saved."""
    data = batches("mlp", STEPS)
    pipe = build_pipeline("mlp", 3, devices=jax.devices()[:3], method="fdg", beta=0.7)
    state = run(pipe, pipe.init(data[0]), data[:SAVE_AT])
    saved = jax.device_get(state)
    released = hold_array_writes(monkeypatch)
    with Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(state, {"note": "mid-run"})
        state = run(pipe, state, data[SAVE_AT:])  # (donates the saved buffers)
        assert checkpoints.writing() and os.listdir(tmp_path) == [f"{SAVE_AT}.orbax-checkpoint-tmp"]
        released.set()
        checkpoints.wait()
        assert not checkpoints.writing() and os.listdir(tmp_path) == [str(SAVE_AT)]
    assert state.step == STEPS
    fresh = build_pipeline("mlp", 3, devices=jax.devices()[3:6], method="fdg", beta=0.7)
    assert_equal(restored(tmp_path, fresh, data), saved)


def test_a_save_waits_for_the_write_before_it_and_keep_counts_complete_ones(tmp_path, monkeypatch):
    """While step 3's checkpoint is written, steps 1 and 2 stay on disk (orbax deletes
    beyond `keep` once the new one is complete); reading a checkpoint waits for the write."""
    data = batches("mlp", 3)
    pipe = build_pipeline("mlp", 2, method="fdg")
    state = pipe.init(data[0])
    with Checkpointer(tmp_path, keep=2) as checkpoints:
        for batch in data[:2]:
            state, _ = pipe.step(state, batch)
            checkpoints.save(state)
        released = hold_array_writes(monkeypatch)
        state, _ = pipe.step(state, data[2])
        checkpoints.save(state, {"note": "at 3"})
        assert sorted(os.listdir(tmp_path)) == ["1", "2", "3.orbax-checkpoint-tmp"]
        released.set()
        assert checkpoints.extra(3) == {"note": "at 3"}  # (waits for the write)
        assert sorted(os.listdir(tmp_path)) == ["2", "3"]


def test_an_error_becomes_one_short_line_that_keeps_its_head_and_its_cause():
    import json

    from dgrad.train.checkpoint import _one_line

    spec = " [tensorstore_spec='{...}']"
    message = "OUT_OF_RANGE: Requested byte range [0, 924) is not valid"
    assert _one_line(ValueError(message + "\n" + spec)) == message  # orbax's: no type, no spec
    try:
        json.loads("{not json")
    except ValueError as error:
        assert _one_line(error).startswith("JSONDecodeError: Expecting property name")
    long = _one_line(ValueError("NOT_FOUND: Error reading " + "a/" * 200 + "d/4f1c"), limit=40)
    assert long == "NOT_FOUND: Error  ... a/a/a/a/a/a/a/d/4f1c"
