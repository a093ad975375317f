"""Checkpoints of a whole pipeline state, including what is in flight, with orbax.

A `PipelineState` between two steps holds more than weights: each stage's
optimizer state, the records kept for delayed backwards (stashed weights,
residuals or inputs) and the activations and cotangents travelling between
stages. `Checkpointer` saves the state pytree, with a JSON item beside it for
the step and the caller's metadata, so that a resumed run continues bit for
bit. A record of a forward's VJP that keeps its `source` (the pipeline option
`record_sources`: the forward's input, weights and statistics) is saved as
that source, and its VJP computed again on restore by the same forward: the
checkpoint holds what determines the run, about the size of the model and
the batches in flight, not every activation a VJP keeps. Which records and
messages exist after step t follows from the timetable alone
(`Pipeline.state_structure`), so restoring needs no saved layout: orbax reads
every array straight onto the devices of its stage in the restoring pipeline,
whatever its device layout, number of replicas or processes.

A save returns once orbax has copied the arrays to host memory (`np.asarray` of
each shard, blocking); the files are written in the background while training
goes on, and the next save, `wait`, `meta`, `restore`, `set_aside` and `close`
wait for that write. The copy keeps the saved arrays safe from the next step,
which donates the state's buffers: on GPU it is a copy, and on CPU, where it is
a view of the device buffer, XLA does not reuse a buffer that a view holds.
Each save is atomic: orbax writes into `<step>.orbax-checkpoint-tmp`, renames
it when complete and only then deletes the checkpoints beyond `keep`, so a run
killed while a checkpoint is written resumes from the last complete one (and
the same step saved again replaces the leftover). A checkpoint that does not
restore (a file of it damaged or missing, or a state of another structure)
raises `Unrestorable`, one line naming it and what failed; `set_aside` moves
it where orbax does not look. Every checkpoint names its format (`FORMAT`) in its
meta; one of another format raises `OtherFormat`, one line that says which
dgrad reads it.

Under several processes every process calls `save`, `restore` and `set_aside`;
each writes and reads its own shards, and none may have a collective in flight
(a `dgrad.placement.share` not yet read, say) when it creates or saves: the
barriers of `save` itself are collectives, and one could pair with it. The
background write's barriers go through the `jax.distributed` key-value store,
never the devices, so steps may run beside it; process 0 renames a checkpoint
into place only once every process has written its part, so all of them see
the same complete checkpoints. Restoring has no barrier: the processes tell
each other through the `jax.distributed` key-value store whether their part
restored, so that all of them succeed or fail together.

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
        """Waits for the checkpoint being written in the background (if any) to be complete;
        raises what failed in its write.
        """
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
        """Saves `state` (and the JSON-able `extra`) as checkpoint number `state.step`.

        Waits for the previous checkpoint's write, copies `state`'s arrays to host memory
        and returns; the files are written in the background (see `wait`). `state` may be
        donated to the next step as soon as it returns.
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
        """What checkpoint `step` (default the newest) holds beside its arrays: its `format`,
        the `dgrad` version that wrote it, its `step`, `num_stages` and the `extra` it was
        saved with. Reads one small file.
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
        """Checkpoint `step` (default the newest) as a state of `pipe`, and its `extra`.

        `pipe` must be initialised (`pipe.init(example_batch)`); every array goes
        to the devices `pipe` places its stage on. `check(meta)` may refuse the
        checkpoint (by raising) on its `meta` before any array is read. A checkpoint of
        another `FORMAT` raises `OtherFormat`; one that does not restore, `Unrestorable`;
        under several processes it does so on every process if it failed on any (each
        reads its own part).
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
        """The state of `pipe` after `meta["step"]` steps, as abstract arrays; a ValueError
        if the checkpoint holds another number of stages."""
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
        others, where orbax does not look: kept to be looked at, out of the way of the
        saves of a run that redoes its steps. Returns where it went.
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
    replaced by that source (`dgrad.stage.Residuals.source`), which `restore` forwards
    again (`dgrad.Pipeline.recompute_records`). Works alike on arrays and on their shapes.

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
    """`error`'s message on one line, without tensorstore's spec and shortened to about
    `limit` characters (its start and its end), after its type unless it is a plain
    ValueError (orbax's and dgrad's say what they are).

    >>> spec = " [tensorstore_spec='{...}']"
    >>> _one_line(ValueError("OUT_OF_RANGE: Requested byte range [0, 924) is not valid" + spec))
    'OUT_OF_RANGE: Requested byte range [0, 924) is not valid'
    >>> import json
    >>> try:
    ...     json.loads("{not json")
    ... except ValueError as error:
    ...     print(_one_line(error))
    JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)
    >>> _one_line(ValueError("NOT_FOUND: Error reading " + "a/" * 200 + "d/4f1c"), limit=40)
    'NOT_FOUND: Error  ... a/a/a/a/a/a/a/d/4f1c'
    """
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = text.split(" [tensorstore_spec=")[0]
    if len(text) > limit:  # the head names the error, the tail its cause
        text = f"{text[: limit // 2 - 3]} ... {text[-(limit // 2) :]}"
    if type(error) is ValueError and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _ignore_reads_left_behind() -> None:
    """Keeps quiet the reads that a failed restore leaves in flight: orbax closes its event
    loop at the first failure, and each read that ends later (even before the failure
    reaches `restore`) raises `RuntimeError('Event loop is closed')` in tensorstore's
    thread, which Python prints as a traceback. Only that error is dropped.

    >>> _ignore_reads_left_behind()
    >>> sys.unraisablehook.__name__
    'ignoring_reads_left_behind'
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
    """The failure of the lowest process whose part failed (None: every part restored),
    the same on every process, which waits for all of them to say (through the
    `jax.distributed` key-value store, as `dgrad.train.distributed.StopVote`).

    >>> _first_failure("its meta: JSONDecodeError"), _first_failure(None)  # one process
    ('its meta: JSONDecodeError', None)
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
    """The one line for a checkpoint that `holds_or_lacks` an array at `path` of this
    pipeline's state: it was written with other options.

    >>> print(_mismatch(("stages", "0", "opt_state", "0", "mu"), "lacks"))
    The checkpoint lacks stages/0/opt_state/0/mu of this pipeline's state: it was saved ...
    """
    return ValueError(
        f"The checkpoint {holds_or_lacks} {'/'.join(path)} "
        f"{'beyond' if holds_or_lacks == 'holds' else 'of'} this pipeline's state: it was "
        "saved with other pipeline options (method, optimizer, predict, weights, memory, "
        "accumulate, microbatches, probe_every or record_sources). Resume with the options it "
        "was written with."
    )


def _is_stashed_weight(path) -> bool:
    """Whether `path` is inside the weights a stage's kept record stashed
    (`stages/<k>/kept/<i>/params/...`).

    >>> _is_stashed_weight(("stages", "0", "kept", "1", "params", "layers", "kernel"))
    True
    >>> _is_stashed_weight(("stages", "0", "params", "layers", "kernel"))
    False
    """
    match path:
        case ("stages", _stage, "kept", _record, "params", _, *_):
            return True
    return False
