"""The training command's steady rate beside the engine's, in paired rounds.

A user sees `python -m experiments.train`, not the benchmark. Here the same pipeline
(model, cuts, batch, method, microbatches) is timed both ways under one machine load:
every round times the bare engine (`dgrad.measure.benchmark_across.Group`: one fixed batch,
nothing but `Pipeline.step`) and fused BP pinned to one core, then runs the training
command for a few epochs in a fresh work directory, then times both again. The command's
rate is each epoch after the first (its `train_seconds`; evaluation and checkpoint
seconds are reported apart), and its ratios in a round are over the mean of the two
engine windows around it and over the mean of the two fused BP windows.

A layout is one process on K fake devices, or K processes pinned to a core each
(stage k on process k, under `jax.distributed`), for both sides alike.

>>> [method.name for method in (Method("fdg"), Method("1f1b", microbatches=4))]
['fdg', '1f1b M=4']
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

import numpy as np

from dgrad.measure.benchmark_across import Group
from dgrad.train.supervisor import Supervisor, launch_local

TRAIN = [sys.executable, "-m", "experiments.train"]


@dataclasses.dataclass(frozen=True)
class Method:
    """A method (and its microbatches) timed on both sides.

    >>> method = Method("1f1b", microbatches=4)
    >>> method.name, method.options
    ('1f1b M=4', {'microbatches': 4})
    >>> Method("fdg").options
    {}
    """

    method: str
    microbatches: int = 1

    @property
    def name(self) -> str:
        return self.method + (f" M={self.microbatches}" if self.microbatches > 1 else "")

    @property
    def options(self) -> dict:
        """The `Pipeline` options beside the method."""
        return {"microbatches": self.microbatches} if self.microbatches > 1 else {}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the K stages run: `processes` processes of `devices` fake devices each,
    pinned to cores `pins` (None: not pinned).

    >>> Layout("2 processes pinned", processes=2, devices=1, pins=(0, 1)).pins
    (0, 1)
    """

    name: str
    processes: int
    devices: int
    pins: tuple[int, ...] | None

    @staticmethod
    def of(num_stages: int) -> list[Layout]:
        """One process on K devices and K processes pinned to a core each.

        >>> [layout.name for layout in Layout.of(2)]
        ['one process', '2 processes pinned']
        """
        cores = os.cpu_count() or 1
        pins = tuple(k % cores for k in range(num_stages))
        return [
            Layout("one process", 1, num_stages, None),
            Layout(f"{num_stages} processes pinned", num_stages, 1, pins),
        ]


def refusal(model: str, image_size: int, num_stages: int, epochs: int) -> str | None:
    """Why the command's side cannot be timed so (one line), or None if it can.

    >>> refusal("resnet20", 32, 2, 3) is None
    True
    >>> refusal("resnet20", 32, 2, 1)
    '--command-epochs must be at least 2 (the first is not timed)'
    """
    if not model.startswith("resnet") or image_size != 32:
        return "--against-command times CIFAR ResNets (resnet8, resnet20, ...) on 32px images"
    if num_stages < 2:
        return "--against-command needs one K of 2 or more, e.g. --stages 2"
    if epochs < 2:
        return "--command-epochs must be at least 2 (the first is not timed)"
    return None


def command_flags(spec: dict, method: Method, *, epochs: int, steps: int, eval_examples: int):
    """The training command's flags for the benchmark's ResNet `spec` and `method`: synthetic
    32px images, cut by `spec["split"]` (default balanced) as the engine's side is, no
    baseline beside the method.

    >>> spec = {"model": "resnet20", "width": 16, "batch_size": 64, "stages": 2}
    >>> flags = command_flags(spec, Method("1f1b", 4), epochs=3, steps=40, eval_examples=256)
    >>> [f for f in flags if "depth" in f or "microbatches" in f]
    ['--config.model.depth=20', '--config.microbatches=4']
    """
    model = spec["model"]
    return [
        "--config",
        "experiments/configs/default.py",
        "--config.dataset=synthetic",
        f"--config.synthetic_examples={max(4096, spec['batch_size'] * steps)}",
        "--config.model.name=cifar_resnet",
        f"--config.model.depth={int(model[len('resnet') :])}",
        f"--config.model.width={spec.get('width', 16)}",
        f"--config.split={spec.get('split', 'balanced')}",
        f"--config.method={method.method}",
        f"--config.num_stages={spec['stages']}",
        "--config.baseline=",
        f"--config.batch_size={spec['batch_size']}",
        f"--config.num_epochs={epochs}",
        f"--config.steps_per_epoch={steps}",
        f"--config.eval_examples={eval_examples}",
        f"--config.eval_batch_size={min(eval_examples, 256)}",
    ] + ([f"--config.microbatches={method.microbatches}"] if method.microbatches > 1 else [])


def run_command(
    flags: Sequence[str], layout: Layout, workdir: str, *, timeout_s: float = 900.0
) -> list[dict]:
    """Runs the training command with `flags` in `layout` and returns its epoch records
    (process 0's `metrics.jsonl`). A failure or a run past `timeout_s` raises with the
    processes' output; every process started is stopped by its id.

    >>> import tempfile
    >>> flags = ["--config", "experiments/configs/default.py:smoke", "--config.model.name=mlp",
    ...          "--config.baseline=", "--config.num_epochs=2", "--config.steps_per_epoch=2"]
    >>> with tempfile.TemporaryDirectory() as workdir:
    ...     epochs = run_command(flags, Layout("one process", 1, 2, None), workdir)
    >>> [(record["epoch"], record["train_seconds"] > 0) for record in epochs]
    [(1, True), (2, True)]
    """
    argv, log = [*TRAIN, *flags, f"--workdir={workdir}"], io.StringIO()
    if layout.processes == 1:
        with Supervisor(log) as children:
            child = children.start(
                [*argv, f"--cpu_devices={layout.devices}"], prefix="", stdin=subprocess.DEVNULL
            )
            status = child.returncode if children.wait(timeout_s) else 124
    else:
        status = launch_local(
            argv,
            layout.processes,
            cpu_devices=layout.devices,
            timeout=timeout_s,
            pins=layout.pins,
            out=log,
        )
    output = log.getvalue()
    if status != 0:
        raise RuntimeError(
            f"the training command ({layout.name}) failed (status {status}; 124: it ran past "
            f"{timeout_s:.0f} s):\n" + output[-8000:]
        )
    paths = [
        os.path.join(root, "metrics.jsonl")
        for root, _, files in os.walk(workdir)
        if "metrics.jsonl" in files
    ]
    with open(paths[0]) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "epoch"]


@dataclasses.dataclass
class Measured:
    """Samples/s of the engine's windows and the command's steady epochs, and the
    command's ratio to the engine and to fused BP pinned per round."""

    engine: list[float] = dataclasses.field(default_factory=list)
    command: list[float] = dataclasses.field(default_factory=list)
    ratios: list[float] = dataclasses.field(default_factory=list)
    over_fused: list[float] = dataclasses.field(default_factory=list)
    eval_seconds: list[float] = dataclasses.field(default_factory=list)
    checkpoint_seconds: list[float] = dataclasses.field(default_factory=list)


def compare_with_command(
    spec: dict,
    methods: Sequence[Method],
    *,
    rounds: int,
    epochs: int,
    steps: int,
    eval_examples: int = 256,
    out=None,
) -> dict[tuple[str, str], Measured]:
    """Times every method in every layout of `spec["stages"]` stages, round by round: an
    engine window and one of fused BP pinned to a core, of `steps` steps each, the
    training command for `epochs` epochs of `steps` steps, the two windows again. Returns
    what was measured by (method, layout) name. It starts many processes, so its example
    is a test (tests/test_benchmark.py)."""
    out = out or sys.stdout
    refused = refusal(spec["model"], spec.get("image_size", 32), spec["stages"], epochs)
    if refused:
        raise ValueError(refused)
    layouts = Layout.of(spec["stages"])
    groups: dict[tuple[str, str], Group] = {}
    measured = {}
    try:
        fused = {**spec, "method": "bp", "fused": True, "stages": 1, "cuts": [], "options": {}}
        out.write("# starting bp fused, pinned\n")
        groups[("bp", "pinned")] = baseline = Group(
            "bp fused, pinned", fused, processes=1, devices=1, pins=[0]
        )
        for method in methods:
            for layout in layouts:
                key = (method.name, layout.name)
                out.write(f"# starting the engine's {method.name}, {layout.name}\n")
                out.flush()
                groups[key] = Group(
                    f"{method.name}, {layout.name}",
                    {**spec, "method": method.method, "fused": False, "options": method.options},
                    processes=layout.processes,
                    devices=layout.devices,
                    pins=layout.pins,
                )
                measured[key] = Measured()
        flags = {
            method.name: command_flags(
                spec, method, epochs=epochs, steps=steps, eval_examples=eval_examples
            )
            for method in methods
        }
        batch = spec["batch_size"]
        for round_ in range(rounds):
            for method in methods:
                for layout in layouts:
                    key = (method.name, layout.name)
                    found = measured[key]
                    before = batch * steps / groups[key].window(steps)
                    fused_rates = [batch * steps / baseline.window(steps)]
                    with tempfile.TemporaryDirectory(prefix="dgrad-command-") as workdir:
                        epochs_run = run_command(flags[method.name], layout, workdir)
                    fused_rates.append(batch * steps / baseline.window(steps))
                    after = batch * steps / groups[key].window(steps)
                    steady = [r for r in epochs_run if r["epoch"] >= 2]
                    rates = [batch * steps / r["train_seconds"] for r in steady]
                    found.engine += [before, after]
                    found.command += rates
                    found.ratios.append(float(np.median(rates)) / ((before + after) / 2))
                    found.over_fused.append(float(np.median(rates)) / np.mean(fused_rates))
                    found.eval_seconds += [r["eval_seconds"] for r in steady]
                    found.checkpoint_seconds += [r["checkpoint_seconds"] for r in steady]
                    out.write(
                        f"# round {round_ + 1}: {method.name}, {layout.name}: engine "
                        f"{before:.1f} / {after:.1f}, command "
                        + " ".join(f"{r:.1f}" for r in rates)
                        + " samples/s; fused BP pinned "
                        + " / ".join(f"{r:.1f}" for r in fused_rates)
                        + "\n"
                    )
                    out.flush()
        return measured
    finally:
        for group in groups.values():
            group.close()
