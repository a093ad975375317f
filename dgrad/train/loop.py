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


class TrainMetrics:
    """A run's train metrics, read one step behind: `hold` keeps a step's (device arrays)
    until `read`, called once the next step is dispatched, so that the host never waits for
    the step it just dispatched. What is read is summed over the epoch and the log interval
    (JSON-able: `saved` is what a checkpoint carries, and `saved=` continues from it), the
    staleness probe's records written at once, and a train record due at the step held
    written with the interval's means and its pace: seconds per step and `unit`s per second
    (a step being `per_step` of them) without the time `pause`d (evaluating, saving), and the
    MFU when a step's `flops` and the `peak_flops` per second of all the devices are given.

    >>> records = []
    >>> class Writer:
    ...     write = records.append
    >>> metrics = TrainMetrics(Writer, start=0, per_step=32)
    >>> metrics.hold({"loss": 2.0, "batch": 0}, log_at=1)  # step 1's metrics, a log due
    >>> records  # nothing read yet
    []
    >>> metrics.read()  # after step 2 is dispatched
    2.0
    >>> [(r["kind"], r["step"], r["loss"]) for r in records], sorted(records[0])[-2:]
    ([('train', 1, 2.0)], ['step', 'step_seconds'])
    >>> metrics.pause(1.0)  # an evaluation's seconds, left out of the pace
    >>> TrainMetrics(None, start=1, per_step=32, saved=metrics.saved()).take_epoch()
    {'train_loss': 2.0}
    """

    def __init__(
        self,
        writer,
        start: int,
        per_step: int,
        unit: str = "sample",
        flops: float = 0.0,
        peak_flops: float = 0.0,
        saved: dict[str, dict[str, float]] | None = None,
    ):
        self.writer, self.per_step, self.unit = writer, per_step, unit
        self.flops, self.peak_flops = flops, peak_flops
        self.sums = {part: dict((saved or {}).get(part, {})) for part in ("epoch", "interval")}
        self.pending, self.log_at = None, None
        self.step, self.begin, self.paused = start, time.perf_counter(), 0.0

    def hold(self, step_metrics: dict[str, Any], log_at: int | None = None) -> None:
        """Holds a step's metrics until `read`; `log_at`: the step whose train record is
        written once they are read."""
        self.pending, self.log_at = step_metrics, log_at

    def read(self) -> float | None:
        """Reads what is held, once; returns its loss (None if it has none: FDG filling)."""
        loss = None
        if self.pending:
            reported = share(self.pending)
            values = {
                name: float(value)
                for name, value in reported.items()
                if name not in ("batch", "probe", "probe_step")
            }
            for sums in self.sums.values():
                for name, value in values.items():
                    sums[name] = sums.get(name, 0.0) + value
                sums["count"] = sums.get("count", 0) + 1
            loss = values.get("loss")
            for stage, probe in reported.get("probe", {}).items():  # step: the steps done
                step = reported["probe_step"] + 1
                record = {name: float(value) for name, value in probe.items()}
                self._write({"kind": "probe", "step": step, "stage": stage, **record})
        if self.log_at is not None:
            interval = self._take("interval")
            if interval:
                self._write({"kind": "train", "step": self.log_at, **interval, **self._pace()})
        self.pending, self.log_at = None, None
        return loss

    def pause(self, seconds: float) -> None:
        """Leaves `seconds` (spent on something other than steps) out of the pace."""
        self.paused += seconds

    def take_epoch(self) -> dict[str, float]:
        """The epoch's means, named as the epoch record names them, and a fresh epoch."""
        return {f"train_{name}": mean for name, mean in self._take("epoch").items()}

    def saved(self) -> dict[str, dict[str, float]]:
        """The sums as a checkpoint carries them."""
        return {part: dict(sums) for part, sums in self.sums.items()}

    def _take(self, part: str) -> dict[str, float]:
        sums, self.sums[part] = self.sums[part], {}
        count = sums.pop("count", 0)
        return {name: total / count for name, total in sums.items()} if count else {}

    def _pace(self) -> dict[str, float]:
        now, steps = time.perf_counter(), self.log_at - self.step
        if steps <= 0:
            return {}
        seconds = max(now - self.begin - self.paused, 1e-9) / steps
        self.step, self.begin, self.paused = self.log_at, now, 0.0
        pace = {"step_seconds": seconds, f"{self.unit}s_per_second": self.per_step / seconds}
        if self.flops and self.peak_flops:
            pace["mfu"] = self.flops / seconds / self.peak_flops
        return pace

    def _write(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(record)


def _resume(ctx: RunContext, config, checkpoints: Checkpointer, total: int):
    """The state and metric sums to continue from: those of the newest checkpoint that restores
    (the newer ones set aside, each said in one line), or a fresh start."""
    steps = checkpoints.all_steps()
    if not steps:
        path = os.path.join(ctx.run_dir, "metrics.jsonl")
        if ctx.writes and os.path.exists(path):  # killed before its first checkpoint
            metrics.truncate(path, after_step=0)
        return ctx.initial, None
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
    return state, extra["tally"]


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
    ctx, config, state, test, train_metrics, epoch_start, saving_seconds, watchdog
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
        **train_metrics.take_epoch(),
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


def _save(checkpoints, state, config, train_metrics, total, ctx, watchdog) -> float:
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
                "tally": train_metrics.saved(),
                "data": {"next_step": state.step, "epoch": epoch, "batch_in_epoch": position},
                "total_steps": total,
            },
        )
    return time.perf_counter() - start


def _flops_and_peak(pipe: Pipeline, peak_tflops: float) -> dict[str, float]:
    """A step's model FLOPs and the peak FLOP/s of all the pipeline's devices, for the
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
        state, sums = _resume(ctx, config, checkpoints, total)

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
        train_metrics = TrainMetrics(
            writer,
            state.step,
            config.batch_size * (tokens or 1),
            "token" if tokens else "sample",
            **_flops_and_peak(pipe, config.peak_tflops),
            saved=sums,
        )
        with progress:
            for batch in stream.iterate(state.step, total):
                injected_stall(state.step)
                state, step_metrics = pipe.step(state, batch)
                loss = train_metrics.read()  # the step before this one
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
                train_metrics.hold(step_metrics, step if due.log or due.evaluate else None)
                if not (due.evaluate or due.save or due.stop):
                    continue
                train_metrics.read()  # evaluating and saving wait for this step anyway
                if due.evaluate:
                    record = _epoch_record(
                        ctx, config, state, test, train_metrics, epoch_start, saving, watchdog
                    )
                    train_metrics.pause(record["eval_seconds"])
                    if writer is not None:
                        writer.write(record)
                    progress.write(epoch_line(record), ctx.log)
                    epoch_start, saving = time.perf_counter(), 0.0
                if due.save or due.stop:
                    seconds = _save(checkpoints, state, config, train_metrics, total, ctx, watchdog)
                    saving += seconds  # (an epoch's end saves after its record: the next's)
                    train_metrics.pause(seconds)
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
