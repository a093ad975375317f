"""A workdir: one experiment, its state in one file, and which commands may touch it.

A workdir holds `workdir.json` and one directory per run. `workdir.json`, written
atomically and read here alone, holds the experiment's `config`, the fingerprint of the
text `corpus` it trains on (the same config read on another Python is another corpus) and
`finished_epochs`, the epochs at whose end every run had finished and the curves were
drawn (null before). A command may start a new experiment in a missing or empty directory,
resume the one a workdir holds (fields that only change how a run is watched or fed may
differ), or, with `extend`, train a finished one for more epochs; anything else is refused
with the fields that differ. A command holds the workdir's lock (`hold`) from before it
loads anything to its end, so a second command is refused at once; a start that fails
before its first checkpoint takes back what it wrote (`take_back`).

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

STATE_FILE = "workdir.json"
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
      corpus: the fingerprint of the text corpus the workdir trains on, if any.
      finished: the epochs the experiment had finished at, if it had.

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
    finished: int | None = None

    @property
    def resumes(self) -> bool:
        return self.saved is not None


def inspect(
    path: str | os.PathLike, config: ml_collections.ConfigDict, *, extend: bool = False
) -> Plan:
    """Decides what training `config` in `path` means; raises `WorkdirError` if it may not.

    >>> import tempfile
    >>> path, config = tempfile.mkdtemp(), fields.base()
    >>> create(inspect(path, config), config)  # a new experiment: writes workdir.json
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
    state = _read_state(path)
    saved = state["config"]
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
            f"resume it with its own config (in {os.path.join(path, STATE_FILE)}), or use a "
            "new --workdir."
        )
    # (under --extend, as many epochs as saved: an extension that was stopped resumes)
    extends_from = longer if extend else None
    return Plan(path, True, saved, extends_from, state["corpus"], state["finished_epochs"])


def _read_state(path: str) -> dict[str, Any]:
    """The state `workdir.json` holds; a `WorkdirError` if the workdir has none or it is
    damaged."""
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.exists(state_path):
        older = os.path.exists(os.path.join(path, "config.json"))
        raise WorkdirError(
            f"{path} was started by an older dgrad (it holds config.json, not {STATE_FILE}); "
            "train it with the dgrad that started it, or use a new --workdir."
            if older
            else f"{path} holds files but no {STATE_FILE}, so it is not a dgrad workdir; "
            "choose a new --workdir."
        )
    try:
        with open(state_path) as f:
            state = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        state = error
    keys = {"config", "corpus", "finished_epochs"}
    if not (isinstance(state, dict) and keys <= set(state) and isinstance(state["config"], dict)):
        what = state if isinstance(state, Exception) else f"it holds no {', '.join(sorted(keys))}"
        raise WorkdirError(
            f"{state_path} is damaged ({what}), so what this workdir trains is unknown; "
            "restore it from a copy, or use a new --workdir."
        )
    return state


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


def _held_by_another(path: str) -> WorkdirError:
    return WorkdirError(
        f"another command is training in {path} (it holds {LOCK_FILE}); wait for it to end, "
        "or use another --workdir."
    )


def create(
    plan: Plan, config: ml_collections.ConfigDict, corpus: dict[str, Any] | None = None
) -> None:
    """Makes the workdir and writes the state it now holds: `config`, the fingerprint of
    the text `corpus` it trains on, and the epochs it had finished at (an extension's).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as parent:
    ...     path = os.path.join(parent, "experiment")
    ...     create(inspect(path, fields.base()), fields.base())
    ...     print(os.listdir(path), inspect(path, fields.base()).resumes)
    ['workdir.json'] True
    """
    os.makedirs(plan.path, exist_ok=True)
    _write_state(plan.path, fields.to_json(config), corpus, plan.finished)


def finish(plan: Plan, config: ml_collections.ConfigDict) -> None:
    """Records that every run has finished `config.num_epochs` and the curves are drawn.

    >>> import tempfile
    >>> path, config = tempfile.mkdtemp(), fields.base()
    >>> create(inspect(path, config), config)
    >>> finish(inspect(path, config), config)
    >>> inspect(path, config).finished
    300
    """
    _write_state(plan.path, fields.to_json(config), plan.corpus, config.num_epochs)


def _write_state(path: str, config: dict, corpus: dict | None, finished: int | None) -> None:
    temporary = os.path.join(path, STATE_FILE + ".tmp")
    with open(temporary, "w") as f:
        state = {"config": config, "corpus": corpus, "finished_epochs": finished}
        json.dump(state, f, indent=2)
    os.replace(temporary, os.path.join(path, STATE_FILE))


def take_back(plan: Plan, run_labels) -> bool:
    """Removes what a start that trained nothing wrote (nothing if any run has a checkpoint),
    or puts back the state of an experiment whose extension saved nothing; whether it did.

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
        _write_state(plan.path, plan.saved, plan.corpus, plan.finished)  # it trained nothing
        return True
    for label in run_labels:
        checkpoints = os.path.join(plan.path, label, "checkpoints")
        if os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints)):
            return False
    if not plan.existed:
        shutil.rmtree(plan.path, ignore_errors=True)
        return True
    for name in [STATE_FILE, LOCK_FILE, *run_labels]:  # (`hold` sees its lock file replaced)
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


def final_records(plan: Plan, runs) -> dict[str, dict[str, Any]] | None:
    """Each run's last epoch record if the experiment has finished its epochs, else None.

    >>> import tempfile
    >>> config = fields.base()
    >>> with tempfile.TemporaryDirectory() as path:
    ...     create(inspect(path, config), config)
    ...     print(final_records(inspect(path, config), fields.runs_of(config)))  # not finished
    None
    """
    if not plan.resumes or plan.finished != plan.saved["num_epochs"]:
        return None
    records = {}
    for run in runs:
        epochs = metrics.read(os.path.join(plan.path, run.label, "metrics.jsonl"), "epoch")
        if not epochs:
            return None
        records[run.title] = epochs[-1]
    return records
