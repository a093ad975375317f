"""Block profiling, the speedup ceiling, the memory of the policies, and the benchmark script."""

import contextlib
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import dgrad
from dgrad import balance, models
from dgrad.timeline import Timeline
from experiments.benchmark import state_bytes_per_device

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_profile_blocks_times_every_block():
    chain = models.cifar_resnet_blocks(8, 10, width=4, in_channels=1)
    times = balance.profile_blocks(chain.modules, jnp.ones((4, 8, 8, 1)), repeats=2)
    assert len(times) == len(chain.modules) and all(t > 0 for t in times)
    cuts = balance.balanced_cuts(times, 2)
    assert 1.0 <= balance.speedup_ceiling(times, cuts) <= 2.0


def test_stage_costs_and_ceiling():
    assert balance.stage_costs([1, 2, 3, 4], [2, 3]) == [3.0, 3.0, 4.0]
    assert balance.speedup_ceiling([1, 2, 3, 4], [2, 3]) == pytest.approx(10 / 4)
    assert balance.speedup_ceiling([5, 5], []) == 1.0


def _pending_bytes(depth, weights, memory):
    stages = models.cifar_resnet(depth, 3, 2, width=4, in_channels=1, split="balanced")
    pipe = dgrad.Pipeline(
        stages,
        method="fdg",
        optimizer=optax.sgd(0.1),
        weights=weights,
        memory=memory,
        devices=jax.devices()[:2],
    )
    batch = (jnp.ones((8, 8, 8, 1)), jnp.zeros((8,), jnp.int32))
    state = pipe.init(batch)
    for i in range(5):  # distinct inputs, so no two records share a buffer
        state, _ = pipe.step(state, (batch[0] + i, batch[1]))
    pending = state.stages[0].pending
    assert len(pending) == 2  # batches in flight on stage 0 of an FDG K=2 pipeline
    return sum(state_bytes_per_device(pending).values())


def test_recompute_memory_scales_with_batches_in_flight_not_depth():
    shallow, deep = (_pending_bytes(d, "current", "recompute") for d in (8, 32))
    assert shallow == deep == 2 * 8 * 8 * 8 * 1 * 4  # two stored inputs of stage 0
    kept_shallow, kept_deep = (_pending_bytes(d, "stash", "residuals") for d in (8, 32))
    assert kept_deep > 2 * kept_shallow  # residuals grow with the layers of the stage


def test_timeline_records_each_device_in_order_without_changing_numbers(tmp_path):
    batches = [(jnp.full((4, 8, 8, 1), float(i)), jnp.zeros((4,), jnp.int32)) for i in range(6)]

    def train(timeline=None):
        stages = models.cifar_resnet(8, 3, 2, width=4, in_channels=1, split="balanced")
        pipe = dgrad.Pipeline(
            stages, method="fdg", optimizer=optax.sgd(0.1), devices=jax.devices()[:2]
        )
        state = pipe.init(batches[0])
        with pipe.trace(timeline) if timeline else contextlib.nullcontext():
            for batch in batches:
                state, _ = pipe.step(state, batch)
        return jax.device_get([s.params for s in state.stages])

    timeline = Timeline()
    traced = train(timeline)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(train())):
        assert (a == b).all()
    names = {(e.device, e.name) for e in timeline.events}
    assert names == {(0, "forward_keep"), (0, "backward_kept"), (0, "update"), (1, "loss_step")}
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


def test_benchmark_runs_at_tiny_size(tmp_path):
    """Numbers are not asserted here; the script must run and print its whole table."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            "--model",
            "resnet8",
            "--width",
            "4",
            "--image-size",
            "8",
            "--batch-size",
            "4",
            "--stages",
            "1,2",
            "--windows",
            "2",
            "--steps",
            "2",
            "--policies",
            "--timeline",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names == [
        "bp fused",
        "bp staged",
        "ddg",
        "ddg",
        "fdg",
        "fdg",
        "fdg stash/recompute",
        "fdg current/recompute",
    ]
    assert "predicted ceiling" in result.stdout and "fake CPU devices" in result.stdout
    assert len(list(tmp_path.glob("*.png"))) == len(list(tmp_path.glob("*.json"))) == len(names)
