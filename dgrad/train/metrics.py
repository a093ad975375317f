"""Training metrics on disk: JSON lines, TensorBoard when available, and a PNG of the curves.

Every record is one JSON object per line with a `kind` ("train" for step intervals,
"epoch" for end-of-epoch evaluation, "probe" for a stage's staleness probe) and the
`step` it describes. Train records carry the interval's pace (`step_seconds`, and
`samples_per_second` or, for text, `tokens_per_second`; `mfu` where the config gives
`peak_tflops`), epoch records their `seconds` split into `train_seconds`, `eval_seconds`
and `checkpoint_seconds`. A resumed run first drops the records past its checkpoint
(`truncate`), so no step is written twice.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
>>> with MetricWriter(path) as writer:
...     writer.write({"kind": "epoch", "step": 10, "epoch": 1, "test_accuracy": 0.5})
...     writer.write({"kind": "epoch", "step": 20, "epoch": 2, "test_accuracy": 0.7})
>>> truncate(path, after_step=10)
>>> [r["epoch"] for r in read(path)]
[1]
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Mapping


def read(path: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """The records in `path` (of one `kind` if given); [] if the file does not exist.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    >>> with MetricWriter(path) as writer:
    ...     writer.write({"kind": "train", "step": 4, "loss": 2.0})
    ...     writer.write({"kind": "epoch", "step": 8, "epoch": 1})
    >>> read(path, kind="epoch")
    [{'kind': 'epoch', 'step': 8, 'epoch': 1}]
    """
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


CLOCK = (  # what the clock measured: entries that differ between two runs of the same numbers
    "seconds",
    "train_seconds",
    "eval_seconds",
    "checkpoint_seconds",
    "step_seconds",
    "samples_per_second",
    "tokens_per_second",
    "mfu",
)


def without_clock(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` without what the clock measured (`CLOCK`): what a rerun reproduces.

    >>> without_clock({"kind": "train", "step": 3, "loss": 1.5, "step_seconds": 0.2})
    {'kind': 'train', 'step': 3, 'loss': 1.5}
    """
    return {k: v for k, v in record.items() if k not in CLOCK}


CORPUS = "corpus_"  # the prefix of a record's corpus fingerprint entries


def with_corpus(record: dict[str, Any], fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with a text corpus' `fingerprint` as `corpus_<field>` entries.

    >>> with_corpus({"epoch": 1}, {"python": "3.11.7"})
    {'epoch': 1, 'corpus_python': '3.11.7'}
    """
    return {**record, **{f"{CORPUS}{name}": value for name, value in fingerprint.items()}}


def corpus_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """The corpus fingerprint that `with_corpus` put in `record` ({} if none).

    >>> corpus_of({"epoch": 1, "corpus_python": "3.11.7"})
    {'python': '3.11.7'}
    """
    return {k[len(CORPUS) :]: v for k, v in record.items() if k.startswith(CORPUS)}


def truncate(path: str | os.PathLike, after_step: int) -> None:
    """Drops the records of steps after `after_step` (those a resumed run will redo); the
    file is replaced whole, so a kill mid-write leaves the old one.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    >>> with MetricWriter(path) as writer:
    ...     for step in (4, 8, 12):
    ...         writer.write({"kind": "train", "step": step, "loss": 1.0})
    >>> truncate(path, after_step=8)  # a run resumed from its checkpoint at step 8
    >>> [r["step"] for r in read(path)]
    [4, 8]
    """
    records = [r for r in read(path) if r["step"] <= after_step]
    temporary = f"{os.fspath(path)}.tmp"  # a kill mid-write leaves the old file whole
    with open(temporary, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(temporary, path)


class MetricWriter:
    """Appends records to a JSON-lines file and, if `tensorboard_dir` is given and
    tensorboardX is installed, to TensorBoard (scalars named `kind/name`).

    >>> import os, tempfile
    >>> directory = tempfile.mkdtemp()
    >>> writer = MetricWriter(os.path.join(directory, "m.jsonl"), tensorboard_dir=directory)
    >>> writer.write({"kind": "train", "step": 4, "loss": 2.0})
    >>> print(open(writer.path).read(), end="")  # on disk at once
    {"kind": "train", "step": 4, "loss": 2.0}
    >>> writer.has_tensorboard
    True
    >>> writer.close()  # as leaving `with MetricWriter(...) as writer:` does
    """

    def __init__(self, path: str | os.PathLike, tensorboard_dir: str | None = None):
        self.path = path
        self._file = open(path, "a")
        self._tensorboard = None
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                pass
            else:
                self._tensorboard = SummaryWriter(tensorboard_dir)

    @property
    def has_tensorboard(self) -> bool:
        return self._tensorboard is not None

    def write(self, record: Mapping[str, Any]) -> None:
        """Appends `record` (with its `kind` and `step`) as one line, flushed at once; to
        TensorBoard its finite numbers (a stage's tagged `kind/name_stage<k>`).
        """
        self._file.write(json.dumps(dict(record)) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            suffix = f"_stage{record['stage']}" if "stage" in record else ""
            for name, value in record.items():
                if (
                    name not in ("kind", "step", "stage")
                    and isinstance(value, (int, float))
                    and math.isfinite(value)  # (NaN: not defined, e.g. drift under current weights)
                ):
                    tag = f"{record['kind']}/{name}{suffix}"
                    self._tensorboard.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        """Closes the file (and the TensorBoard writer); `with MetricWriter(...)` calls it."""
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def plot_curves(
    runs: Mapping[str, Iterable[Mapping[str, Any]]],
    path: str | os.PathLike,
    title: str = "",
    probes: Mapping[str, Iterable[Mapping[str, Any]]] | None = None,
) -> str:
    """A PNG at `path` of the train loss and test accuracy (for text: bits per byte) per
    epoch of each run (label -> epoch records) and, where `probes` has records, the
    staleness probe's gradient cosine per stage; returns the path. Drawn on a figure of
    its own: the global matplotlib backend (a notebook's) is left alone.

    >>> import os, tempfile
    >>> epochs = [{"epoch": 1, "train_loss": 2.0, "test_accuracy": 0.4},
    ...           {"epoch": 2, "train_loss": 1.0, "test_accuracy": 0.6}]
    >>> path = plot_curves({"FDG K=2": epochs}, os.path.join(tempfile.mkdtemp(), "curves.png"))
    >>> os.path.basename(path), os.path.getsize(path) > 0
    ('curves.png', True)
    """
    from matplotlib.figure import Figure

    probes = {label: list(records) for label, records in (probes or {}).items()}
    probes = {label: records for label, records in probes.items() if records}
    figure = Figure(figsize=(15 if probes else 10, 4.4))
    axes_row = figure.subplots(1, 3 if probes else 2)
    loss_axes, accuracy_axes = axes_row[:2]
    if probes:
        probe_axes = axes_row[2]
        for label, records in probes.items():
            for stage in sorted({r["stage"] for r in records}):
                points = [(r["step"], r["cosine"]) for r in records if r["stage"] == stage]
                probe_axes.plot(*zip(*points), ".-", label=f"{label}, stage {stage}")
        probe_axes.set(
            xlabel="step", ylabel="cosine(applied, fresh)", title="Gradient staleness (probe)"
        )
        probe_axes.grid(alpha=0.3)
        probe_axes.legend(fontsize=7)
    runs = {label: list(records) for label, records in runs.items()}
    text = any("test_bits_per_byte" in r for records in runs.values() for r in records)
    shown, name = (
        ("test_bits_per_byte", "test bits per byte") if text else ("test_accuracy", "test accuracy")
    )
    for label, records in runs.items():
        epochs = [r["epoch"] for r in records]
        loss_axes.plot(epochs, [r.get("train_loss", math.nan) for r in records], "o-", label=label)
        accuracy_axes.plot(epochs, [r.get(shown, math.nan) for r in records], "o-", label=label)
    loss_axes.set(xlabel="epoch", ylabel="train loss", yscale="log", title="Training loss")
    accuracy_axes.set(xlabel="epoch", ylabel=name, title=name.capitalize())
    for axes in (loss_axes, accuracy_axes):
        axes.grid(alpha=0.3)
        axes.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return save_figure(figure, path)


def save_figure(figure, path: str | os.PathLike) -> str:
    """Writes the matplotlib `figure` to `path` as a PNG, whole or not at all (even if the
    process is stopped mid-write); returns the path.

    >>> import os, tempfile
    >>> from matplotlib.figure import Figure
    >>> directory = tempfile.mkdtemp()
    >>> path = save_figure(Figure(figsize=(1, 1)), os.path.join(directory, "a.png"))
    >>> os.listdir(directory), open(path, "rb").read(4)  # no temporary file left
    (['a.png'], b'\\x89PNG')
    """
    temporary = f"{os.fspath(path)}.tmp.png"
    figure.savefig(temporary, dpi=120)
    os.replace(temporary, path)
    return os.fspath(path)
