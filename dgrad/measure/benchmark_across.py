"""Speed of a pipeline whose stages live on separate processes, side by side with the same
pipeline in one process and with fused BP.

Each case runs in processes of its own that wait for orders on stdin: `Group`
starts them (under `jax.distributed` when there are several) and `Group.window`
has them all train `steps` steps and report how long they took. The rounds go
case by case, so every case is timed under the same machine load, as
`dgrad.measure.benchmark.measure` does inside one process. A process may be pinned to
one core (`os.sched_setaffinity`): on a CPU-only machine, one core per stage
stands for the papers' one accelerator per module.

The worker side is `serve`: it builds the case's pipeline from a JSON spec,
fills it, then answers `window STEPS` with `time SECONDS`, and `moves STEPS`
(cases across processes) with the time of moving one step's activation and
cotangent between the stages and nothing else.

>>> spec_flags({"model": "mlp", "cuts": [2], "fused": False}, pin=0)
['--spec={"model": "mlp", "cuts": [2], "fused": false}', '--pin=0']
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Sequence

import numpy as np

from dgrad.train.distributed import free_port
from dgrad.train.supervisor import Supervisor

WORKER = [sys.executable, "-m", "experiments.benchmark", "--serve"]


GPT_SHAPE = {"vocab_size": 256, "layers": 4, "heads": 4, "dim": 128, "context": 64}
GPT_FLAGS = tuple(name for name in GPT_SHAPE if name != "vocab_size")  # byte-level: 256


def chain_of(spec: dict):
    """The blocks of the benchmark's model `spec["model"]` (mlp, resnetN, wrnD-W, gpt), for
    images of `spec["image_size"]` pixels a side, ResNets of `spec["width"]` channels and a
    byte-level GPT of `GPT_SHAPE` (or the spec's own `layers`, `heads`, `dim`, `context`).

    >>> len(chain_of({"model": "resnet20", "width": 4, "image_size": 8}).modules)
    11
    >>> len(chain_of({"model": "gpt", "layers": 2, "dim": 16, "heads": 2}).modules)
    4
    """
    from dgrad import models

    name, size = spec["model"], spec.get("image_size", 32)
    if name == "gpt":
        shape = {**GPT_SHAPE, **{k: spec[k] for k in GPT_SHAPE if k in spec}}
        return models.gpt_blocks(
            shape["vocab_size"], shape["layers"], shape["heads"], shape["dim"], shape["context"]
        )
    if name == "mlp":
        return models.mlp_blocks([size * size * 3, 512, 512, 512, 512, 10])
    if name.startswith("resnet"):
        return models.cifar_resnet_blocks(
            int(name[len("resnet") :]), 10, width=spec.get("width", 16)
        )
    depth, widen = (int(n) for n in name[len("wrn") :].split("-"))
    return models.wide_resnet_blocks(depth, widen, 10)


def example_batch(spec: dict):
    """The benchmark's synthetic batch of `spec["batch_size"]` examples: random images and
    labels of 10 classes, or for the GPT random byte windows labelled with their next bytes.

    >>> images, labels = example_batch({"model": "mlp", "image_size": 4, "batch_size": 2})
    >>> images.shape, labels.shape
    ((2, 4, 4, 3), (2,))
    >>> tokens, next_tokens = example_batch({"model": "gpt", "context": 8, "batch_size": 2})
    >>> tokens.shape, bool((tokens[:, 1:] == next_tokens[:, :-1]).all())
    ((2, 8), True)
    """
    rng = np.random.default_rng(0)
    size = spec["batch_size"]
    if spec["model"] == "gpt":
        shape = {**GPT_SHAPE, **spec}
        windows = rng.integers(0, shape["vocab_size"], (size, shape["context"] + 1))
        return windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32)
    side = spec.get("image_size", 32)
    images = rng.normal(size=(size, side, side, 3)).astype(np.float32)
    return images, rng.integers(0, 10, size).astype(np.int32)


def spec_flags(spec: dict, pin: int | None) -> list[str]:
    """The worker's flags for a case `spec` (and the core to pin it to).

    >>> spec_flags({"model": "mlp"}, None)
    ['--spec={"model": "mlp"}']
    """
    return [f"--spec={json.dumps(spec)}"] + ([] if pin is None else [f"--pin={pin}"])


class Group:
    """The processes of one case, started and filled; `window` times them.

    Args:
      name: the case's name in the table.
      spec: what `serve` builds (model, cuts, batch size, method, fused, and in
        `options` any other `Pipeline` option, such as microbatches).
      processes: how many processes (stage k on process k when several).
      devices: fake CPU devices per process.
      pins: the core of each process (None: not pinned).

    >>> import sys
    >>> spec = {"model": "mlp", "width": 8, "image_size": 4, "cuts": [], "batch_size": 8,
    ...         "method": "bp", "fused": True, "stages": 1}
    >>> group = Group("bp", spec, processes=1, devices=1)
    >>> seconds = group.window(2)
    >>> group.close(); seconds > 0
    True
    """

    def __init__(
        self,
        name: str,
        spec: dict,
        *,
        processes: int,
        devices: int,
        pins: Sequence[int | None] | None = None,
        timeout_s: float = 600.0,
    ):
        self.name, self.spec, self.processes, self.devices = name, spec, processes, devices
        self.pins = list(pins) if pins is not None else [None] * processes
        self.timeout_s = timeout_s
        coordinator = f"127.0.0.1:{free_port()}"
        self._supervisor = Supervisor(grace=5.0)  # (not entered: Ctrl-C stops the benchmark)
        self.children = self._supervisor.children
        for index in range(processes):
            argv = [*WORKER, *spec_flags(spec, self.pins[index]), f"--cpu_devices={devices}"]
            if processes > 1:
                argv += [
                    f"--coordinator={coordinator}",
                    f"--num_processes={processes}",
                    f"--process_id={index}",
                ]
            self._supervisor.start(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        self._answers("ready")

    def _answers(self, word: str) -> list[float]:
        values = []
        for child in self.children:
            while True:
                line = child.stdout.readline()
                if not line:
                    self.close()
                    raise RuntimeError(f"{self.name}: a worker exited ({child.wait()})")
                if line.startswith(word):
                    values.append(float(line.split()[1]) if " " in line.strip() else 0.0)
                    break
        return values

    def _order(self, line: str) -> None:
        for child in self.children:
            child.stdin.write(line + "\n")
            child.stdin.flush()

    def window(self, steps: int) -> float:
        """Seconds for `steps` training steps, the slowest process's."""
        self._order(f"window {steps}")
        return max(self._answers("time"))

    def moves(self, steps: int) -> float:
        """Seconds for `steps` steps' cross-process moves alone: each unit's activation and
        cotangent across each boundary between stages."""
        self._order(f"moves {steps}")
        return max(self._answers("time"))

    def close(self) -> None:
        """Stops the processes (they exit when their stdin closes)."""
        for child in self.children:
            try:
                child.stdin.close()
            except OSError:
                pass
        self._supervisor.wait(timeout=30)
        self._supervisor.stop()


def serve(spec: dict, *, stdin=None, stdout=None) -> None:
    """A worker: builds `spec`'s pipeline on this process's devices (all processes'
    under `jax.distributed`), fills it, says `ready`, then answers orders from `stdin`.

    >>> import io
    >>> spec = {"model": "mlp", "width": 8, "image_size": 4, "cuts": [2], "batch_size": 8,
    ...         "method": "fdg", "fused": False, "stages": 2}
    >>> out = io.StringIO()
    >>> serve(spec, stdin=io.StringIO("window 2\\nmoves 2\\n"), stdout=out)
    >>> [line.split()[0] for line in out.getvalue().splitlines()]
    ['ready', 'time', 'time']
    """
    import jax
    import optax

    import dgrad

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    stages = chain_of(spec).stages(spec["stages"], spec["cuts"])
    optimizer = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.01, momentum=0.9))
    pipe = dgrad.Pipeline(
        stages,
        optimizer=optimizer,
        method=spec["method"],
        fused=spec["fused"],
        **spec.get("options", {}),
    )
    batch = pipe.placement.put_batch(example_batch(spec), 0)  # as the training stream hands it
    state = pipe.init(batch)
    for _ in range(2 * pipe.num_stages + 2):
        state, _ = pipe.step(state, batch)
    jax.block_until_ready(state)
    # One step's moves, each from a value of its shape placed where it starts: per unit of
    # the step (a batch or microbatch), stage k's output k -> k+1 and its cotangent back.
    # (A flushed timetable holds nothing in flight between steps to take them from.)
    units = len(pipe.schedule.units(state.step))
    in_flight = []
    for k, stage in enumerate(pipe.specs[:-1]):
        zeros = np.zeros(stage.outputs.shape, stage.outputs.dtype)
        in_flight += [(pipe.placement.put_batch(zeros, k), k, k + 1)] * units
        if not pipe.schedule.trains_locally(k):  # (DGL sends no cotangent back)
            in_flight += [(pipe.placement.put_batch(zeros, k + 1), k + 1, k)] * units
    stdout.write("ready\n")
    stdout.flush()
    for line in stdin:
        order, _, count = line.strip().partition(" ")
        steps = int(count)
        start = time.perf_counter()
        if order == "window":
            for _ in range(steps):
                state, _ = pipe.step(state, batch)
            jax.block_until_ready(state)
        elif order == "moves":
            for _ in range(steps):
                jax.block_until_ready(
                    [pipe.placement.move(value, src, dst) for value, src, dst in in_flight]
                )
        stdout.write(f"time {time.perf_counter() - start}\n")
        stdout.flush()


def pin_and_join(pin: int | None, join) -> None:
    """Pins this process to core `pin` (before JAX starts its threads), then `join()`s.

    >>> pin_and_join(None, lambda: None)  # nothing to pin, nothing to join
    """
    if pin is not None:
        os.sched_setaffinity(0, {pin})
    join()


def label(spec: dict) -> str:
    """A method's name in the tables, with its microbatches.

    >>> label({"method": "gpipe", "options": {"microbatches": 4}}), label({"method": "fdg"})
    ('gpipe M=4', 'fdg')
    """
    microbatches = spec.get("options", {}).get("microbatches", 1)
    return spec["method"] + (f" M={microbatches}" if microbatches > 1 else "")


def compare_across_processes(
    specs: Sequence[dict], num_stages: int, *, windows: int, steps: int, out=None
) -> dict[str, list[float]]:
    """Fused BP pinned to one core, and each pipeline of `specs` in one process on
    `num_stages` fake devices (every core) and as `num_stages` processes pinned to a core
    each, timed round by round; returns the samples/s of every window by case, and for
    each pipeline `<its label> moves ms/step` (the cross-process moves of one step, alone).
    It starts many processes, so its example is a test (tests/test_benchmark.py).
    """
    out = out or sys.stdout
    k = num_stages
    cores = list(range(os.cpu_count() or 1))
    fused = {**specs[0], "method": "bp", "fused": True, "stages": 1, "cuts": [], "options": {}}
    cases = [("bp fused, pinned", fused, 1, 1, [0])]
    for spec in specs:
        pins = [c % len(cores) for c in range(k)]
        cases += [
            (f"{label(spec)} K={k}, one process", spec, 1, k, None),
            (f"{label(spec)} K={k}, {k} processes pinned", spec, k, 1, pins),
        ]
    groups = []
    try:
        for name, case, processes, devices, pins in cases:
            out.write(f"# starting {name}\n")
            out.flush()
            groups.append(Group(name, case, processes=processes, devices=devices, pins=pins))
        rates = {group.name: [] for group in groups}
        for _ in range(windows):
            for group in groups:
                rates[group.name].append(specs[0]["batch_size"] * steps / group.window(steps))
        for spec, across in zip(specs, groups[2::2]):
            moves = [1e3 * across.moves(steps) / steps for _ in range(windows)]
            rates[f"{label(spec)} moves ms/step"] = moves
        return rates
    finally:
        for group in groups:
            group.close()
