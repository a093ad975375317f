"""Block profiling, the speedup ceiling, the memory of the policies, the timeline, and the
benchmark script."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import ROOT, assert_equal
from processes import run_command

import dgrad
from dgrad import balance, benchmark, models
from dgrad.benchmark import state_bytes_per_device
from dgrad.timeline import Timeline


def test_profile_blocks_times_every_block():
    chain = models.mlp_blocks([16, 64, 64, 64, 4])
    times = balance.profile_blocks(chain.modules, jnp.ones((4, 16)), repeats=2)
    assert len(times) == len(chain.modules) and all(t > 0 for t in times)
    cuts = balance.balanced_cuts(times, 2)
    assert 1.0 <= balance.speedup_ceiling(times, cuts) <= 2.0


def test_stage_costs_and_ceiling():
    assert balance.stage_costs([1, 2, 3, 4], [2, 3]) == [3.0, 3.0, 4.0]
    assert balance.speedup_ceiling([1, 2, 3, 4], [2, 3]) == pytest.approx(10 / 4)
    assert balance.speedup_ceiling([5, 5], []) == 1.0


def _kept_bytes(depth, weights, memory):
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
    kept = state.stages[0].kept
    assert len(kept) == 2  # batches in flight on stage 0 of an FDG K=2 pipeline
    inputs = [getattr(record, "inputs", None) for record in kept]
    return sum(state_bytes_per_device(kept).values()), sum(state_bytes_per_device(inputs).values())


@pytest.mark.slow
def test_memory_of_the_policies():
    """Recompute keeps the inputs of the batches in flight, whatever the depth; kept
    residuals grow with the stage's layers; dots keeps less than all residuals."""
    (shallow, _), (deep, _) = (_kept_bytes(d, "current", "recompute") for d in (8, 32))
    assert shallow == deep == 2 * 8 * 8 * 8 * 1 * 4  # two stored inputs of stage 0
    kept_shallow, _ = _kept_bytes(8, "stash", "residuals")
    kept_deep, _ = _kept_bytes(32, "stash", "residuals")
    assert kept_deep > 2 * kept_shallow
    dots_deep, _ = _kept_bytes(32, "stash", "dots")
    assert dots_deep < kept_deep


def test_the_plain_floor_trains_copies_and_leaves_the_modules_alone():
    stages = models.mlp([6, 16, 3])
    before = jax.tree.map(lambda a: a.copy(), nnx.state(stages[0]))
    batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    floor = benchmark.plain_case("plain", stages, optax.sgd(0.1), batch)  # 2 donated steps
    assert_equal(nnx.state(stages[0]), before)  # readable and unchanged
    trained = jax.tree.leaves(floor.state[0])
    assert len(trained) == len(jax.tree.leaves(before))
    assert not all(bool(jnp.array_equal(a, b)) for a, b in zip(trained, jax.tree.leaves(before)))


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


def test_the_quick_mode_sets_defaults_that_given_flags_change():
    from experiments.benchmark import parse_args

    quick = parse_args(["--quick"])
    assert (quick.model, quick.width, quick.batch_size, quick.stages) == ("resnet8", 8, 32, [1, 2])
    assert (quick.windows, quick.steps, quick.split) == (3, 3, "balanced")
    given = parse_args(["--quick", "--model=mlp", "--windows=2", "--steps=2", "--split=profiled"])
    assert (given.model, given.windows, given.steps, given.split) == ("mlp", 2, 2, "profiled")
    assert given.batch_size == 32


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--methods=ddg,fdx"], "--methods: unknown 'fdx'; choose from ddg, fdg, fr, dgl"),
        (["--windows=0"], "--windows must be positive"),
        (["--batch-size=0"], "--batch-size must be positive"),
        (["--batch-size=3", "--data-parallel=1,2"], "does not split between 2 replicas"),
        (["--stages=0,2"], "--stages values must be positive"),
        (["--model=gpt", "--methods=dgl"], "--methods dgl: its auxiliary heads classify images"),
        (["--model=gpt", "--dim=10", "--heads=4"], "--dim 10 must be a multiple of --heads 4"),
        (["--model=gpt", "--context=0"], "--context must be positive"),
    ],
)
def test_bad_benchmark_flags_are_one_line(flags, message, capsys):
    from experiments.benchmark import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(flags)
    assert exited.value.code == 2 and message in capsys.readouterr().err


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
    if method == "gpipe":  # every forward, then the backwards last microbatch first
        assert stage_0 == [*forwards, *reversed(backwards), ("apply_sum", None)]
    else:  # 1F1B on stage 0 of 2: one forward to fill, then one forward and one backward
        order = [forwards[0], forwards[1], backwards[0], forwards[2], backwards[1], forwards[3]]
        assert stage_0 == [*order, *backwards[2:], ("apply_sum", None)]
    stage_1 = [e.unit for e in timeline.events if e.stage == 1 and e.step == 1]
    assert stage_1 == [*((1, m) for m in range(4)), None]  # four losses, then the update


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


@pytest.mark.slow
def test_benchmark_runs_its_quick_mode_with_replicas(tmp_path):
    """Numbers are not asserted here; the script must run and print its whole table."""
    status, output = run_command(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            "--quick",
            "--model=mlp",
            "--image-size=8",
            "--data-parallel=1,2",
            "--methods=fdg,gpipe",
            "--microbatches=2",
            "--windows=2",
            "--steps=2",
            f"--timeline={tmp_path}",
        ],
        timeout=600,
        cwd=ROOT,
    )
    rows = [line for line in output.splitlines() if line.startswith("| ") and "---" not in line]
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names[:3] == ["plain JAX (no dgrad)", "bp fused", "bp fused, data parallel"]
    assert ("fdg", "2", "2") in [tuple(r.split("|")[i].strip() for i in (1, 2, 3)) for r in rows]
    assert re.search(r"\| gpipe M=2 \| 2 \| 1 \|.*\| \d+ \d+ \[33\] \|", output), (
        output
    )  # idle [1/3]
    assert len(list(tmp_path.glob("*.png"))) == len(rows) - 2  # every pipeline traced


@pytest.mark.slow
def test_the_benchmark_across_processes_prints_every_case_and_the_moves():
    status, output = run_command(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            "--processes=2",
            "--model=mlp",
            "--image-size=4",
            "--batch-size=16",
            "--windows=2",
            "--steps=2",
            "--split=balanced",
        ],
        timeout=600,
        cwd=ROOT,
    )
    rows = [
        line for line in output.splitlines() if line.startswith("| ") and "samples/s" not in line
    ]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == ["bp fused, pinned", "fdg K=2, one process", "fdg K=2, 2 processes pinned"]
    assert rows[0].split("|")[3].strip() == "1.00 [1.00-1.00]"
    assert re.search(r"# moves between the processes: \d+\.\d\d ms/step", output), output
    assert "# predicted ceiling (sum of stage costs / slowest stage): " in output


@pytest.mark.slow
def test_the_gpt_benchmark_counts_tokens_and_model_flops():
    """Each row's tokens/s is its samples/s times the context, and its MFU its model FLOP/s
    over the peak given."""
    status, output = run_command(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            "--model=gpt",
            "--layers=2",
            "--dim=16",
            "--heads=2",
            "--context=8",
            "--batch-size=8",
            "--stages=1,2",
            "--methods=fdg",
            "--split=balanced",
            "--windows=2",
            "--steps=2",
            "--peak-tflops=0.01",
        ],
        timeout=600,
        cwd=ROOT,
    )
    lines = output.splitlines()
    header = next(line for line in lines if line.startswith("| configuration"))
    columns = [c.strip() for c in header.split("|")[1:-1]]
    assert columns[-3:] == ["tokens/s", "model TFLOP/s", "MFU %"], header
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and line != header]
    rows = [[c.strip() for c in row] for row in rows if "---" not in row[0]]
    assert [(row[0], row[1]) for row in rows][-2:] == [("bp staged", "2"), ("fdg", "2")]
    for row in rows:
        samples = float(row[3].split()[0])
        assert float(row[-3]) == pytest.approx(8 * samples, rel=2e-3, abs=1), row
        assert float(row[-1]) == pytest.approx(100 * float(row[-2]) / 0.01, rel=0.02), row
