"""The training loop of one run: steps, metrics one step behind, evaluation,
checkpoints, resuming, stopping on request, export.

The host never waits for a step it has just dispatched: each step's metrics
are read after the next step is dispatched. Checkpoints are written in the
background while the next steps run; a stop, and the end of the run, wait
for the write to be complete. Every process runs the same loop; process 0
alone writes metrics and the exported model, every process writes its own
shards of each checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from typing import Any, Callable, NamedTuple

import jax
import ml_collections

from dgrad import data
from dgrad.pipeline import Pipeline
from dgrad.placement import share
from dgrad.state import PipelineState
from dgrad.train import config as fields
from dgrad.train import export, metrics
from dgrad.train.checkpoint import Checkpointer, OtherFormat, Unrestorable, state_mib
from dgrad.train.config import Run
from dgrad.train.distributed import StopVote
from dgrad.train.evaluate import Limited, evaluate
from dgrad.train.progress import Progress
from dgrad.train.signals import Stopped, StopRequests
from dgrad.train.watchdog import Watchdog, injected_stall
from dgrad.train.workdir import WorkdirError


class Tally:
    """Sums of the train metrics the last stage reported, over the epoch and over the
    current log interval (JSON-able, so that a checkpoint can carry them).

    >>> tally = Tally()
    >>> tally.add({"loss": 2.0, "batch": 0})  # the batch index is no metric
    {'loss': 2.0}
    >>> _ = tally.add({"loss": 1.0, "batch": 1})
    >>> tally.take_interval(), tally.take_interval()
    ({'loss': 1.5}, {})
    >>> Tally(tally.saved()).take_epoch()  # a checkpoint carries the epoch's sums
    {'train_loss': 1.5}
    """

    def __init__(self, saved: dict[str, dict[str, float]] | None = None):
        saved = saved or {}
        self.epoch = dict(saved.get("epoch", {}))
        self.interval = dict(saved.get("interval", {}))

    def add(self, reported: dict[str, Any]) -> dict[str, float]:
        """Adds one step's metrics (reading them to the host); returns them as floats."""
        if not reported:  # FDG while filling: no batch reached the loss yet
            return {}
        values = {
            name: float(v)
            for name, v in reported.items()
            if name not in ("batch", "probe", "probe_step")
        }
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
        """The means since the last call (a log record's), and a fresh interval."""
        means, self.interval = self._means(self.interval), {}
        return means

    def take_epoch(self) -> dict[str, float]:
        """The epoch's means, named as the epoch record names them, and a fresh epoch."""
        means, self.epoch = self._means(self.epoch, "train_"), {}
        return means

    def saved(self) -> dict[str, dict[str, float]]:
        """The sums as a checkpoint carries them (`Tally(saved)` continues from them)."""
        return {"epoch": dict(self.epoch), "interval": dict(self.interval)}


def write_probe(writer, reported: dict[str, Any]) -> None:
    """One `probe` record per stage when the step's metrics hold the staleness probe's.

    >>> records = []
    >>> class Writer:
    ...     write = records.append
    >>> write_probe(Writer, {"loss": 1.0, "probe": {0: {"cosine": 0.5}}, "probe_step": 3})
    >>> records
    [{'kind': 'probe', 'step': 4, 'stage': 0, 'cosine': 0.5}]
    """
    if writer is None or "probe" not in reported:
        return
    for stage, values in reported["probe"].items():
        record = {name: float(value) for name, value in values.items()}
        writer.write(  # step: the steps done, as in the other records
            {"kind": "probe", "step": reported["probe_step"] + 1, "stage": stage, **record}
        )


@dataclasses.dataclass
class RunContext:
    """What a run needs beside its config: where it writes and how it reports.

    See `train_run` for one built and trained; `dgrad.train.train` builds them.
    """

    run: Run
    pipe: Pipeline
    initial: PipelineState
    dataset: data.Dataset
    steps_per_epoch: int
    run_dir: str
    log: Callable[[str], None]
    progress_stream: Any
    stop: StopRequests
    extends_from: int | None = None
    take_back: Callable[[], bool] | None = None  # on a hard exit (`Watchdog`'s take_back)

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's metrics and model (process 0 does)."""
        return jax.process_index() == 0


def epoch_line(record: dict[str, Any]) -> str:
    """The console's line for an epoch's record: test bits per byte for text, else accuracy.

    >>> epoch_line({"epoch": 3, "train_loss": 0.52, "test_accuracy": 0.91, "seconds": 4.0})
    '  epoch    3  train loss 0.5200  test accuracy 0.9100  (4.0 s)'
    """
    shown = (
        f"test bits per byte {record['test_bits_per_byte']:.4f}"
        if "test_bits_per_byte" in record
        else f"test accuracy {record['test_accuracy']:.4f}"
    )
    return (
        f"  epoch {record['epoch']:4d}  train loss {record.get('train_loss', math.nan):.4f}  "
        f"{shown}  ({record['seconds']:.1f} s)"
    )


def text_metrics(
    record: dict[str, Any], tokens_per_epoch: int, fingerprint: dict | None = None
) -> dict[str, Any]:
    """A text run's epoch in the units language models are compared in: perplexity
    (exp of the loss in nats per token), bits per byte (the loss / ln 2 for byte-level
    tokens, scaled by the corpus' tokens per byte for subwords) and tokens trained per
    second; the corpus' `fingerprint` goes along as `corpus_<field>`.

    >>> metrics = text_metrics({"test_loss": math.log(4), "seconds": 2.0}, 1000)
    >>> {name: round(value, 3) for name, value in metrics.items()}
    {'test_perplexity': 4.0, 'test_bits_per_byte': 2.0, 'tokens_per_second': 500.0}
    """
    units, fingerprint = {}, fingerprint or {}
    for split in ("train", "test"):
        if f"{split}_loss" in record:
            per_byte = 1.0  # byte-level tokens; subwords: the split's tokens per byte
            if f"{split}_tokens" in fingerprint:
                per_byte = fingerprint[f"{split}_tokens"] / fingerprint[f"{split}_bytes"]
            units[f"{split}_perplexity"] = math.exp(record[f"{split}_loss"])
            units[f"{split}_bits_per_byte"] = record[f"{split}_loss"] / math.log(2) * per_byte
    units["tokens_per_second"] = tokens_per_epoch / record["seconds"]
    return metrics.with_corpus(units, fingerprint)


class Due(NamedTuple):
    """What is due after a step (see `due_after`)."""

    log: bool
    evaluate: bool
    save: bool
    stop: bool = False


def due_after(
    step: int,
    *,
    steps_per_epoch: int,
    log_every: int,
    checkpoint_every: int,
    stop_agreed: Callable[[], bool] = lambda: False,
    agree_every_step: bool = True,
) -> Due:
    """What is due after `step` steps: a log every `log_every`, an evaluation and a
    checkpoint at each epoch's end, a checkpoint every `checkpoint_every` (0: never),
    and a stop (after a checkpoint) if `stop_agreed()`. That is asked after every step
    when `agree_every_step`, else only where something else is due: on several processes
    it is a vote, cast at steps all of them reach alike, so that all save the same step.

    >>> due_after(10, steps_per_epoch=10, log_every=4, checkpoint_every=0)
    Due(log=False, evaluate=True, save=True, stop=False)
    """
    epoch_end = step % steps_per_epoch == 0
    save = epoch_end or (checkpoint_every > 0 and step % checkpoint_every == 0)
    log = step % log_every == 0
    stop = (agree_every_step or log or epoch_end or save) and stop_agreed()
    return Due(log, epoch_end, save, stop)


class Pace:
    """The pace of the steps between two train records: seconds per step and `unit`s per
    second (a step being `per_step` of them), without the time paused in between
    (evaluating, saving); and the model FLOPs utilization when a step's `flops` and the
    `peak_flops` per second of all the run's devices are given. Read from the host's
    clock when a record is due, so that the loop never waits for a device to time it.

    >>> pace = Pace(start=0, per_step=32)
    >>> pace.begin -= 40.0  # as if the 4 steps to come took 40 s in all
    >>> pace.pause(20.0)  # half of which went to an evaluation
    >>> {name: round(value) for name, value in pace.take(4).items()}
    {'step_seconds': 5, 'samples_per_second': 6}
    """

    def __init__(
        self,
        start: int,
        per_step: int,
        unit: str = "sample",
        flops: float = 0.0,
        peak_flops: float = 0.0,
    ):
        self.step, self.per_step, self.unit = start, per_step, unit
        self.flops, self.peak_flops = flops, peak_flops
        self.begin, self.paused = time.perf_counter(), 0.0

    def pause(self, seconds: float) -> None:
        """Leaves `seconds` (spent on something other than steps) out of the pace."""
        self.paused += seconds

    def take(self, step: int) -> dict[str, float]:
        """The pace since the last call (or the start) up to `step` steps done; {} if no
        step was done since.
        """
        now, steps = time.perf_counter(), step - self.step
        if steps <= 0:
            return {}
        seconds = max(now - self.begin - self.paused, 1e-9) / steps
        self.step, self.begin, self.paused = step, now, 0.0
        pace = {"step_seconds": seconds, f"{self.unit}s_per_second": self.per_step / seconds}
        if self.flops and self.peak_flops:
            pace["mfu"] = self.flops / seconds / self.peak_flops
        return pace


class Behind:
    """The metrics of the last step, read (shared between processes, tallied, probes
    written) only once the next step is dispatched, so that the host never waits for the
    step it just dispatched; a log record due at that step is written once they are read.

    >>> records = []
    >>> class Writer:
    ...     write = records.append
    >>> behind = Behind(Tally(), Writer)
    >>> behind.hold({"loss": 2.0, "batch": 0}, log_at=1)  # step 1's metrics, a log due
    >>> records  # nothing read yet
    []
    >>> behind.read()  # after step 2 is dispatched
    2.0
    >>> records
    [{'kind': 'train', 'step': 1, 'loss': 2.0}]
    >>> behind.write_interval(2)  # no step since: no record
    """

    def __init__(self, tally: Tally, writer, pace: Pace | None = None):
        self.tally, self.writer, self.pace = tally, writer, pace
        self.pending, self.log_at = None, None

    def hold(self, step_metrics: dict[str, Any], log_at: int | None = None) -> None:
        """Holds a step's metrics (device arrays) until `read`; `log_at`: the step whose
        train record is written once they are read.
        """
        self.pending, self.log_at = step_metrics, log_at

    def read(self) -> float | None:
        """Reads what is held, once; returns its loss (None if it has none)."""
        loss = None
        if self.pending is not None:
            reported = share(self.pending)
            loss = self.tally.add(reported).get("loss")
            write_probe(self.writer, reported)
        if self.log_at is not None:
            self.write_interval(self.log_at)
        self.pending, self.log_at = None, None
        return loss

    def write_interval(self, step: int) -> None:
        """Writes the mean train metrics since the last record, as the record of `step`,
        with the steps' pace if a `Pace` is given.
        """
        interval = self.tally.take_interval()
        if interval and self.writer is not None:
            pace = self.pace.take(step) if self.pace is not None else {}
            self.writer.write({"kind": "train", "step": step, **interval, **pace})


def _resume(ctx: RunContext, config, checkpoints: Checkpointer, total: int):
    """The state and tally to continue from: those of the newest checkpoint that restores
    (the newer ones set aside, each said in one line), or a fresh start."""
    steps = checkpoints.all_steps()
    if not steps:
        path = os.path.join(ctx.run_dir, "metrics.jsonl")
        if ctx.writes and os.path.exists(path):  # killed before its first checkpoint
            metrics.truncate(path, after_step=0)
        return ctx.initial, Tally()
    failed = []
    for step in reversed(steps):  # newest first, on every process alike
        try:
            state, extra = checkpoints.restore(
                ctx.pipe, step, check=lambda meta: _refuse_other_runs(ctx, config, meta)
            )
            break
        except OtherFormat as error:
            raise WorkdirError(str(error)) from None
        except Unrestorable as error:
            failed.append(error)
    else:
        reasons = "; ".join(f"step {error.step}: {error.reason}" for error in failed)
        raise WorkdirError(
            f"No checkpoint in {checkpoints.directory} restores ({reasons}); move them out "
            "of the way to train the run afresh, or use a new --workdir."
        )
    for error in failed:
        where = checkpoints.set_aside(error.step)
        ctx.log(f"  {error}; set aside in {where}")
    if ctx.writes:
        metrics.truncate(os.path.join(ctx.run_dir, "metrics.jsonl"), after_step=state.step)
    if state.step >= total:
        ctx.log(f"  finished earlier, at step {state.step}: nothing left to train")
    else:
        epoch, position = divmod(state.step, ctx.steps_per_epoch)
        ctx.log(
            f"  resumed from the checkpoint at step {state.step} (epoch {epoch + 1}, "
            f"{position} of {ctx.steps_per_epoch} batches done)"
            + (", the newest that restores" if failed else "")
        )
    return state, Tally(extra["tally"])


def _refuse_other_runs(ctx: RunContext, config, meta: dict[str, Any]) -> None:
    """Raises `WorkdirError` if the checkpoint of `meta` is of another run than this one."""
    changed = fields.differences(meta["extra"]["config"], config, extending=True)  # checked before
    if changed:
        raise WorkdirError(
            f"The checkpoint in {ctx.run_dir} was written with another configuration (it "
            f"differs in: {', '.join(changed)}); resume with the configuration it was "
            "written with, or use a new --workdir."
        )


def _epoch_record(
    ctx, config, state, test, tally, epoch_start, saving_seconds, watchdog
) -> dict[str, Any]:
    """The record of the epoch that ends at `state.step`: its train tally, the evaluation
    of `test`, the time since `epoch_start` (its `seconds`) and what of it went to
    evaluating, to saving (`saving_seconds`) and to training, and for text the metrics
    in tokens and bytes."""
    ctx.pipe.check_finite(state)
    evaluated = time.perf_counter()
    results = evaluate(
        ctx.pipe,
        state,
        test,
        ctx.dataset.eval_transform,
        config.eval_batch_size,
        on_batch=watchdog.beat,
    )
    now = time.perf_counter()
    record = {
        "kind": "epoch",
        "step": state.step,
        "epoch": state.step // ctx.steps_per_epoch,
        **tally.take_epoch(),
        **results,
        "seconds": now - epoch_start,
        "train_seconds": evaluated - epoch_start - saving_seconds,
        "eval_seconds": now - evaluated,
        "checkpoint_seconds": saving_seconds,
        "checkpoint_mib": round(state_mib(state), 2),  # of the checkpoint saved right after
    }
    tokens = ctx.dataset.tokens_per_example
    if tokens:
        per_epoch = config.batch_size * tokens * ctx.steps_per_epoch
        record.update(text_metrics(record, per_epoch, ctx.dataset.fingerprint))
    return record


def _save(checkpoints, state, config, tally, total, ctx, watchdog) -> float:
    """Checkpoints `state` with what a resume needs beside it: the config, the epoch's
    tally so far and where the data stream stands; returns the seconds the steps wait
    for it (the previous write's end and the copy to host; the files are written in
    the background)."""
    epoch, position = divmod(state.step, ctx.steps_per_epoch)
    start = time.perf_counter()
    with watchdog.saving():
        checkpoints.save(
            state,
            {
                "config": fields.to_json(config),
                "tally": tally.saved(),
                "data": {"next_step": state.step, "epoch": epoch, "batch_in_epoch": position},
                "total_steps": total,
            },
        )
    return time.perf_counter() - start


def _flops_and_peak(pipe: Pipeline, peak_tflops: float) -> dict[str, float]:
    """A step's model FLOPs and the peak FLOP/s of all the pipeline's devices, for `Pace`'s
    MFU; {} without `peak_tflops`."""
    if not peak_tflops:
        return {}
    devices = len({device for group in pipe.placement.groups for device in group})
    return {"flops": pipe.model_flops(), "peak_flops": 1e12 * peak_tflops * devices}


def _finish_writing(checkpoints: Checkpointer, watchdog: Watchdog) -> None:
    """Waits for the checkpoint being written in the background to be complete."""
    with watchdog.saving():
        checkpoints.wait()


def train_run(config: ml_collections.ConfigDict, ctx: RunContext) -> dict[str, Any]:
    """Trains one run to `config.num_epochs`, resuming its newest checkpoint; returns its
    last epoch record.

    >>> import io, tempfile
    >>> import numpy as np
    >>> from dgrad.train import build
    >>> from dgrad.train.config import files as config_files
    >>> config, _ = config_files.load("experiments/configs/default.py:smoke")
    >>> config.model.name, config.baseline, config.num_epochs = "mlp", "", 1
    >>> config.steps_per_epoch = 4
    >>> dataset = build.load_dataset(config)
    >>> (run,) = fields.runs_of(config)
    >>> pipe = build.build_pipeline(config, run, dataset, 4, jax.devices()[:2])
    >>> first = dataset.train.get(np.arange(config.batch_size))
    >>> example = dataset.eval_transform.apply(*first, None)
    >>> with tempfile.TemporaryDirectory() as run_dir:
    ...     ctx = RunContext(
    ...         run, pipe, pipe.init(example), dataset, 4, run_dir, log=lambda line: None,
    ...         progress_stream=io.StringIO(), stop=StopRequests()
    ...     )
    ...     record = train_run(config, ctx)
    >>> record["kind"], record["step"], record["epoch"], 0 <= record["test_accuracy"] <= 1
    ('epoch', 4, 1, True)
    """
    pipe, steps_per_epoch = ctx.pipe, ctx.steps_per_epoch
    total = config.num_epochs * steps_per_epoch
    stream = data.Stream(
        ctx.dataset.train,
        config.batch_size,
        transform=ctx.dataset.train_transform,
        seed=config.seed,
        steps_per_epoch=steps_per_epoch,
        prefetch=config.prefetch,
        workers=config.data_workers,
        sharding=pipe.placement.sharded(0),
    )
    test = ctx.dataset.test
    if config.eval_examples > 0:
        test = Limited(test, config.eval_examples)
    metrics_path = os.path.join(ctx.run_dir, "metrics.jsonl")
    checkpoints = Checkpointer(
        os.path.join(ctx.run_dir, "checkpoints"), keep=config.keep_checkpoints
    )
    with checkpoints, Watchdog(config.stall_timeout, take_back=ctx.take_back) as watchdog:
        watchdog.watch_writes(checkpoints.writing)
        state, tally = _resume(ctx, config, checkpoints, total)

        label = f"{ctx.run.label} "
        if jax.process_count() > 1:
            label = f"[process {jax.process_index()}] {label}"
        writer = (
            metrics.MetricWriter(
                metrics_path, tensorboard_dir=os.path.join(ctx.run_dir, "tensorboard")
            )
            if ctx.writes
            else None
        )
        tokens = ctx.dataset.tokens_per_example
        progress = Progress(
            total,
            state.step,
            config.batch_size * (tokens or 1),
            stream=ctx.progress_stream,
            every=config.log_every_steps,
            label=label,
            unit="token" if tokens else "sample",
        )
        vote = StopVote(ctx.run.label)  # (`log_every_steps` bounds the wait for a stop)
        last_loss, epoch_start, saving = None, time.perf_counter(), 0.0
        pace = Pace(
            state.step,
            config.batch_size * (tokens or 1),
            "token" if tokens else "sample",
            **_flops_and_peak(pipe, config.peak_tflops),
        )
        behind = Behind(tally, writer, pace)
        with progress:
            for batch in stream.iterate(state.step, total):
                injected_stall(state.step)
                state, step_metrics = pipe.step(state, batch)
                loss = behind.read()  # the step before this one
                last_loss = last_loss if loss is None else loss
                step = state.step
                watchdog.beat(step)
                progress.update(step, last_loss)
                due = due_after(
                    step,
                    steps_per_epoch=steps_per_epoch,
                    log_every=config.log_every_steps,
                    checkpoint_every=config.checkpoint_every_steps,
                    stop_agreed=lambda: vote.any(ctx.stop.requested is not None),
                    agree_every_step=jax.process_count() == 1,
                )
                behind.hold(step_metrics, log_at=step if due.log or due.evaluate else None)
                if not (due.evaluate or due.save or due.stop):
                    continue
                behind.read()  # evaluating and saving wait for this step anyway
                if due.evaluate:
                    record = _epoch_record(
                        ctx, config, state, test, tally, epoch_start, saving, watchdog
                    )
                    pace.pause(record["eval_seconds"])
                    if writer is not None:
                        writer.write(record)
                    progress.write(epoch_line(record), ctx.log)
                    epoch_start, saving = time.perf_counter(), 0.0
                if due.save or due.stop:
                    seconds = _save(checkpoints, state, config, tally, total, ctx, watchdog)
                    saving += seconds  # (an epoch's end saves after its record: the next's)
                    pace.pause(seconds)
                if due.stop:
                    _finish_writing(checkpoints, watchdog)
                    if writer is not None:
                        writer.close()
                    raise Stopped(
                        ctx.stop.requested or signal.SIGTERM,
                        f"Stopped at step {step} after saving a checkpoint of it.",
                        checkpoint_step=step,
                    )
        _finish_writing(checkpoints, watchdog)  # the last checkpoint whole before the export
        if writer is not None:
            writer.close()
        pipe.check_finite(state)
        model = export.merge(pipe, state)
        export.save(model, os.path.join(ctx.run_dir, "model"))
    epochs = metrics.read(metrics_path, "epoch")
    if not epochs:
        raise RuntimeError(
            f"{ctx.run_dir} finished without an evaluation; its metrics file is empty."
        )
    return epochs[-1]
