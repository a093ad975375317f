"""Sweeps: every combination of a grid of config fields, with seeds, into paper-style tables.

`Sweep(config_spec, grid, workdir)` expands a grid such as
`method=bp,ddg,fdg num_stages=2,4,8 beta=1,0.5 seed=0,1,2` into runs, skips
combinations the config refuses (with the reason), and runs each as
`python -m experiments.train` in `workdir/runs/<name>`, one after another or
several at once. A run that finished is not run again and an interrupted one
resumes from its checkpoint (the training command's own rules). `summarise`
then writes `results.csv` (one row per run), `results.md` (median and min-max
over seeds per setting, methods as rows and K as columns, as the papers' tables)
and `results.png`. The workdir remembers its sweep (`sweep.json`): another
sweep there is refused.

>>> grid = parse_grid("method=bp,fdg num_stages=2,4 beta=1,0.5 seed=0")
>>> grid["num_stages"], grid["beta"]
([2, 4], [1.0, 0.5])
>>> runs, skipped = expand(fields.base(), grid)
>>> len(runs), skipped[0].split(":")[0]
(6, 'method=bp num_stages=2 beta=0.5 seed=0')
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, NamedTuple, Sequence

import ml_collections
import numpy as np

from dgrad.train import config as fields
from dgrad.train import metrics
from dgrad.train.config import files as config_files
from dgrad.train.supervisor import Supervisor

SWEEP_FILE = "sweep.json"


class SweepError(ValueError):
    """A grid or workdir that cannot be swept; the message says what to do.

    >>> parse_grid("method")
    Traceback (most recent call last):
        ...
    dgrad.train.sweep.SweepError: --grid item 'method': write field=value1,value2
    """


def _text(value) -> str:
    """A grid value as the grid writes it."""
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)


def parse_grid(text: str) -> dict[str, list[Any]]:
    """`field=v1,v2 other=w1` into `{field: [v1, v2], other: [w1]}`, each value typed as
    its field (SweepError naming the field otherwise, or a value given twice).

    >>> parse_grid("method=ddg,fdg beta=0.5 model.hidden=64,128/128")  # a tuple's numbers: /
    {'method': ['ddg', 'fdg'], 'beta': [0.5], 'model.hidden': [(64,), (128, 128)]}
    """
    grid: dict[str, list[Any]] = {}
    tuples = {f.name for f in fields.FIELDS if isinstance(f.default, tuple)}
    for item in text.split():
        name, equals, values = item.partition("=")
        if not equals or not values:
            raise SweepError(f"--grid item {item!r}: write field=value1,value2")
        if name in grid:
            raise SweepError(f"--grid names {name} twice; give its values once, with commas")
        try:
            grid[name] = [fields.parse_value(name, v.replace("/", ",")) for v in values.split(",")]
        except ValueError as error:
            raise SweepError(f"--grid {error}") from None
        twice = [v for i, v in enumerate(grid[name]) if v in grid[name][:i]]
        if twice:
            hint = f" (a {name} of several numbers is written 64/64)" if name in tuples else ""
            raise SweepError(f"--grid {name} gives {_text(twice[0])} twice{hint}")
    if not grid:
        raise SweepError("--grid is empty; give at least one field=value1,value2")
    return grid


@dataclasses.dataclass(frozen=True)
class Combination:
    """One combination of the grid.

    >>> run = Combination((("method", "fdg"), ("model.hidden", (64, 64))))
    >>> run.name, run.describe()  # its directory under runs/, and its words in logs
    ('method-fdg_model-hidden-64x64', 'method=fdg model.hidden=64/64')
    >>> run.overrides()  # the training command's arguments
    ['--config.method=fdg', '--config.model.hidden=64,64']
    >>> run.config(fields.base()).model.hidden  # a copy of the config given, set
    (64, 64)
    """

    settings: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        return "_".join(
            f"{k.replace('.', '-')}-{_text(v).replace('/', 'x')}" for k, v in self.settings
        )

    def describe(self) -> str:
        """The settings as `field=value` words, for logs and notes."""
        return " ".join(f"{k}={_text(v)}" for k, v in self.settings)

    def overrides(self) -> list[str]:
        """The settings as the training command's `--config.<field>=<value>` arguments."""

        def text(value):
            return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

        return [f"--config.{k}={text(v)}" for k, v in self.settings]

    def config(self, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of `base` with the settings applied (`base` itself is left alone)."""
        config = base.copy_and_resolve_references()
        for name, value in self.settings:
            fields.set_field(config, name, value)
        return config


def expand(base, grid: dict[str, list[Any]]) -> tuple[list[Combination], list[str]]:
    """The runs of every valid combination, and a note for each combination skipped
    (SweepError if a value fits none: a typo, or a field the grid must also vary).

    >>> runs, skipped = expand(fields.base(), {"method": ["bp", "fdg"], "beta": [1.0, 0.5]})
    >>> [run.describe() for run in runs]
    ['method=bp beta=1.0', 'method=fdg beta=1.0', 'method=fdg beta=0.5']
    >>> skipped
    ['method=bp beta=0.5: beta=0.5 asks for gradient shrinking, which only FDG has; ...']
    """
    names = list(grid)
    runs, refused, fitting = [], [], set()
    reasons: dict[tuple[str, int], str] = {}  # (field, index of its value) -> first refusal
    for positions in itertools.product(*(range(len(grid[n])) for n in names)):
        run = Combination(tuple((n, grid[n][i]) for n, i in zip(names, positions)))
        config = run.config(base)
        try:
            fields.check(config)
        except ValueError as error:
            why = str(error).removeprefix("config: ")
            refused.append(f"{run.describe()}: {why}")
            for key in zip(names, positions):
                reasons.setdefault(key, why)
            continue
        runs.append(run)
        fitting.update(zip(names, positions))
    for name in names:
        for i, value in enumerate(grid[name]):
            if (name, i) not in fitting:
                raise SweepError(
                    f"--grid {name}={_text(value)} fits no combination: {reasons[name, i]}"
                )
    return runs, refused


class Sweep:
    """The runs of `grid` over the config `config_spec` (`FILE[:variant]`) in `workdir`.

    Args:
      config_spec: the config file (and variant) every run starts from.
      grid: parsed by `parse_grid`.
      workdir: where `sweep.json`, `runs/` and the results go.
      overrides: `--config.<field>=<value>` applied to every run.

    >>> import tempfile
    >>> workdir = tempfile.TemporaryDirectory()
    >>> sweep = Sweep("experiments/configs/default.py:smoke",
    ...               parse_grid("method=bp,fdg beta=1,0.5"), workdir.name)
    >>> [run.describe() for run in sweep.runs], len(sweep.skipped)  # bp cannot shrink
    (['method=bp beta=1.0', 'method=fdg beta=1.0', 'method=fdg beta=0.5'], 1)
    >>> sweep.claim()  # sweep.json holds its identity(): another sweep is refused there
    >>> sweep.identity()["grid"]
    {'method': ['bp', 'fdg'], 'beta': [1.0, 0.5]}
    >>> sweep.command(sweep.runs[2])[3:]  # each run trains in its run_dir()
    ['--config=...:smoke', '--config.method=fdg', '--config.beta=0.5', '--workdir=...-0.5']
    >>> sweep.run_dir(sweep.runs[2]) == sweep.command(sweep.runs[2])[-1].split("=")[1]
    True
    >>> sweep.results()  # a row for each run that has evaluated: none yet
    []
    >>> workdir.cleanup()
    """

    def __init__(self, config_spec: str, grid, workdir, overrides: Sequence[str] = ()):
        self.config_spec, self.grid, self.overrides = config_spec, grid, list(overrides)
        self.workdir = os.path.abspath(os.fspath(workdir))
        base, self.config_name = config_files.load(config_spec)
        fields.apply_overrides(base, self.overrides)
        self.base = base
        self.runs, self.skipped = expand(base, grid)

    def identity(self) -> dict[str, Any]:
        """What makes a sweep this one (its `sweep.json`): config, overrides and grid."""
        grid = {
            k: [list(v) if isinstance(v, tuple) else v for v in vs] for k, vs in self.grid.items()
        }
        return {"config": self.config_spec, "overrides": self.overrides, "grid": grid}

    def claim(self) -> None:
        """Makes the workdir this sweep's; refuses one holding another sweep or other files."""
        path = os.path.join(self.workdir, SWEEP_FILE)
        if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
            raise SweepError(f"--workdir {self.workdir} is a file; give a directory.")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    held = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
                held = error
            if not (isinstance(held, dict) and {"config", "grid"} <= set(held)):
                raise SweepError(
                    f"{path} is damaged, so what this sweep trains is unknown; restore it "
                    "from a copy, or use a new --workdir."
                )
            if held != self.identity():
                raise SweepError(
                    f"{self.workdir} holds another sweep ({held['config']}, grid "
                    f"{held['grid']}); use a new --workdir, or the same config and grid to "
                    "resume it."
                )
            return
        if os.path.isdir(self.workdir) and os.listdir(self.workdir):
            raise SweepError(f"{self.workdir} holds files but no {SWEEP_FILE}; use a new --workdir")
        os.makedirs(self.workdir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.identity(), f, indent=2)

    def run_dir(self, run: Combination) -> str:
        """The workdir of `run`'s training command."""
        return os.path.join(self.workdir, "runs", run.name)

    def command(self, run: Combination) -> list[str]:
        """The training command of `run`, as argv."""
        return [
            sys.executable,
            "-m",
            "experiments.train",
            f"--config={self.config_spec}",
            *self.overrides,
            *run.overrides(),
            f"--workdir={self.run_dir(run)}",
        ]

    def execute(self, parallel: int = 1, log=print, cwd: str | None = None) -> int:
        """Runs every run not finished yet, `parallel` at a time; returns the number that
        failed. SIGINT/SIGTERM stop the runs (each saves its checkpoint) and the sweep.

        Here each run's command is replaced by a short Python one that fails for DDG:

        >>> import sys, tempfile
        >>> with tempfile.TemporaryDirectory() as workdir:
        ...     sweep = Sweep("experiments/configs/default.py:smoke",
        ...                   parse_grid("method=ddg,fdg"), workdir)
        ...     sweep.command = lambda run: [sys.executable, "-c",
        ...                                  f"exit('ddg' in {run.name!r})"]
        ...     lines = []
        ...     print(sweep.execute(parallel=2, log=lines.append))
        1
        >>> sorted(line.split(" (")[0] for line in lines)
        ['failed   method=ddg', 'finished method=fdg', 'started  method=ddg', 'started  method=fdg']
        """
        pending, running, failed = list(self.runs), {}, 0
        os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
        with Supervisor() as children:
            while pending or running:
                children.poll()  # (forwards a stop to the runs)
                if children.stopped:
                    pending.clear()
                while pending and len(running) < parallel:
                    run = pending.pop(0)
                    with open(os.path.join(self.workdir, "logs", f"{run.name}.log"), "a") as out:
                        child = children.start(
                            self.command(run), stdout=out, stderr=subprocess.STDOUT, cwd=cwd
                        )
                    running[child] = run
                    log(f"started  {run.describe()}")
                for child in [child for child in running if child.poll() is not None]:
                    run = running.pop(child)
                    if child.returncode == 0:
                        log(f"finished {run.describe()}")
                    else:
                        failed += 1
                        log(
                            f"failed   {run.describe()} (status {child.returncode}; see "
                            f"{self.workdir}/logs/{run.name}.log)"
                        )
                time.sleep(0.2)
        if children.stopped:
            raise KeyboardInterrupt(children.stopped[0])
        return failed

    def results(self) -> list[dict[str, Any]]:
        """One row per run that has evaluated at least once."""
        rows = []
        for run in self.runs:
            run_dir = self.run_dir(run)
            labels = (
                [d for d in sorted(os.listdir(run_dir)) if d != fields.BASELINE_LABEL]
                if os.path.isdir(run_dir)
                else []
            )
            epochs = []
            for label in labels:
                epochs = metrics.read(os.path.join(run_dir, label, "metrics.jsonl"), "epoch")
                if epochs:
                    break
            if not epochs:
                continue
            seconds = sum(r["seconds"] for r in epochs)
            config = run.config(self.base)
            steps = epochs[-1]["step"]
            rows.append(
                {
                    **dict(run.settings),
                    "epochs": epochs[-1]["epoch"],
                    "finished": epochs[-1]["epoch"] >= config.num_epochs,
                    "final_test_accuracy": epochs[-1]["test_accuracy"],
                    "best_test_accuracy": max(r["test_accuracy"] for r in epochs),
                    "final_train_loss": epochs[-1].get("train_loss", math.nan),
                    "final_test_loss": epochs[-1].get("test_loss", math.nan),
                    **(
                        {"final_test_bits_per_byte": epochs[-1]["test_bits_per_byte"]}
                        if "test_bits_per_byte" in epochs[-1]
                        else {}
                    ),
                    "samples_per_second": steps * config.batch_size / seconds,
                    "wall_seconds": seconds,
                }
            )
        return rows

    def summarise(self) -> dict[str, str]:
        """Writes results.csv, results.md and results.png from `results()`; returns their paths.

        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as workdir:
        ...     spec = "experiments/configs/default.py:smoke"
        ...     sweep = Sweep(spec, parse_grid("seed=0,1"), workdir)
        ...     for run, accuracy in zip(sweep.runs, (0.5, 0.7)):  # as if both had trained
        ...         run_dir = os.path.join(sweep.run_dir(run), "fdg_k2")
        ...         os.makedirs(run_dir)
        ...         with metrics.MetricWriter(os.path.join(run_dir, "metrics.jsonl")) as writer:
        ...             writer.write({"kind": "epoch", "step": 24, "epoch": 3,
        ...                           "test_accuracy": accuracy, "seconds": 2.0})
        ...     print(len(sweep.results()), open(sweep.summarise()["md"]).read().splitlines()[2])
        2 | all | 60.00 [50.00-70.00] (n=2) |
        """
        rows = self.results()
        if not rows:
            raise SweepError(f"no run in {self.workdir} has evaluated yet")
        paths = {
            kind: os.path.join(self.workdir, f"results.{kind}") for kind in ("csv", "md", "png")
        }
        with open(paths["csv"], "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: _text(v) for k, v in row.items()} for row in rows)
        table, groups = _table(rows, list(self.grid))
        with open(paths["md"], "w") as f:
            f.write(table)
        _plot_against_stages(
            groups,
            list(self.grid),
            paths["png"],
            f"{self.config_name}: {self.base.dataset}",
            quantity_of(rows),
        )
        return paths


class Quantity(NamedTuple):
    """What a sweep's table and plot show: a row field, its title, its scale and digits
    (`quantity_of` picks one)."""

    field: str
    title: str
    scale: float
    digits: int


ACCURACY = Quantity("final_test_accuracy", "test accuracy %", 100.0, 2)
BITS_PER_BYTE = Quantity("final_test_bits_per_byte", "test bits per byte", 1.0, 3)


def quantity_of(rows) -> Quantity:
    """Bits per byte when every run is a language model's (lower is better), else accuracy.

    >>> quantity_of([{"final_test_accuracy": 0.9}]).title
    'test accuracy %'
    """
    return BITS_PER_BYTE if rows and all(BITS_PER_BYTE.field in r for r in rows) else ACCURACY


def _table(rows, names) -> tuple[str, dict]:
    """Median [min-max] over seeds of the final test accuracy (%), or of the test bits per
    byte for language models: a row per setting of the other fields, a column per K."""
    quantity = quantity_of(rows)
    column = "num_stages" if "num_stages" in names else None
    row_fields = [n for n in names if n not in ("seed", column)]
    groups: dict[tuple, dict[Any, list[float]]] = {}
    unfinished = [row for row in rows if not row["finished"]]
    for row in rows:
        if not row["finished"]:
            continue
        key = tuple(row[n] for n in row_fields)
        groups.setdefault(key, {}).setdefault(row.get(column), []).append(
            quantity.scale * row[quantity.field]
        )
    columns = sorted({c for cells in groups.values() for c in cells}, key=lambda c: (c is None, c))
    heading = " | ".join(row_fields) or "setting"
    columns = columns or [None]  # no run finished yet: the table's frame, empty
    lines = [
        f"| {heading} | "
        + " | ".join(quantity.title if c is None else f"K={c}" for c in columns)
        + " |",
        "|" + "---|" * (max(len(row_fields), 1) + len(columns)),
    ]
    for key, cells in sorted(groups.items(), key=lambda item: str(item[0])):
        label = " | ".join(_text(v) for v in key) or "all"
        entries = []
        for c in columns:
            values = cells.get(c)
            if not values:
                entries.append("")
                continue
            entries.append(
                f"{np.median(values):.{quantity.digits}f} [{min(values):.{quantity.digits}f}-"
                f"{max(values):.{quantity.digits}f}] (n={len(values)})"
            )
        lines.append(f"| {label} | " + " | ".join(entries) + " |")
    note = (
        f"\nFinal {quantity.title}: median [min-max] over seeds (n runs) per setting."
        + ("" if column is None else " Columns: K stages.")
        + "\n"
    )
    if unfinished:
        runs = "; ".join(
            " ".join(f"{n}={_text(row[n])}" for n in names) + f" (epoch {row['epochs']})"
            for row in unfinished
        )
        note += f"Not in the table, unfinished (their last evaluation is in the CSV): {runs}.\n"
    return "\n".join(lines) + "\n" + note, groups


def _plot_against_stages(groups, names, path, title, quantity: Quantity) -> None:
    from matplotlib.figure import Figure

    row_fields = [n for n in names if n not in ("seed", "num_stages")]
    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    for key, cells in sorted(groups.items(), key=lambda item: str(item[0])):
        xs = sorted(c for c in cells if c is not None) or [None]
        medians = [np.median(cells[x]) for x in xs]
        low = [np.median(cells[x]) - min(cells[x]) for x in xs]
        high = [max(cells[x]) - np.median(cells[x]) for x in xs]
        positions = [x if x is not None else 1 for x in xs]
        label = ", ".join(f"{n}={v}" for n, v in zip(row_fields, key)) or "all"
        axes.errorbar(positions, medians, yerr=[low, high], marker="o", capsize=3, label=label)
    axes.set(xlabel="K (stages)", ylabel=f"final {quantity.title} (median, min-max)", title=title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    metrics.save_figure(figure, path)
