"""Checkpoints of a whole pipeline state, including what is in flight, with orbax.

A `PipelineState` between two steps holds each stage's weights and optimizer state,
the records kept for delayed backwards and the messages travelling between stages.
`Checkpointer` saves it with a JSON item beside it (the step, the caller's metadata,
the `FORMAT`), so that a resumed run continues bit for bit. A record that keeps its
`source` (the option `record_sources`) is saved as that source and its VJP computed
again on restore: a checkpoint is about the size of the model and the batches in
flight. Which records and messages exist after step t follows from the timetable
(`Pipeline.state_structure`), so orbax reads every array straight onto its stage's
devices in the restoring pipeline, whatever its layout or number of processes.

A save returns once the arrays are copied to host memory; the files are written in the
background, atomically (orbax renames a complete checkpoint into place, then deletes those
beyond `keep`). A checkpoint that does not restore raises `Unrestorable` in one line and
`set_aside` moves it where orbax does not look; one of another format raises `OtherFormat`.

Under several processes every process calls `save`, `restore` and `set_aside` with no
collective of its own in flight (orbax's barriers are collectives); the background
write's barriers use the `jax.distributed` key-value store, and so does `restore` to
make every process succeed or fail together.

>>> import tempfile, jax, jax.numpy as jnp, optax
>>> import dgrad
>>> from dgrad import models
>>> pipe = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), method="fdg",
...                       optimizer=optax.sgd(0.1))
>>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
>>> state, _ = pipe.step(pipe.init(batch), batch)
>>> with Checkpointer(tempfile.mkdtemp()) as checkpoints:
...     checkpoints.save(state, {"note": "after one step"})
...     restored, extra = checkpoints.restore(pipe)
>>> restored.step, restored.activations[1].batch, extra["note"]
(1, 0, 'after one step')
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import dgrad
from dgrad import placement
from dgrad.train import distributed

if TYPE_CHECKING:
    from dgrad.state import PipelineState

DAMAGED = "damaged"  # the folder beside the checkpoints where `set_aside` moves one
# What a checkpoint holds and how: 3 since records of a VJP that keep their source are
# saved as the source (`stored`); 2 held every VJP's leaves; 1 is every checkpoint written
# before the format was (dgrad 0.2.0 and before: weights under nnx.Variable's `value`).
FORMAT = 3


class OtherFormat(ValueError):
    """Checkpoint `step` in `directory` is of a format this dgrad does not read.

    >>> print(OtherFormat(8, "/runs/a/checkpoints", {"step": 8}))
    The checkpoint at step 8 in /runs/a/checkpoints is of format 1 (written by dgrad 0.2.0 ...
    """

    def __init__(self, step: int, directory: str, meta: dict[str, Any]):
        found = meta.get("format", 1)
        by = f"dgrad {meta['dgrad']}" if "dgrad" in meta else "dgrad 0.2.0 or before"
        super().__init__(
            f"The checkpoint at step {step} in {directory} is of format {found} (written by "
            f"{by}); this dgrad reads format {FORMAT} only: resume it with the dgrad that "
            "wrote it, or train the experiment again in a new --workdir."
        )


class Unrestorable(ValueError):
    """Checkpoint `step` in `directory` does not restore; `reason` says what failed, in one line.

    >>> print(Unrestorable(8, "/runs/a/checkpoints", "its arrays: ValueError: OUT_OF_RANGE"))
    The checkpoint at step 8 in /runs/a/checkpoints does not restore: its arrays: ValueError: ...
    """

    def __init__(self, step: int, directory: str, reason: str):
        super().__init__(f"The checkpoint at step {step} in {directory} does not restore: {reason}")
        self.step, self.reason = step, reason


def state_mib(state: PipelineState) -> float:
    """The MiB of arrays a checkpoint of `state` holds (each array counted once, whole,
    however many devices hold its shards or copies); `state` may be one of shapes
    (`dgrad.Pipeline.state_structure`).

    >>> import jax.numpy as jnp, optax
    >>> import dgrad
    >>> from dgrad import models
    >>> pipe = dgrad.Pipeline(models.mlp([256, 1024], num_stages=1), optimizer=optax.sgd(0.1))
    >>> state = pipe.init((jnp.ones((2, 256)), jnp.zeros((2,), jnp.int32)))
    >>> round(state_mib(state), 3)  # a 256 x 1024 float32 kernel and its bias; SGD keeps none
    1.004
    """
    leaves = jax.tree.leaves(stored(state))
    return sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in leaves) / 2**20


class Checkpointer:
    """Saves and restores pipeline states in `directory`, keeping the newest `keep`.

    Args:
      directory: where the numbered checkpoints go (created if missing).
      keep: how many of the newest checkpoints to keep.
      background: write each checkpoint in the background (False: `save` returns once
        it is complete).

    The example uses every method:

    >>> import os, tempfile, jax, jax.numpy as jnp, optax
    >>> import dgrad
    >>> from dgrad import models
    >>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
    >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
    >>> state = pipe.init(batch)
    >>> directory = tempfile.mkdtemp()
    >>> Checkpointer(directory).close()  # what leaving a with-block does
    >>> with Checkpointer(directory, keep=2) as checkpoints:
    ...     print(checkpoints.latest_step())
    ...     for step in (1, 2, 3):
    ...         checkpoints.save(state.replace(step=step), {"epoch": step})  # returns at once
    ...     checkpoints.wait()  # the last write complete
    ...     print(checkpoints.writing(), checkpoints.all_steps(), checkpoints.latest_step())
    ...     print(sorted(os.listdir(os.path.join(directory, "3"))))  # the arrays, the meta
    ...     print(checkpoints.extra(), checkpoints.meta(2))
    ...     restored, extra = checkpoints.restore(pipe)  # the newest
    ...     where = checkpoints.set_aside(3)  # as for one that does not restore
    ...     print(checkpoints.all_steps(), os.path.relpath(where, directory))
    None
    False [2, 3] 3
    [..., 'meta', 'state']
    {'epoch': 3} {'format': 3, 'dgrad': '...', 'step': 2, 'num_stages': 1, 'extra': {'epoch': 2}}
    [2] damaged/3
    >>> all(jax.tree.leaves(jax.tree.map(jnp.array_equal, restored.stages, state.stages)))
    True
    >>> other = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
    >>> _ = other.init(batch)
    >>> with Checkpointer(directory) as checkpoints:
    ...     checkpoints.restore(other)
    Traceback (most recent call last):
        ...
    dgrad.train.checkpoint.Unrestorable: ... does not restore: it holds 1 stages but ...
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, background: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=background
            ),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        # Read without the manager: its restore ends in a barrier that a process whose
        # read failed would never reach (see `restore`).
        self._state_reader = ocp.StandardCheckpointHandler()
        self._meta_reader = ocp.JsonCheckpointHandler()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Waits for orbax's work on the directory to finish and releases it."""
        self._manager.close()
        self._state_reader.close()

    def wait(self) -> None:
        """Waits for the background write (if any) to be complete; raises what failed in it."""
        self._manager.wait_until_finished()
        self._manager.check_for_errors()

    def writing(self) -> bool:
        """Whether a checkpoint is being written in the background (safe from any thread)."""
        return self._manager.is_saving_in_progress()

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint kept, oldest first."""
        return list(self._manager.all_steps())

    def save(self, state: PipelineState, extra: dict[str, Any] | None = None) -> None:
        """Saves `state` (and the JSON-able `extra`) as checkpoint number `state.step`:
        waits for the previous write, copies the arrays to host memory and returns (`state`
        may then be donated); the files are written in the background.
        """
        meta = {
            "format": FORMAT,
            "dgrad": dgrad.__version__,
            "step": state.step,
            "num_stages": len(state.stages),
            "extra": extra or {},
        }
        # orbax's barriers are collectives: the transfers of `share` land first, so that
        # no process waits inside a barrier for one.
        shared = jax.block_until_ready(placement.share(stored(state)))
        self._manager.save(
            state.step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(shared), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """What checkpoint `step` (default the newest) holds beside its arrays: `format`,
        `dgrad` (the version that wrote it), `step`, `num_stages` and `extra`.
        """
        self.wait()
        return dict(self._meta_reader.restore(self._step_path(self._require(step)) / "meta"))

    def extra(self, step: int | None = None) -> dict[str, Any]:
        """The `extra` saved with checkpoint `step` (default the newest)."""
        return self.meta(step)["extra"]

    def restore(
        self,
        pipe,
        step: int | None = None,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[PipelineState, dict[str, Any]]:
        """Checkpoint `step` (default the newest) as a state of the initialised `pipe`,
        placed on its devices, and its `extra`. `check(meta)` may refuse it (by raising)
        before any array is read. Raises `OtherFormat` or `Unrestorable`; under several
        processes, on every process if it failed on any.
        """
        self.wait()
        step = self._require(step)
        meta, failure = None, None
        try:
            meta = self.meta(step)
        except Exception as error:  # (its JSON damaged or missing)
            failure = f"its meta: {_one_line(error)}"
        if meta is not None and meta.get("format", 1) != FORMAT:
            raise OtherFormat(step, self.directory, meta)  # (all processes alike)
        if meta is not None and check is not None:
            check(meta)  # (every process reads the same file: all refuse alike)
        if failure is None:
            _ignore_reads_left_behind()
            try:
                restored = self._read_state(step, stored(self._target(pipe, meta)))
            except Exception as error:  # damaged arrays, or a state of another structure
                failure = _one_line(error)
        failure = _first_failure(failure)
        if failure is not None:
            raise Unrestorable(step, self.directory, failure)
        return pipe.recompute_records(restored), meta["extra"]

    def _target(self, pipe, meta: dict[str, Any]) -> PipelineState:
        """The abstract state of `pipe` after `meta['step']` steps; a ValueError for another K."""
        if meta["num_stages"] != pipe.num_stages:
            raise ValueError(
                f"it holds {meta['num_stages']} stages but this pipeline has "
                f"{pipe.num_stages}; resume with the same number of stages."
            )
        return pipe.state_structure(meta["step"])

    def _read_state(self, step: int, target: PipelineState) -> PipelineState:
        """This process' part of checkpoint `step`'s state, placed as `target`."""
        path = self._step_path(step) / "state"
        saved = self._state_reader.metadata(path).tree
        _check_parameters(saved, target)
        stored = jax.tree.map(placement.shared_target, target)
        _check_structure(stored, saved)
        restored = self._state_reader.restore(path, args=ocp.args.StandardRestore(stored))
        return placement.unshare(restored, target)

    def set_aside(self, step: int) -> str:
        """Moves checkpoint `step` (one that does not restore) into `damaged/` beside the
        others, out of orbax's sight and of the way of later saves; returns where it went.
        """
        self.wait()
        self._require(step)
        where = None
        if jax.process_index() == 0:
            folder = os.path.join(self.directory, DAMAGED)
            where = os.path.join(folder, str(step))
            for again in itertools.count(2):  # (the same step set aside before)
                if not os.path.exists(where):
                    break
                where = os.path.join(folder, f"{step}-{again}")
            os.makedirs(folder, exist_ok=True)
            os.rename(self._step_path(step), where)
        where = distributed.told_by_process_0("checkpoint set aside", where)  # (waits for it)
        self._manager.reload()
        return where

    def _step_path(self, step: int) -> epath.Path:
        return epath.Path(self.directory) / str(step)

    def _require(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(
                f"No complete checkpoint{'' if step is None else f' for step {step}'} in "
                f"{self.directory} (found steps {self.all_steps()})."
            )
        return step


def stored(state: PipelineState) -> PipelineState:
    """`state` as a checkpoint holds it: each record of a VJP that keeps its source
    replaced by that source, which `restore` forwards again
    (`dgrad.Pipeline.recompute_records`). Works alike on arrays and on their shapes.

    >>> import jax.numpy as jnp, optax
    >>> import dgrad
    >>> from dgrad import models
    >>> pipe = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), method="fdg",
    ...                       record_sources=True, optimizer=optax.sgd(0.1))
    >>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
    >>> state, _ = pipe.step(pipe.init(batch), batch)
    >>> type(state.stages[0].kept[0]).__name__, type(stored(state).stages[0].kept[0]).__name__
    ('Residuals', 'StashedInputs')
    """

    def held(record):  # (by attribute: dgrad.stage imports flax, which this module does not)
        source = getattr(record, "source", None)
        return record if source is None else source

    return state.replace(
        stages=tuple(s.replace(kept=tuple(map(held, s.kept))) for s in state.stages)
    )


def _one_line(error: BaseException, limit: int = 300) -> str:
    """`error`'s message on one line, without tensorstore's spec, shortened to about
    `limit` characters (its head and its tail), after its type unless a plain ValueError.
    """
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = text.split(" [tensorstore_spec=")[0]
    if len(text) > limit:  # the head names the error, the tail its cause
        text = f"{text[: limit // 2 - 3]} ... {text[-(limit // 2) :]}"
    if type(error) is ValueError and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _ignore_reads_left_behind() -> None:
    """Keeps quiet the reads a failed restore leaves in flight: each raises
    `RuntimeError('Event loop is closed')` in tensorstore's thread once orbax closed its
    loop, which Python would print as a traceback. Only that error is dropped.
    """
    if getattr(sys.unraisablehook, "__name__", "") == "ignoring_reads_left_behind":
        return
    previous = sys.unraisablehook

    def ignoring_reads_left_behind(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = ignoring_reads_left_behind


_RESTORES = itertools.count()  # calls so far; every process makes them in the same order


def _first_failure(failure: str | None, timeout_s: float = 3600.0) -> str | None:
    """The failure of the lowest process whose part failed (None: none did), the same on
    every process, told through the `jax.distributed` key-value store.
    """
    if jax.process_count() == 1:
        return failure
    from jax._src import distributed

    client, key = distributed.global_state.client, f"dgrad/restore/{next(_RESTORES)}"
    client.key_value_set(f"{key}/{jax.process_index()}", "" if failure is None else f"!{failure}")
    for process in range(jax.process_count()):
        said = client.blocking_key_value_get(f"{key}/{process}", int(timeout_s * 1000))
        if said:
            return f"on process {process}, {said[1:]}"
    return None


def _check_parameters(saved, target: PipelineState) -> None:
    """Stage parameters in the `saved` tree must match the pipeline's (a clear error)."""
    for k, stage in enumerate(target.stages):
        expected = [tuple(a.shape) for a in jax.tree.leaves(stage.params)]
        found = [tuple(np.shape(a)) for a in jax.tree.leaves(saved["stages"][k]["params"])]
        if found != expected:
            raise ValueError(
                f"Stage {k}'s parameters in the checkpoint ({len(found)} arrays) do not match "
                f"this pipeline's ({len(expected)} arrays, or other shapes): the checkpoint "
                "is of another model or split. Resume with the configuration it was written "
                "with."
            )


def _path(keys) -> tuple[str, ...]:
    """A key path as orbax names it: every key a string."""
    return tuple(
        str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in keys
    )


def _check_structure(stored, saved) -> None:
    """The `saved` metadata tree must hold the arrays of `stored` (the target), no more and
    no fewer; a ValueError in one line says which differs."""
    wanted = {_path(keys) for keys, _ in jax.tree_util.tree_flatten_with_path(stored)[0]}
    held = {_path(keys) for keys, _ in jax.tree_util.tree_flatten_with_path(saved)[0]}
    if held - wanted:
        raise _mismatch(min(held - wanted), "holds")
    missing = wanted - held
    if any(map(_is_stashed_weight, missing)):
        raise ValueError(
            "This pipeline keeps the weights of each kept batch's forward, but the "
            "checkpoint's records hold none (it was saved with another weights policy, "
            "probe_every, record_sources or optimizer): resume with the options the run was "
            "saved with."
        )
    if missing:
        raise _mismatch(min(missing), "lacks")


def _mismatch(path, holds_or_lacks: str) -> ValueError:
    """The one line for a checkpoint that `holds_or_lacks` an array at `path`."""
    return ValueError(
        f"The checkpoint {holds_or_lacks} {'/'.join(path)} "
        f"{'beyond' if holds_or_lacks == 'holds' else 'of'} this pipeline's state: it was "
        "saved with other pipeline options (method, optimizer, predict, weights, memory, "
        "accumulate, microbatches, probe_every or record_sources). Resume with the options it "
        "was written with."
    )


def _is_stashed_weight(path) -> bool:
    """Whether `path` is inside a kept record's stashed weights."""
    match path:
        case ("stages", _stage, "kept", _record, "params", _, *_):
            return True
    return False
