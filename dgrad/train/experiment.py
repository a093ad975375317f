"""An experiment from an `ml_collections` config: build, train, evaluate, checkpoint, resume.

`train(config, workdir)` is what `python -m experiments.train` runs, and what a
notebook calls. For each run of the config (the chosen method, and optionally a
fused-backprop baseline) it writes into `workdir/<run>/`:

- `metrics.jsonl` (and TensorBoard events under `tensorboard/` when tensorboardX
  is installed): train loss and accuracy every `log_every_steps`, test loss and
  accuracy every epoch, and each stage's staleness probe every `probe_every` steps;
- `checkpoints/<step>/`: the whole pipeline state, in flight included, at every
  epoch end (and every `checkpoint_every_steps`), see `dgrad.train.checkpoint`;
- `model/`: the stages merged into one model at the end, see `dgrad.train.export`;

plus `workdir/workdir.json` (its config and state) and the curves of all runs in
`workdir/curves.png`.
Calling `train` again on the same workdir resumes every unfinished run from its
newest checkpoint, bit for bit; a workdir holding another experiment is
refused before anything is written (`dgrad.train.workdir`).

JAX and the model's libraries are imported inside the functions that build and train
(`_build_runs`, `build`, `loop`): about 3 s of imports on a 2-core machine, which a config
mistake (one line in 0.3 s from `python -m experiments.train`) and a workdir found finished
do without.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dgrad.train import config as fields
from dgrad.train import distributed, metrics, workdir
from dgrad.train.signals import Stopped, StopRequests

if TYPE_CHECKING:
    import ml_collections


class SetupError(ValueError):
    """A run could not start: a config value, the workdir, or the model does not work;
    the message names what and how to fix it. Nothing was written.

    >>> import os, tempfile
    >>> from dgrad.train import config as fields
    >>> config = fields.base()
    >>> config.batch_size = 0
    >>> with tempfile.TemporaryDirectory() as workdir:
    ...     try:
    ...         train(config, workdir)
    ...     except SetupError as error:
    ...         print(error, os.listdir(workdir))
    config.batch_size = 0 is not valid: use a positive integer. []
    """


def _say(text: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


def _extension_note(config, saved: dict[str, Any], steps_per_epoch: int) -> str:
    """What extending from the saved number of epochs does to each run's learning rate."""
    from dgrad.train import build

    old = fields.from_json(saved)
    end = old.num_epochs * steps_per_epoch
    notes = []
    for run in fields.runs_of(config):
        every = 1 if run.fused else config.accumulate
        before = float(build.learning_rate(old, run.method, steps_per_epoch, every)(end // every))
        after = float(build.learning_rate(config, run.method, steps_per_epoch, every)(end // every))
        notes.append(f"{run.title}: at step {end} the rate was {before:.4g}, now {after:.4g}")
    return (
        f"Extending from {old.num_epochs} to {config.num_epochs} epochs: the "
        f"{config.optimizer.schedule} learning-rate schedule is laid out over the new length "
        f"({'; '.join(notes)})."
    )


def train(
    config: ml_collections.ConfigDict,
    workdir_path: str | os.PathLike,
    *,
    devices=None,
    extend: bool = False,
    log: Callable[[str], None] | None = None,
    progress_stream=None,
    stop: StopRequests | None = None,
    name: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Trains every run of `config` in `workdir_path` (resuming what is there); returns
    each run's last epoch record (`test_accuracy`, ...) by run title.

    Args:
      devices: the devices to use (default all, every process's).
      extend: train a finished experiment for more epochs (`config.num_epochs`
        above what it was trained for).
      log: where progress lines go (default: print on process 0).
      progress_stream: where the progress bar or lines go (default stderr).
      stop: the `StopRequests` to honour (default: one that catches SIGINT and
        SIGTERM while training).
      name: the experiment's name, for the plot's title (default the workdir's).

    Raises `SetupError` naming the field, directory or stage at fault (nothing written),
    `dgrad.data.DatasetNotFoundError` when the dataset is not prepared, and `Stopped`
    when stopped by a signal.

    >>> import io, tempfile
    >>> from dgrad.train import config as fields
    >>> config = fields.base()  # an MLP on the digits, FDG K=2, 2 steps
    >>> config.dataset, config.model.name, config.split = "digits", "mlp", "balanced"
    >>> config.num_epochs, config.steps_per_epoch, config.batch_size = 1, 2, 16
    >>> quiet = dict(log=lambda line: None, progress_stream=io.StringIO())
    >>> with tempfile.TemporaryDirectory() as workdir:
    ...     first = train(config, workdir, **quiet)
    ...     again = train(config, workdir, **quiet)  # finished: nothing is trained again
    >>> first["FDG K=2"]["step"], 0 <= first["FDG K=2"]["test_accuracy"] <= 1, again == first
    (2, True, True)
    """
    log = log or _say
    try:
        fields.check(config)
        plan = workdir.inspect(workdir_path, config, extend=extend)
    except ValueError as error:
        raise SetupError(str(error)) from error
    runs = fields.runs_of(config)
    if not extend:
        finished = workdir.final_records(plan, runs)
        if finished is not None:
            log(f"{plan.path} finished earlier: nothing left to train.")
            return finished
    elif plan.extends_from is not None and workdir.final_records(plan, runs) is None:
        raise SetupError(
            f"--extend trains a finished experiment for more epochs, but {plan.path} has not "
            f"finished its {plan.extends_from} epochs; finish it first (its own command, without "
            "--extend), then extend it."
        )
    import jax

    from dgrad.train import build, loop  # the model's libraries: not needed to see it finished

    with contextlib.ExitStack() as context:
        stop = stop or context.enter_context(StopRequests())
        plan = _claim(plan, config, extend, context)
        results = {}
        labels = [r.label for r in runs]
        taking_back = (
            (lambda: workdir.take_back(plan, labels)) if jax.process_index() == 0 else None
        )
        try:
            dataset = build.load_dataset(config)
            stop.check("loading the data")
            try:
                workdir.check_corpus(plan, dataset.fingerprint)
                steps_per_epoch = build.steps_per_epoch(config, dataset, cut=plan.resumes)
                if 0 < steps_per_epoch < config.steps_per_epoch:
                    log(
                        f"config.steps_per_epoch={config.steps_per_epoch} is more than the "
                        f"{steps_per_epoch} batches of the training split; this workdir trains "
                        f"{steps_per_epoch} per epoch, as it was started."
                    )
                pipes, initial = _build_runs(config, runs, dataset, steps_per_epoch, devices, stop)
            except ValueError as error:
                raise SetupError(str(error)) from error
            if plan.extends_from is not None:
                log(_extension_note(config, plan.saved, steps_per_epoch))
            plan = dataclasses.replace(plan, corpus=dataset.fingerprint)
            if jax.process_index() == 0:
                workdir.create(plan, config, plan.corpus)
            for run, pipe, state in zip(runs, pipes, initial):
                log(f"\n{run.title}: {pipe}")
                ctx = loop.RunContext(
                    run=run,
                    pipe=pipe,
                    initial=state,
                    dataset=dataset,
                    steps_per_epoch=steps_per_epoch,
                    run_dir=os.path.join(plan.path, run.label),
                    log=log,
                    progress_stream=progress_stream,
                    stop=stop,
                    extends_from=plan.extends_from,
                    take_back=taking_back,
                )
                try:
                    results[run.title] = loop.train_run(config, ctx)
                except workdir.WorkdirError as error:
                    raise SetupError(str(error)) from error
                if jax.process_index() == 0:
                    _plot_run_curves(plan.path, runs, config, name or os.path.basename(plan.path))
            if jax.process_index() == 0:
                workdir.finish(plan, config)
            if stop.requested is not None:
                raise Stopped(stop.requested, "Stopped after the last run had finished and saved.")
        except BaseException:
            if taking_back:
                taking_back()
            raise
    return results


def _build_runs(config, runs, dataset, steps_per_epoch: int, devices, stop: StopRequests):
    """Each run's pipeline, and its initial state on a batch of the training split's shapes."""
    import jax

    from dgrad.train import build

    devices = list(devices or jax.devices())
    example = tuple(np.asarray(a) for a in _example_batch(config, dataset))
    pipes, initial = [], []
    for run in runs:
        pipes.append(build.build_pipeline(config, run, dataset, steps_per_epoch, devices))
        initial.append(pipes[-1].init(example))
        stop.check("building the model")
    return pipes, initial


def _claim(plan, config, extend: bool, context: contextlib.ExitStack):
    """Takes the workdir for this command: process 0 holds its lock and looks at it again
    as it is now; every process refuses alike what process 0 refused."""
    import jax

    problem = None
    if jax.process_index() == 0:
        try:
            context.enter_context(workdir.hold(plan.path))
            held = workdir.inspect(plan.path, config, extend=extend)
            plan = dataclasses.replace(held, existed=plan.existed)
        except ValueError as error:
            problem = str(error)
    problem = distributed.told_by_process_0(f"workdir {plan.path}", problem)
    if problem is not None:
        raise SetupError(problem)
    return plan


def _example_batch(config, dataset):
    """A batch of the training split's shapes (its first `batch_size` examples)."""
    indices = np.arange(config.batch_size) % len(dataset.train)
    images, labels = dataset.train.get(indices)
    return dataset.eval_transform.apply(images, labels, None)


def _plot_run_curves(path: str, runs, config, name: str) -> None:
    records = {r.title: metrics.read(os.path.join(path, r.label, "metrics.jsonl")) for r in runs}
    curves = {t: [r for r in rs if r["kind"] == "epoch"] for t, rs in records.items()}
    probes = {t: [r for r in rs if r["kind"] == "probe"] for t, rs in records.items()}
    title = f"{name}: {config.dataset}, {config.model.name}"
    metrics.plot_curves(
        {k: v for k, v in curves.items() if v},
        os.path.join(path, "curves.png"),
        title=title,
        probes=probes,
    )
