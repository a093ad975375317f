"""dgrad.measure.benchmark and experiments/benchmark.py: the memory of the policies, the
plain floor, the quick mode and its flags, the benchmark across processes and the GPT's
rows."""

import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ROOT, assert_equal
from processes import run_command

import dgrad
from dgrad import models
from dgrad.measure import benchmark, benchmark_command
from dgrad.measure.benchmark import state_bytes_per_device


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


@pytest.mark.slow
def test_the_dispatch_floors_count_freeing_what_the_calls_gave_back():
    """The engine frees every array a call gives back within its step's time, so the
    floors' bare loops count freeing too, on the real clock: calls that give back an array
    of 200,000 Python objects, made beforehand, cost the loop that drops them the freeing
    (milliseconds), and the same calls whose outputs stay referenced cost microseconds."""

    def outputs(count):
        made = []
        for _ in range(count):
            held = np.empty(200_000, dtype=object)
            held[:] = [[i] for i in range(held.size)]
            made.append(held)
        return made

    def calls(made, keep):
        def call():
            return jnp.zeros(()), (made[-1] if keep else made.pop())

        return [call] * len(made)

    benchmark._host_seconds(calls(outputs(1), keep=True))  # jnp.zeros compiled here
    for wait_each in (False, True):
        kept = benchmark._host_seconds(calls(outputs(3), keep=True), wait_each=wait_each)
        freed = benchmark._host_seconds(calls(outputs(3), keep=False), wait_each=wait_each)
        assert freed > 10 * kept and freed > 3e-3, (wait_each, freed, kept)


def test_each_case_steps_on_its_batch_placed_once_where_its_step_takes_it():
    """As the training stream hands batches over placed, so no timed step copies a host
    batch; a case without its own batch gets the one `measure` is given."""
    host = (np.ones((8, 6), np.float32), np.zeros((8,), np.int32))
    pipe = dgrad.Pipeline(
        models.mlp([6, 8, 3], num_stages=2), optimizer=optax.sgd(0.1), devices=jax.devices()[:2]
    )
    placed = benchmark.pipeline_case("fdg", pipe, host)
    floor = benchmark.plain_case("plain", models.mlp([6, 8, 3]), optax.sgd(0.1), host)
    fed = {}

    def watch(case):
        step = case.step

        def watched(state, batch):
            fed.setdefault(case.name, []).append(batch)
            return step(state, batch)

        case.step = watched

    bare = benchmark.Case("bare", 1, 1, lambda state, batch: (state, {}), None)
    for case in (placed, floor, bare):
        watch(case)
    benchmark.measure([placed, floor, bare], host, windows=2, steps=2)
    assert placed.batch[0].sharding == pipe.placement.sharded(0)
    assert floor.batch[1].devices() == {jax.devices()[0]}
    for case in (placed, floor):
        assert len(fed[case.name]) == 4 and all(b is case.batch for b in fed[case.name])
    assert all(b is host for b in fed["bare"])


def test_the_plain_floor_trains_copies_and_leaves_the_modules_alone():
    stages = models.mlp([6, 16, 3])
    before = jax.tree.map(lambda a: a.copy(), nnx.state(stages[0]))
    batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    floor = benchmark.plain_case("plain", stages, optax.sgd(0.1), batch)  # 2 donated steps
    assert_equal(nnx.state(stages[0]), before)  # readable and unchanged
    trained = jax.tree.leaves(floor.state[0])
    assert len(trained) == len(jax.tree.leaves(before))
    assert not all(bool(jnp.array_equal(a, b)) for a, b in zip(trained, jax.tree.leaves(before)))


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
        (["--against-command", "--model=mlp", "--stages=2"], "times CIFAR ResNets"),
        (["--against-command", "--stages=1,2"], "needs one K of 2 or more"),
        (["--against-command", "--stages=2", "--command-epochs=1"], "at least 2"),
        (["--against-command", "--stages=2", "--split=profiled"], "cuts as the training command"),
        (["--methods="], "--methods is empty; name one or more of ddg, fdg"),
        (["--against-command", "--stages=2", "--virtual-stages=2"], "times V = 1 rows only"),
        (["--processes=2", "--virtual-stages=3"], "--processes times V = 1 rows only"),
        (["--processes=2", "--methods=dualpipev"], "dualpipev runs as a V of 2K chunks"),
    ],
)
def test_bad_benchmark_flags_are_one_line(flags, message, capsys):
    from experiments.benchmark import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(flags)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_processes_time_one_microbatch_count(capsys):
    from experiments.benchmark import main

    flags = ["--processes=2", "--methods=gpipe", "--model=mlp", "--split=balanced"]
    with pytest.raises(SystemExit) as exited:
        main(flags)  # --microbatches defaults to 4,8
    assert exited.value.code == 2
    assert "give gpipe one --microbatches value, not 4,8" in capsys.readouterr().err


@pytest.mark.slow
def test_a_split_the_model_lacks_is_one_line():
    """The papers give ResNet-20 no split into 3 stages: one line, exit 2, no traceback."""
    status, output = run_command(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            "--model=resnet20",
            "--split=authors",
            "--stages=3",
            "--methods=fdg",
        ],
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert status == 2 and "Traceback" not in output, output
    assert errors == [
        "error: --split authors: The papers give no split of resnet20 into 3 stages (they give "
        "K in none); use split='balanced' or explicit cuts."
    ], output


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["nope"],
            "error: unknown part 'nope'; use scale, gpt, sync or all (then benchmark flags)",
        ),
        (
            ["sync", "--model", "gpt"],
            "error: no GPU found by JAX; install the cuda12 extra: pip install -e '.[cuda12]'",
        ),
    ],
)
def test_the_gpu_check_refuses_in_one_line(args, message):
    """An unknown part, or a machine whose JAX sees no GPU, is one line and exit 2 before
    anything is timed."""
    status, output = run_command(
        ["bash", str(ROOT / "experiments" / "gpu_check.sh"), *args],
        timeout=120,
        env={"PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    assert (status, output.strip()) == (2, message), output


def test_the_gpu_check_names_a_python_without_jax(tmp_path):
    without_jax = tmp_path / "python"
    without_jax.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'jax'\" >&2\nexit 1\n"
    )
    without_jax.chmod(0o755)
    status, output = run_command(
        ["bash", str(ROOT / "experiments" / "gpu_check.sh"), "sync"],
        timeout=120,
        env={"PYTHON": str(without_jax)},
        check=False,
    )
    assert status == 2, output
    assert output.strip() == (
        f"error: {without_jax} could not list JAX's devices (ModuleNotFoundError: No module "
        "named 'jax'); install dgrad there, or set PYTHON=/path/to/python"
    )


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
            "--methods=fdg,gpipe,zb,1f1b",
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
    assert {"zb M=2", "zb V=2 M=2", "1f1b M=2", "1f1b V=2 M=2"} <= set(names)
    predicted = [row.split("|")[11].strip() for row in rows if "M=2" in row]
    assert all(re.fullmatch(r"[\d.]+ / [\d.]+", p) for p in predicted), predicted
    assert len(list(tmp_path.glob("*.png"))) == len(rows) - 2  # every pipeline traced


@pytest.mark.processes
@pytest.mark.slow
def test_the_benchmark_across_processes_prints_every_method_its_ceiling_and_moves():
    """Each of --methods in one process and across processes beside fused BP pinned; each
    row's ceiling is the split's times 1 - the timetable's ideal bubble (GPipe M=2 at
    K=2: 1/3), and the share reached is the measured ratio over it."""
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
            "--methods=fdg,gpipe",
            "--microbatches=2",
        ],
        timeout=600,
        cwd=ROOT,
    )
    table = [line for line in output.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [line.split("|") for line in table[1:]]
    assert [row[1].strip() for row in rows] == [
        "bp fused, pinned",
        "fdg K=2, one process",
        "fdg K=2, 2 processes pinned",
        "gpipe M=2 K=2, one process",
        "gpipe M=2 K=2, 2 processes pinned",
    ], output
    assert rows[0][3].strip() == "1.00 [1.00-1.00]"
    ceiling = float(output.split("slowest stage): ")[1].split("x")[0])
    fdg, gpipe = float(rows[1][4]), float(rows[3][4])
    assert fdg == pytest.approx(ceiling, abs=0.01) and gpipe == pytest.approx(
        ceiling * 2 / 3, abs=0.01
    )
    for row in rows[1:]:
        ratio, top = float(row[3].split()[0]), float(row[4])  # (both rounded)
        assert abs(float(row[5].strip().rstrip("%")) - 100 * ratio / top) <= 1.5, row
    for label in ("fdg", "gpipe M=2"):
        assert re.search(rf"# moves between the processes, {label}: \d+\.\d\d ms/step", output)


@pytest.mark.processes
@pytest.mark.slow
def test_the_benchmark_times_the_training_command_beside_the_engine():
    """Every case in both layouts: the engine's and fused BP's two windows and the command's
    steady epochs of each round, and one table row with the command's ratio to each."""
    status, output = run_command(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            "--against-command",
            "--model=resnet8",
            "--width=4",
            "--batch-size=16",
            "--stages=2",
            "--methods=fdg,1f1b",
            "--microbatches=2",
            "--windows=1",
            "--steps=3",
            "--command-epochs=3",
        ],
        timeout=900,
        cwd=ROOT,
    )
    rounds = re.findall(
        r"# round 1: (.+), (.+): engine [\d.]+ / [\d.]+, command (.+) samples/s; fused BP "
        r"pinned [\d.]+ / [\d.]+",
        output,
    )
    assert [(case, layout) for case, layout, _ in rounds] == [
        ("fdg", "one process"),
        ("fdg", "2 processes pinned"),
        ("1f1b M=2", "one process"),
        ("1f1b M=2", "2 processes pinned"),
    ], output
    assert all(len(epochs.split()) == 2 for _, _, epochs in rounds), output  # epochs 2 and 3
    rows = [line.split("|") for line in output.splitlines() if line.startswith("| 1f1b M=2 ")]
    assert [row[2].strip() for row in rows] == ["one process", "2 processes pinned"], output
    ratio = r" [\d.]+ \[[\d.]+-[\d.]+\] "  # command / engine, command x fused BP pinned
    assert all(re.fullmatch(ratio, row[5]) and re.fullmatch(ratio, row[6]) for row in rows), rows


@pytest.mark.processes
@pytest.mark.parametrize("processes", [1, 2])
def test_a_failing_training_command_raises_with_its_output(tmp_path, processes):
    """The command's side of `--against-command` stops at once when the command fails, in
    one process and on pinned processes (`launch_local`), and says what it printed."""
    layout = benchmark_command.Layout.of(2)[processes - 1]
    flags = ["--config", "experiments/configs/default.py:smoke", "--config.no_such_field=1"]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)failed \(status 2.*no_such_field"):
        benchmark_command.run_command(flags, layout, str(tmp_path), timeout_s=240)
    assert time.monotonic() - start < 120
    assert os.listdir(tmp_path) == []  # nothing written for a refused run


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


@pytest.mark.slow
def test_the_dispatch_states_table_has_a_row_per_pipeline_beside_its_engine_cost():
    """`--dispatch-states` adds a table: each pipeline's engine µs per call (the main table's)
    and its step's calls replayed in the four queue states of `dispatch_by_queue`."""
    status, output = run_command(
        [
            sys.executable,
            "-m",
            "experiments.benchmark",
            "--quick",
            "--model=mlp",
            "--image-size=8",
            "--stages=2",
            "--methods=gpipe,fdg",
            "--microbatches=2",
            "--virtual-stages=1",
            "--windows=2",
            "--steps=2",
            "--dispatch-states",
        ],
        timeout=600,
        cwd=ROOT,
    )
    assert status == 0, output
    lines = output.splitlines()
    main = lines.index(next(line for line in lines if "host µs per call / floor" in line))
    states = lines.index(
        next(line for line in lines if line.startswith("| configuration | K | D | engine"))
    )
    engine = {
        row.split("|")[1].strip(): row.split("|")[7].split("/")[0].strip()
        for row in lines[main + 2 : states]
        if row.startswith("| ") and row.split("|")[2].strip() == "2"
    }
    assert [cell.strip() for cell in lines[states].split("|")[4:-1]] == [
        "engine",
        "repeated alone",
        "in order",
        "in order, behind busy devices",
        "each on an idle device",
    ], lines[states]
    rows = [
        [cell.strip() for cell in row.split("|")[1:-1]]
        for row in lines[states + 2 :]
        if row.startswith("| ")
    ]
    assert {row[0]: row[3] for row in rows} == engine, output
    assert sorted(engine) == ["bp staged", "fdg", "gpipe M=2"], output
    assert all(float(cell) > 0 for row in rows for cell in row[4:]), rows
