"""Experiments from an `ml_collections` config: build, train, evaluate, checkpoint, resume.

`train(config, workdir)` is what `python -m experiments.train` runs, and what a
notebook calls. For each run of the config (the chosen method, and optionally a
fused-backprop baseline) it writes into `workdir/<run>/`:

- `metrics.jsonl` (and TensorBoard events under `tensorboard/` when tensorboardX
  is installed): train loss and accuracy every `log_every_steps`, test loss and
  accuracy every epoch;
- `checkpoints/<step>/`: the whole pipeline state, in flight included, at every
  epoch end (and every `checkpoint_every_steps`), see `dgrad.checkpoint`;
- `model/`: the stages merged into one model at the end, see `dgrad.export`;

plus `workdir/config.json` and the curves of all runs in `workdir/curves.png`.
Calling `train` again on the same workdir resumes every unfinished run from its
newest checkpoint, bit for bit.

The config fields are documented in `experiments/configs/common.py`.

>>> import io, tempfile
>>> from experiments.configs import default
>>> config = default.get_config()  # digits, FDG on 2 stages (here shrunk to an MLP, 5 steps)
>>> config.model.name, config.num_epochs, config.steps_per_epoch, config.baseline = "mlp", 1, 5, ""
>>> quiet = dict(log=lambda line: None, progress_stream=io.StringIO())
>>> results = train(config, tempfile.mkdtemp(), **quiet)
>>> record = results["FDG K=2"]
>>> record["epoch"], record["step"], 0 <= record["test_accuracy"] <= 1
(1, 5, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dgrad import data, export, metrics, models
from dgrad.checkpoint import Checkpointer
from dgrad.pipeline import Pipeline
from dgrad.progress import Progress
from dgrad.schedule import METHODS

# Fields that may differ between a checkpoint and the config that resumes it:
# they change where and how the run is watched or stored, never its numbers.
RESUMABLE_FIELDS = (
    "checkpoint_every_steps",
    "data_dir",
    "data_workers",
    "eval_batch_size",
    "keep_checkpoints",
    "log_every_steps",
    "placement",
    "prefetch",
)
MODELS = ("cifar_resnet", "wide_resnet", "mlp")
SCHEDULES = ("piecewise", "cosine", "constant")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of an experiment."""

    label: str  # directory name under the workdir
    title: str  # for people
    method: str
    num_stages: int
    fused: bool


def runs_of(config: ml_collections.ConfigDict) -> list[Run]:
    """The config's method, then its baseline (fused BP on one device) if it asks for one."""
    k = config.num_stages
    runs = [Run(f"{config.method}_k{k}", f"{config.method.upper()} K={k}", config.method, k, False)]
    if config.baseline == "bp":
        runs.append(Run("bp_fused", "BP (fused, 1 device)", "bp", 1, True))
    return runs


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the field and what to do for any value that cannot work."""

    def fail(field, value, expected):
        raise ValueError(f"config.{field} = {value!r} is not valid: {expected}.")

    if config.dataset not in data.DATASETS:
        fail("dataset", config.dataset, f"choose one of {data.DATASETS}")
    if config.model.name not in MODELS:
        fail("model.name", config.model.name, f"choose one of {MODELS}")
    if config.method not in METHODS:
        fail("method", config.method, f"choose one of {METHODS}")
    if config.baseline not in ("", "bp"):
        fail("baseline", config.baseline, "use 'bp' (fused backprop beside the run) or ''")
    positive = ("num_stages", "batch_size", "num_epochs", "eval_batch_size", "log_every_steps")
    for field in (*positive, "keep_checkpoints", "prefetch", "data_workers"):
        if not isinstance(config[field], int) or config[field] < 1:
            fail(field, config[field], "use a positive integer")
    if not isinstance(config.checkpoint_every_steps, int) or config.checkpoint_every_steps < 0:
        fail("checkpoint_every_steps", config.checkpoint_every_steps, "use 0 (epoch ends) or more")
    if not 0 < config.beta <= 1:
        fail("beta", config.beta, "gradient shrinking needs 0 < beta <= 1")
    if config.method != "fdg" and config.beta != 1:
        fail("beta", config.beta, f"shrinking is part of FDG; set beta=1 for {config.method}")
    if config.optimizer.schedule not in SCHEDULES:
        fail("optimizer.schedule", config.optimizer.schedule, f"choose one of {SCHEDULES}")
    if config.optimizer.learning_rate <= 0:
        fail("optimizer.learning_rate", config.optimizer.learning_rate, "use a positive rate")


# --------------------------------------------------------------------------- build


def build_stages(config, num_stages: int, dataset: data.Dataset) -> list:
    """The model of `config.model`, cut into `num_stages` stages by `config.split`."""
    spec, classes, channels = config.model, dataset.num_classes, dataset.input_shape[-1]
    if spec.name == "cifar_resnet":
        return models.cifar_resnet(
            spec.depth,
            classes,
            num_stages,
            width=spec.width,
            in_channels=channels,
            split=config.split,
            rngs=config.seed,
        )
    if spec.name == "wide_resnet":
        return models.wide_resnet(
            spec.depth,
            spec.widen,
            classes,
            num_stages,
            in_channels=channels,
            split=config.split,
            rngs=config.seed,
        )
    features = [math.prod(dataset.input_shape), *spec.hidden, classes]
    return models.mlp(features, num_stages, split=config.split, rngs=config.seed)


def authors_boundaries(method: str) -> tuple[int, ...]:
    """Epochs where the papers divide the learning rate by 10 (FDG adds a third decay)."""
    return (150, 225, 275) if method == "fdg" else (150, 225)


def resolved_optimizer(config, method: str) -> dict[str, Any]:
    """`config.optimizer` with its unset fields filled by the authors' choice for `method`:
    decay epochs (`authors_boundaries`) and Nesterov momentum (DDG's code used it)."""
    spec = config.optimizer.to_dict()
    if spec["boundaries"] is None:
        spec["boundaries"] = authors_boundaries(method)
    if spec["nesterov"] is None:
        spec["nesterov"] = method == "ddg"
    return spec


def build_optimizer(config, method: str, steps_per_epoch: int) -> optax.GradientTransformation:
    """SGD with momentum and coupled weight decay on the config's schedule.

    Schedules count each stage's own updates (so a stage that starts updating
    later in an FDG pipeline reaches each boundary a few steps later).
    """
    spec = resolved_optimizer(config, method)
    lr, total = spec["learning_rate"], config.num_epochs * steps_per_epoch
    if spec["schedule"] == "piecewise":
        schedule = optax.piecewise_constant_schedule(
            lr, {int(e * steps_per_epoch): spec["decay"] for e in spec["boundaries"]}
        )
    elif spec["schedule"] == "cosine":
        schedule = optax.cosine_decay_schedule(lr, total)
    else:
        schedule = optax.constant_schedule(lr)
    return optax.chain(
        optax.add_decayed_weights(spec["weight_decay"]),
        optax.sgd(schedule, spec["momentum"] or None, nesterov=spec["nesterov"]),
    )


def build_pipeline(config, run: Run, dataset: data.Dataset, steps_per_epoch: int, devices):
    stages = build_stages(config, run.num_stages, dataset)
    return Pipeline(
        stages,
        method=run.method,
        optimizer=build_optimizer(config, run.method, steps_per_epoch),
        beta=config.beta if run.method == "fdg" else 1.0,
        weights=config.weights,
        memory=config.memory,
        devices=devices[:1] if run.fused else devices,
        placement="spread" if run.fused else config.placement,
        fused=run.fused,
    )


# ------------------------------------------------------------------------ evaluate


@jax.jit
def _masked_counts(logits, labels, mask):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = jnp.argmax(logits, -1) == labels
    return jnp.stack([jnp.sum(losses * mask), jnp.sum(correct * mask), jnp.sum(mask)])


def evaluate(pipe: Pipeline, state, source, transform, batch_size: int) -> dict[str, float]:
    """Test loss and accuracy over all of `source` with the current weights."""
    totals = 0.0
    for inputs, labels, mask in data.eval_batches(source, batch_size, transform):
        logits = pipe.predict(state, inputs)
        labels, mask = jax.device_put((labels, mask), logits.devices().pop())
        totals = totals + _masked_counts(logits, labels, mask)
    loss, correct, count = (float(v) for v in np.asarray(totals))
    return {"test_loss": loss / count, "test_accuracy": correct / count}


class _Limited:
    """The first `n` examples of a source (for smoke-sized evaluation)."""

    def __init__(self, source, n):
        self.source, self.n = source, min(n, len(source))

    def __len__(self):
        return self.n

    def get(self, indices):
        return self.source.get(indices)


# --------------------------------------------------------------------------- train


def config_to_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return json.loads(config.to_json())


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resumable(saved: dict[str, Any], config: ml_collections.ConfigDict, where: str) -> None:
    """Raises ValueError listing the fields where `config` differs from a checkpoint's."""
    old, new = _flat(saved), _flat(config_to_json(config))
    changed = sorted(
        key
        for key in old.keys() | new.keys()
        if old.get(key) != new.get(key) and key not in RESUMABLE_FIELDS
    )
    if changed:
        lines = "\n".join(
            f"  {key}: checkpoint {old.get(key)!r}, now {new.get(key)!r}" for key in changed
        )
        raise ValueError(
            f"The checkpoint in {where} was written with another configuration:\n{lines}\n"
            f"Resume with the configuration it was written with ({where}/config.json), or "
            "start a new run in another --workdir."
        )


def train(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    devices=None,
    log: Callable[[str], None] | None = None,
    progress_stream=None,
) -> dict[str, dict[str, Any]]:
    """Trains every run of `config` in `workdir` (resuming what is there).

    Returns, per run title, the last epoch's record (`test_accuracy`, ...).
    """
    check_config(config)
    log = log or (lambda text: print(text, flush=True))
    workdir = os.path.abspath(os.fspath(workdir))
    for run in runs_of(config):
        checkpoints = os.path.join(workdir, run.label, "checkpoints")
        if os.path.isdir(checkpoints):
            with Checkpointer(checkpoints) as saved:
                if saved.latest_step() is not None:
                    check_resumable(saved.extra()["config"], config, workdir)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_to_json(config), f, indent=2)
    devices = list(devices or jax.devices())
    dataset = data.load(
        config.dataset,
        data_dir=config.data_dir or None,
        seed=config.seed,
        image_size=config.image_size,
    )
    results = {}
    for run in runs_of(config):
        results[run.title] = _train_run(
            config, run, dataset, os.path.join(workdir, run.label), devices, log, progress_stream
        )
        runs = {
            r.title: metrics.read(os.path.join(workdir, r.label, "metrics.jsonl"), "epoch")
            for r in runs_of(config)
        }
        metrics.plot_curves(
            {k: v for k, v in runs.items() if v}, os.path.join(workdir, "curves.png")
        )
    return results


class Stopped(Exception):
    """Training stopped on request (SIGINT or SIGTERM) after saving a checkpoint."""

    def __init__(self, run_dir: str, step: int, signal_number: int):
        super().__init__(f"stopped at step {step}; the checkpoint is in {run_dir}/checkpoints")
        self.run_dir, self.step, self.signal_number = run_dir, step, signal_number


@contextlib.contextmanager
def _stop_requests():
    """Turns SIGINT / SIGTERM into a flag the loop checks between steps (main thread only),
    so that a stopped run saves a checkpoint of a consistent state before it exits."""
    requested = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda number, frame: requested.append(number))
    try:
        yield requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Tally:
    """Sums of the train metrics the last stage reported, over the epoch and over the
    current log interval (JSON-able, so that a checkpoint can carry them)."""

    def __init__(self, saved: dict[str, dict[str, float]] | None = None):
        saved = saved or {}
        self.epoch = dict(saved.get("epoch", {}))
        self.interval = dict(saved.get("interval", {}))

    def add(self, reported: dict[str, Any]) -> dict[str, float]:
        """Adds one step's device metrics (reading them to the host); returns them as floats."""
        if not reported:  # FDG while filling: no batch reached the loss yet
            return {}
        values = {name: float(v) for name, v in reported.items() if name != "batch"}
        for sums in (self.epoch, self.interval):
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + value
            sums["count"] = sums.get("count", 0) + 1
        return values

    @staticmethod
    def _means(sums, prefix=""):
        count = sums.get("count", 0)
        return {f"{prefix}{k}": v / count for k, v in sums.items() if k != "count" and count}

    def take_interval(self) -> dict[str, float]:
        means, self.interval = self._means(self.interval), {}
        return means

    def take_epoch(self) -> dict[str, float]:
        means, self.epoch = self._means(self.epoch, "train_"), {}
        return means

    def saved(self) -> dict[str, dict[str, float]]:
        return {"epoch": dict(self.epoch), "interval": dict(self.interval)}


def _train_run(config, run: Run, dataset, run_dir, devices, log, progress_stream):
    steps_per_epoch = len(dataset.train) // config.batch_size
    if config.steps_per_epoch > 0:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)
    pipe = build_pipeline(config, run, dataset, steps_per_epoch, devices)
    stream = data.Stream(
        dataset.train,
        config.batch_size,
        transform=dataset.train_transform,
        seed=config.seed,
        steps_per_epoch=steps_per_epoch,
        prefetch=config.prefetch,
        workers=config.data_workers,
        device=pipe.devices[0],
    )
    test = (
        dataset.test if config.eval_examples < 0 else _Limited(dataset.test, config.eval_examples)
    )
    total_steps = config.num_epochs * steps_per_epoch
    log(f"\n{run.title}: {pipe}")
    template = pipe.init(stream.batch(0))
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    checkpoints = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=config.keep_checkpoints)
    state, tally = template, _Tally()
    if checkpoints.latest_step() is not None:
        state, extra = checkpoints.restore(pipe, template)
        tally = _Tally(extra["tally"])
        metrics.truncate(metrics_path, after_step=state.step)
        position = extra["data"]
        if state.step >= total_steps:
            log(f"  finished earlier, at step {state.step}: nothing left to train")
        else:
            log(
                f"  resumed from the checkpoint at step {state.step} (epoch "
                f"{position['epoch'] + 1}, {position['batch_in_epoch']} of {steps_per_epoch} "
                "batches done)"
            )

    def save():
        epoch, position = divmod(state.step, steps_per_epoch)
        checkpoints.save(
            state,
            {
                "config": config_to_json(config),
                "tally": tally.saved(),
                "data": {"next_step": state.step, "epoch": epoch, "batch_in_epoch": position},
            },
        )

    writer = metrics.MetricWriter(
        metrics_path, tensorboard_dir=os.path.join(run_dir, "tensorboard")
    )
    progress = Progress(
        total_steps,
        state.step,
        config.batch_size,
        stream=progress_stream,
        every=config.log_every_steps,
        label=f"{run.label} ",
    )
    last_loss, epoch_start = None, time.perf_counter()
    reported = None  # the last step's metrics, read after the next step is dispatched
    with _stop_requests() as stop_requested, writer, progress:
        for batch in stream.iterate(state.step, total_steps):
            state, step_metrics = pipe.step(state, batch)
            if reported is not None:
                last_loss = tally.add(reported).get("loss", last_loss)
            reported = step_metrics
            step = state.step
            progress.update(step, last_loss)
            epoch_end = step % steps_per_epoch == 0
            log_due = step % config.log_every_steps == 0
            save_due = epoch_end or (
                config.checkpoint_every_steps > 0 and step % config.checkpoint_every_steps == 0
            )
            if not (epoch_end or log_due or save_due or stop_requested):
                continue
            tally.add(reported)
            reported = None
            if log_due or epoch_end:
                interval = tally.take_interval()
                if interval:
                    writer.write({"kind": "train", "step": step, **interval})
            if epoch_end:
                pipe.check_finite(state)
                record = {
                    "kind": "epoch",
                    "step": step,
                    "epoch": step // steps_per_epoch,
                    **tally.take_epoch(),
                    **evaluate(pipe, state, test, dataset.eval_transform, config.eval_batch_size),
                    "seconds": time.perf_counter() - epoch_start,
                }
                writer.write(record)
                progress.close()
                train_loss = record.get("train_loss", math.nan)
                log(
                    f"  epoch {record['epoch']:4d}  train loss {train_loss:.4f}  test accuracy "
                    f"{record['test_accuracy']:.4f}  ({record['seconds']:.1f} s)"
                )
                epoch_start = time.perf_counter()
            if save_due or stop_requested:
                save()
            if stop_requested:
                checkpoints.close()
                raise Stopped(run_dir, step, stop_requested[0])
    pipe.check_finite(state)
    export.save(export.merge(pipe, state), os.path.join(run_dir, "model"))
    checkpoints.close()
    epochs = metrics.read(metrics_path, "epoch")
    if not epochs:
        raise RuntimeError(f"{run_dir} finished without an evaluation; its metrics file is empty.")
    return epochs[-1]


def default_workdir(config_name: str) -> str:
    return os.path.join("runs", f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}")
