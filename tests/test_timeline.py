"""dgrad.measure.timeline: which stage function ran when, on which device, for which batch."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_equal

import dgrad
from dgrad import models
from dgrad.measure.timeline import Timeline


def test_timeline_watches_from_outside_without_changing_numbers(tmp_path):
    batches = [(jnp.full((4, 6), float(i)), jnp.zeros((4,), jnp.int32)) for i in range(6)]

    def train(timeline=None):
        stages = models.mlp([6, 16, 16, 3], num_stages=2)
        pipe = dgrad.Pipeline(
            stages, method="fdg", optimizer=optax.sgd(0.1), devices=jax.devices()[:2]
        )
        state = pipe.init(batches[0])
        stepper = timeline.watch(pipe) if timeline else pipe
        for batch in batches:
            state, _ = stepper.step(state, batch)
        if timeline:
            timeline.close()
        return jax.device_get([s.params for s in state.stages])

    timeline = Timeline()
    assert_equal(train(timeline), train())
    names = {(e.device, e.name) for e in timeline.events}
    assert names == {(0, "forward"), (0, "step"), (1, "loss_step")}
    assert len([e for e in timeline.events if e.name == "loss_step"]) == 5  # after one fill step
    for device in (0, 1):
        events = [e for e in timeline.events if e.device == device]
        assert all(e.start <= e.end for e in events)
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
    assert all(0 < f <= 1 for f in timeline.busy_fraction().values())
    timeline.chrome_trace(tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(timeline.events)
    timeline.gantt(tmp_path / "gantt.png", title="test")
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_timeline_records_each_microbatch_in_the_order_the_stages_ran_them(method):
    batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    stages = models.mlp([6, 16, 16, 3], num_stages=2)
    pipe = dgrad.Pipeline(
        stages, method=method, microbatches=4, optimizer=optax.sgd(0.1), devices=jax.devices()[:2]
    )
    state, timeline = pipe.init(batch), Timeline()
    watched = timeline.watch(pipe)
    for _ in range(2):
        state, _ = watched.step(state, batch)
    timeline.close()
    stage_0 = [(e.name, e.unit) for e in timeline.events if e.stage == 0 and e.step == 1]
    forwards = [("forward", (1, m)) for m in range(4)]
    backwards = [("backward_sum", (1, m)) for m in range(4)]
    if method == "gpipe":  # every forward, then the backwards in the order the losses ran
        assert stage_0 == [*forwards, *backwards, ("apply_sum", None)]
    else:  # 1F1B on stage 0 of 2: one forward to fill, then one forward and one backward
        order = [forwards[0], forwards[1], backwards[0], forwards[2], backwards[1], forwards[3]]
        assert stage_0 == [*order, *backwards[2:], ("apply_sum", None)]
    stage_1 = [e.unit for e in timeline.events if e.stage == 1 and e.step == 1]
    assert stage_1 == [*((1, m) for m in range(4)), None]  # four losses, then the update


@pytest.mark.slow
@pytest.mark.parametrize("method, virtual_stages", [("1f1b", 2), ("zb", 1), ("zb", 2), ("2bw", 1)])
def test_timeline_follows_the_chunked_and_zero_bubble_timetables(method, virtual_stages, tmp_path):
    """Interleaved 1F1B, ZB-H1, ZB-V and 2BW: each stage's recorded calls are its timetable's
    units in order, each on its group's device; the chart draws them."""
    batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    chunks = 2 * virtual_stages
    pipe = dgrad.Pipeline(
        models.mlp([6, 16, 16, 16, 16, 3], num_stages=chunks),
        method=method,
        microbatches=4,
        virtual_stages=virtual_stages,
        optimizer=optax.sgd(0.1),
        devices=jax.devices()[:2],
    )
    state, timeline = pipe.init(batch), Timeline()
    watched = timeline.watch(pipe)
    for _ in range(3):
        state, _ = watched.step(state, batch)
    timeline.close()
    for k in range(chunks):
        recorded = [e.unit for e in timeline.events if e.stage == k and e.step == 1]
        assert recorded == [c.shown_unit for c in pipe.schedule.work(1) if c.stage == k], k
    placed = {(k, pipe.placement.groups[k][0].id) for k in range(chunks)}
    assert {(e.stage, e.device) for e in timeline.events} == placed
    assert {device for _, device in placed} == {0, 1}
    names = {e.name for e in timeline.events}
    assert ("backward_weights" in names) == (method == "zb")  # zero-bubble's W
    assert ("backward_input" in names) == (method == "zb" and chunks > 2)  # B: middle chunks
    timeline.gantt(tmp_path / "gantt.png", title=method)
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"


def test_a_step_that_fails_leaves_the_timeline_counting_right():
    batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    pipe = dgrad.Pipeline(models.mlp([6, 16, 3], num_stages=2), optimizer=optax.sgd(0.1))
    state, timeline = pipe.init(batch), Timeline()
    watched = timeline.watch(pipe)
    with pytest.raises(ValueError, match="every batch must match"):
        watched.step(state, (jnp.ones((4, 6)), jnp.zeros((4,), jnp.int32)))
    watched.predict(state, batch[0])  # outside a step: no unit
    state, _ = watched.step(state, batch)
    timeline.close()
    recorded = sorted((e.stage, e.name, e.unit) for e in timeline.events)  # two devices' threads
    assert recorded == [(0, "forward", 0), (0, "predict", None), (1, "predict", None)]
