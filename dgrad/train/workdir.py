"""Which commands may touch a workdir, decided before anything is written.

A workdir holds one experiment: its `config.json` (written atomically) and one directory
per run. A command may start a new experiment in a missing or empty directory, resume
the one a workdir holds (fields that only change how a run is watched or fed may
differ), or, with `extend`, train a finished one for more epochs; anything else is
refused with the fields that differ. `config.json` also keeps the text corpus'
fingerprint (`corpus`): the same config read on another Python is another corpus, and
is refused too. A start that fails before its first checkpoint takes back what it
wrote. A command training in a workdir holds its lock (`hold`): a second command is
refused until the first ends.

>>> import tempfile
>>> plan = inspect(tempfile.mkdtemp(), fields.base())
>>> plan.resumes, plan.extends_from
(False, None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
from typing import Any

import ml_collections

from dgrad.train import config as fields
from dgrad.train import metrics

CONFIG_FILE = "config.json"
CORPUS_KEY = "corpus"  # config.json's entry for the text corpus' fingerprint
LOCK_FILE = ".lock"


class WorkdirError(ValueError):
    """The workdir cannot be used for this command; the message says what to do.

    >>> inspect(__file__, fields.base())
    Traceback (most recent call last):
    ...
    dgrad.train.workdir.WorkdirError: --workdir .../workdir.py is a file; give a directory.
    """


@dataclasses.dataclass(frozen=True)
class Plan:
    """What training a config in `path` means.

    Attributes:
      path: the workdir (absolute).
      existed: whether the directory was there before this command.
      saved: the config the workdir holds (its JSON), if any: then the command resumes.
      extends_from: with `extend`, the number of epochs the workdir was trained for.
      corpus: the fingerprint of the text corpus its `config.json` holds, if any.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as parent:
    ...     plan = inspect(os.path.join(parent, "new"), fields.base())
    >>> plan.existed, plan.saved, plan.resumes  # a new experiment in a directory to make
    (False, None, False)
    """

    path: str
    existed: bool
    saved: dict[str, Any] | None
    extends_from: int | None = None
    corpus: dict[str, Any] | None = None

    @property
    def resumes(self) -> bool:
        return self.saved is not None


def inspect(
    path: str | os.PathLike, config: ml_collections.ConfigDict, *, extend: bool = False
) -> Plan:
    """Decides what training `config` in `path` means; raises `WorkdirError` if it may not.

    >>> import tempfile
    >>> path, config = tempfile.mkdtemp(), fields.base()
    >>> create(inspect(path, config), config)  # a new experiment: writes config.json
    >>> config.num_stages = 4
    >>> inspect(path, config)
    Traceback (most recent call last):
    ...
    dgrad.train.workdir.WorkdirError: ... (this config differs in: num_stages 2 -> 4); ...
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise WorkdirError(f"--workdir {path} is a file; give a directory.")
    if not os.path.isdir(path) or not set(os.listdir(path)) - {LOCK_FILE}:
        if extend:
            raise WorkdirError(f"--extend needs a trained experiment, but {path} holds none.")
        return Plan(path, os.path.isdir(path), None)
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise WorkdirError(
            f"{path} holds files but no {CONFIG_FILE}, so it is not a dgrad workdir; "
            "choose a new --workdir."
        )
    saved = _saved_config(config_path)
    corpus = saved.pop(CORPUS_KEY, None)
    old, new = fields.flatten(saved), fields.flatten(fields.to_json(config))
    changed = fields.differences(saved, config, extending=extend)
    longer = fields.extension(saved, config)
    if extend and "num_epochs" in changed:
        raise WorkdirError(
            f"--extend trains a finished experiment for more epochs: give "
            f"--config.num_epochs above the {old['num_epochs']} it was trained for."
        )
    if changed:
        differences = ", ".join(
            f"{name} {old.get(name)!r} -> {new.get(name)!r}" for name in changed
        )
        hint = " (to train it longer, add --extend)" if changed == ["num_epochs"] and longer else ""
        raise WorkdirError(
            f"{path} holds another experiment (this config differs in: {differences}){hint}; "
            f"resume it with its own config ({config_path}), or use a new --workdir."
        )
    # (under --extend, as many epochs as saved: an extension that was stopped resumes)
    return Plan(path, True, saved, longer if extend else None, corpus)


def _saved_config(config_path: str) -> dict[str, Any]:
    """The config a workdir's `config.json` holds; a `WorkdirError` if it holds none."""
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        saved = error
    if not isinstance(saved, dict):
        what = str(saved) if isinstance(saved, Exception) else f"it holds a {type(saved).__name__}"
        raise WorkdirError(
            f"{config_path} is damaged ({what}), so what this workdir trains is unknown; "
            "restore it from a copy, or use a new --workdir."
        )
    return saved


def _recorded_corpus(path: str) -> dict[str, Any] | None:
    """The corpus fingerprint in the epoch records of the runs in the workdir `path`, for
    a workdir started before `config.json` kept it (None if no run has recorded one)."""
    for name in sorted(os.listdir(path)):
        for record in metrics.read(os.path.join(path, name, "metrics.jsonl"), "epoch"):
            corpus = metrics.corpus_of(record)
            if corpus:
                return corpus
    return None


def check_corpus(plan: Plan, fingerprint: dict[str, Any] | None) -> None:
    """Raises `WorkdirError` if the workdir was trained on another text corpus than the
    one this command read (`dgrad.data.Dataset.fingerprint`).

    >>> plan = Plan("/runs/gpt", True, {}, corpus={"python": "3.11.9", "sha256": "1f0e"})
    >>> check_corpus(plan, {"python": "3.11.9", "sha256": "1f0e"})  # the same: resumes
    >>> check_corpus(plan, {"python": "3.12.4", "sha256": "77aa"})
    Traceback (most recent call last):
    ...
    dgrad.train.workdir.WorkdirError: ... another corpus (python 3.11.9 -> 3.12.4, sha256 ...
    """
    trained_on = plan.corpus
    if trained_on is None and fingerprint is not None and plan.resumes:
        trained_on = _recorded_corpus(plan.path)  # a workdir older than config.json's entry
    if trained_on is None or trained_on == fingerprint:
        return
    fingerprint = fingerprint or {}
    changed = ", ".join(
        f"{name} {trained_on.get(name)} -> {fingerprint.get(name)}"
        for name in sorted(trained_on.keys() | fingerprint.keys())
        if trained_on.get(name) != fingerprint.get(name)
    )
    raise WorkdirError(
        f"{plan.path} was trained on another corpus ({changed}); resume it with the "
        "interpreter and data it was started with, or use a new --workdir."
    )


@contextlib.contextmanager
def hold(path: str | os.PathLike):
    """Makes the directory `path` and holds its lock for the with-block; raises
    `WorkdirError` while another process holds it.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as path, hold(path):
    ...     with hold(path):
    ...         pass
    Traceback (most recent call last):
    ...
    dgrad.train.workdir.WorkdirError: another command is training in /...; ...
    """
    path = os.path.abspath(os.fspath(path))
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        os.makedirs(path, exist_ok=True)
        lock = open(lock_path, "a")
    except OSError as error:
        raise WorkdirError(
            f"cannot write in --workdir {path} ({error.strerror}); choose a directory you can "
            "create and write."
        ) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise WorkdirError(
                    f"cannot lock {path} ({error.strerror}), so nothing keeps a second "
                    "command out of it; use a --workdir on a file system with file locks."
                ) from None
            raise _held_by_another(path) from None
        try:
            replaced = os.stat(lock_path).st_ino != os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:  # removed (by a start taking itself back) while this one opened it
            raise _held_by_another(path)
        yield  # (closing the file releases the lock)


def check_not_held(path: str | os.PathLike) -> None:
    """Raises `WorkdirError` at once if another command holds `path`'s lock, so that a
    second command is refused before it builds anything (`hold` claims it later).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as path, hold(path):
    ...     check_not_held(path)
    Traceback (most recent call last):
    ...
    dgrad.train.workdir.WorkdirError: another command is training in /...; ...
    """
    path = os.path.abspath(os.fspath(path))
    try:
        lock = open(os.path.join(path, LOCK_FILE))
    except OSError:  # none yet (or unreadable: `hold` says so)
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EAGAIN, errno.EACCES):
                raise _held_by_another(path) from None


def _held_by_another(path: str) -> WorkdirError:
    return WorkdirError(
        f"another command is training in {path} (it holds {LOCK_FILE}); wait for it to end, "
        "or use another --workdir."
    )


def create(
    plan: Plan, config: ml_collections.ConfigDict, corpus: dict[str, Any] | None = None
) -> None:
    """Makes the workdir and writes the config (atomically) that it now holds, with the
    fingerprint of the text `corpus` it trains on.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as parent:
    ...     path = os.path.join(parent, "experiment")
    ...     create(inspect(path, fields.base()), fields.base())
    ...     print(os.listdir(path), inspect(path, fields.base()).resumes)
    ['config.json'] True
    """
    os.makedirs(plan.path, exist_ok=True)
    _write_config(plan.path, fields.to_json(config), corpus)


def _write_config(path: str, saved: dict[str, Any], corpus: dict[str, Any] | None) -> None:
    temporary = os.path.join(path, CONFIG_FILE + ".tmp")
    with open(temporary, "w") as f:
        json.dump({**saved, **({CORPUS_KEY: corpus} if corpus else {})}, f, indent=2)
    os.replace(temporary, os.path.join(path, CONFIG_FILE))


def take_back(plan: Plan, run_labels) -> bool:
    """Removes what a start that trained nothing wrote (nothing if any run has a checkpoint),
    or puts back the config of an experiment whose extension saved nothing; whether it did.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as parent:
    ...     plan = inspect(os.path.join(parent, "experiment"), fields.base())
    ...     create(plan, fields.base())
    ...     os.makedirs(os.path.join(plan.path, "fdg_k2"))  # a run that failed before saving
    ...     take_back(plan, ["fdg_k2"]), os.path.exists(plan.path)  # the directory is gone
    (True, False)
    """
    if plan.resumes:
        newest = [_newest_meta(os.path.join(plan.path, label)) for label in run_labels]
        if plan.extends_from is None or any(
            meta is None or meta["extra"]["config"]["num_epochs"] != plan.saved["num_epochs"]
            for meta in newest
        ):
            return False
        _write_config(plan.path, plan.saved, plan.corpus)  # the extension trained nothing
        return True
    for label in run_labels:
        checkpoints = os.path.join(plan.path, label, "checkpoints")
        if os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints)):
            return False
    if not plan.existed:
        shutil.rmtree(plan.path, ignore_errors=True)
        return True
    for name in [CONFIG_FILE, *run_labels]:  # (the lock stays: another may be waiting on it)
        target = os.path.join(plan.path, name)
        if os.path.isdir(target):
            shutil.rmtree(target, ignore_errors=True)
        elif os.path.exists(target):
            os.remove(target)
    return True


def _newest_meta(run_dir: str) -> dict[str, Any] | None:
    """The metadata of the run's newest checkpoint (`Checkpointer.meta`), None where it has
    none or it does not read."""
    from dgrad.train.checkpoint import Checkpointer

    checkpoints = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(checkpoints):
        return None
    with Checkpointer(checkpoints) as saved:
        if saved.latest_step() is None:
            return None
        try:
            return saved.meta()
        except Exception:  # (damaged: the run's resume says so, and takes an older one)
            return None


def total_steps(meta: dict[str, Any]) -> int:
    """How many steps the run of a checkpoint's metadata trains for.

    >>> total_steps({"step": 40, "num_stages": 2, "extra": {"total_steps": 100}})
    100
    """
    return meta["extra"]["total_steps"]


def final_records(plan: Plan, runs) -> dict[str, dict[str, Any]] | None:
    """Each run's last epoch record if every run has finished, else None: from the runs'
    checkpoint metadata and metrics, their exported models and the curves drawn after the
    last of them (a command killed before its export or its plot has not finished).

    >>> import tempfile
    >>> config = fields.base()
    >>> with tempfile.TemporaryDirectory() as path:
    ...     create(inspect(path, config), config)
    ...     print(final_records(inspect(path, config), fields.runs_of(config)))  # no checkpoint
    None
    """
    curves = os.path.join(plan.path, "curves.png")
    if not plan.resumes or not os.path.exists(curves):
        return None
    records, exported = {}, []
    for run in runs:
        run_dir = os.path.join(plan.path, run.label)
        meta = _newest_meta(run_dir)
        if meta is None:
            return None
        model = os.path.join(run_dir, "model")
        if meta["step"] < total_steps(meta) or not os.path.isdir(model):
            return None  # stopped before the end, or before the model was exported
        if meta["extra"]["config"]["num_epochs"] != plan.saved["num_epochs"]:
            return None  # the end of fewer epochs than config.json's: an extension killed early
        exported.append(os.stat(model).st_mtime_ns)
        epochs = metrics.read(os.path.join(run_dir, "metrics.jsonl"), "epoch")
        if not epochs:
            return None
        records[run.title] = epochs[-1]
    if os.stat(curves).st_mtime_ns < max(exported, default=0):
        return None  # drawn before the last run's export: stopped before the final plot
    return records
