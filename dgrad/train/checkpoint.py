"""Checkpoints of a whole pipeline state, including what is in flight, with orbax.

A `PipelineState` between two steps holds more than weights: each stage's
optimizer state, the records kept for delayed backwards (stashed weights,
residuals or inputs) and the activations and cotangents travelling between
stages. `Checkpointer` saves the state pytree as it is, with a JSON item
beside it for the step and the caller's metadata, so that a resumed run
continues bit for bit. Which records and messages exist after step t follows
from the timetable alone (`Pipeline.state_structure`), so restoring needs no
saved layout: orbax reads every array straight onto the devices of its stage in
the restoring pipeline, whatever its device layout, number of replicas or
processes. Each save is atomic (orbax writes into a temporary directory and
renames it when complete), so a run killed while saving resumes from the last
complete checkpoint. Under several processes every process calls `save` and
`restore`; each writes and reads its own shards, and none may have a collective
in flight (a `dgrad.placement.share` not yet read, say) when it creates, saves or
restores: orbax's barriers are collectives, and one could pair with it.

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

import os
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from dgrad import placement

if TYPE_CHECKING:
    from dgrad.state import PipelineState


class Checkpointer:
    """Saves and restores pipeline states in `directory`, keeping the newest `keep`.

    Args:
      directory: where the numbered checkpoints go (created if missing).
      keep: how many of the newest checkpoints to keep.

    >>> import tempfile, jax.numpy as jnp, optax
    >>> import dgrad
    >>> from dgrad import models
    >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
    >>> state = pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32)))
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     with Checkpointer(directory, keep=2) as checkpoints:
    ...         for step in (1, 2, 3):
    ...             checkpoints.save(state.replace(step=step))
    ...         print(checkpoints.all_steps())  # the oldest is gone
    [2, 3]
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Waits for orbax's work on the directory to finish and releases it.

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     checkpoints = Checkpointer(directory)
        ...     checkpoints.close()  # what `with Checkpointer(...)` does on leaving
        """
        self._manager.close()

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None.

        >>> import tempfile, jax.numpy as jnp, optax
        >>> import dgrad
        >>> from dgrad import models
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32)))
        >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as checkpoints:
        ...     print(checkpoints.latest_step())
        ...     checkpoints.save(state.replace(step=7))
        ...     print(checkpoints.latest_step())
        None
        7
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint kept, oldest first.

        >>> import tempfile, jax.numpy as jnp, optax
        >>> import dgrad
        >>> from dgrad import models
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32)))
        >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as checkpoints:
        ...     checkpoints.save(state.replace(step=3))
        ...     checkpoints.save(state.replace(step=5))
        ...     print(checkpoints.all_steps())
        [3, 5]
        """
        return list(self._manager.all_steps())

    def save(self, state: PipelineState, extra: dict[str, Any] | None = None) -> None:
        """Saves `state` (and the JSON-able `extra`) as checkpoint number `state.step`.

        >>> import os, tempfile, jax.numpy as jnp, optax
        >>> import dgrad
        >>> from dgrad import models
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32)))
        >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as checkpoints:
        ...     checkpoints.save(state, {"epoch": 0})
        ...     print(os.listdir(directory), sorted(os.listdir(os.path.join(directory, "0"))))
        ['0'] [..., 'meta', 'state']
        """
        meta = {"step": state.step, "num_stages": len(state.stages), "extra": extra or {}}
        # orbax's barriers are collectives: the transfers of `share` land first, so that
        # no process waits inside a barrier for one.
        shared = jax.block_until_ready(placement.share(state))
        self._manager.save(
            state.step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(shared), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """What checkpoint `step` (default the newest) holds beside its arrays: its `step`,
        `num_stages` and the `extra` it was saved with. Reads one small file.

        >>> import tempfile, jax.numpy as jnp, optax
        >>> import dgrad
        >>> from dgrad import models
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32)))
        >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as checkpoints:
        ...     checkpoints.save(state.replace(step=4), {"epoch": 2})
        ...     print(checkpoints.meta())
        {'step': 4, 'num_stages': 1, 'extra': {'epoch': 2}}
        """
        step = self._require(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def extra(self, step: int | None = None) -> dict[str, Any]:
        """The `extra` saved with checkpoint `step` (default the newest).

        >>> import tempfile, jax.numpy as jnp, optax
        >>> import dgrad
        >>> from dgrad import models
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32)))
        >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as checkpoints:
        ...     checkpoints.save(state.replace(step=1), {"epoch": 0})
        ...     checkpoints.save(state.replace(step=2), {"epoch": 1})
        ...     print(checkpoints.extra(), checkpoints.extra(1))
        {'epoch': 1} {'epoch': 0}
        """
        return self.meta(step)["extra"]

    def restore(self, pipe, step: int | None = None) -> tuple[PipelineState, dict[str, Any]]:
        """Checkpoint `step` (default the newest) as a state of `pipe`, and its `extra`.

        `pipe` must be initialised (`pipe.init(example_batch)`); every array goes
        to the devices `pipe` places its stage on.

        >>> import tempfile, jax, jax.numpy as jnp, optax
        >>> import dgrad
        >>> from dgrad import models
        >>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> state = pipe.init(batch)
        >>> other = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> _ = other.init(batch)
        >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as checkpoints:
        ...     checkpoints.save(state, {"epoch": 0})
        ...     restored, extra = checkpoints.restore(pipe)
        ...     checkpoints.restore(other)
        Traceback (most recent call last):
            ...
        ValueError: The checkpoint holds 1 stages but this pipeline has 2; resume with the same ...
        >>> same = jax.tree.map(jnp.array_equal, restored.stages, state.stages)
        >>> extra, all(jax.tree.leaves(same))
        ({'epoch': 0}, True)
        """
        meta = self.meta(step)
        if meta["num_stages"] != pipe.num_stages:
            raise ValueError(
                f"The checkpoint holds {meta['num_stages']} stages but this pipeline has "
                f"{pipe.num_stages}; resume with the same number of stages."
            )
        target = pipe.state_structure(meta["step"])
        saved = self._manager.item_metadata(meta["step"])["state"].tree
        _check_parameters(saved, target)
        stored = jax.tree.map(placement.shared_target, target)
        as_saved, back = _as_saved(stored, saved)
        restored = self._manager.restore(
            meta["step"], args=ocp.args.Composite(state=ocp.args.StandardRestore(as_saved))
        )["state"]
        return placement.unshare(back(restored), target), meta["extra"]

    def _require(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(
                f"No complete checkpoint{'' if step is None else f' for step {step}'} in "
                f"{self.directory} (found steps {self.all_steps()})."
            )
        return step


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


def _as_saved(stored, saved):
    """`stored` (the target) in the shape of the `saved` metadata tree, and the function
    that maps what orbax restores in that shape back to `stored`'s.

    Two kinds of older checkpoints restore into today's state:
    - written while dgrad held weights as `nnx.Variable`s: each weight is one level
      deeper, under `value`;
    - written while every kept record stashed the weights of its forward: a record's
      `params` that the target does not keep (nothing reads them, see
      `dgrad.stage.Residuals`) are read like the stage's weights and dropped.
    """
    paths, treedef = jax.tree_util.tree_flatten_with_path(stored)
    wanted = {_path(keys): leaf for keys, leaf in paths}

    def target_of(path):  # the target's path that receives `path`'s array
        for candidate in (path, _weight_of_variable(path)):
            if candidate in wanted:
                return candidate
        return None

    owner, dropped = {}, {}  # saved path -> the target's path of that array
    for keys, _ in jax.tree_util.tree_flatten_with_path(saved)[0]:
        path = _path(keys)
        owner[path] = target_of(path)
        if owner[path] is None and _is_stashed_weight(path):
            _, stage, _, _, _, *weight = path  # stages/<k>/kept/<i>/params/<weight...>
            dropped[path] = target_of(("stages", stage, "params", *weight))
        if owner[path] is None and dropped.get(path) is None:
            raise _mismatch(path, "holds")
    missing = set(wanted) - set(owner.values())
    if any(map(_is_stashed_weight, missing)):
        raise ValueError(
            "This pipeline keeps the weights of each kept batch's forward, but the "
            "checkpoint's records hold none (it was saved with another weights policy, "
            "probe_every or optimizer): resume with the options the run was saved with."
        )
    if missing:
        raise _mismatch(min(missing), "lacks")
    if not dropped and all(path == own for path, own in owner.items()):
        return stored, lambda restored: restored  # today's layout
    as_saved = jax.tree_util.tree_map_with_path(
        lambda keys, _: wanted[owner[_path(keys)] or dropped[_path(keys)]], saved
    )
    saved_at = {own: path for path, own in owner.items() if own is not None}

    def back(restored):
        at = {_path(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]}
        return treedef.unflatten([at[saved_at[path]] for path in wanted])

    return as_saved, back


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
        "accumulate, microbatches or probe_every). Resume with the options it was written with."
    )


def _weight_of_variable(path) -> tuple[str, ...] | None:
    """The array's path if `path` is where an `nnx.Variable` held it (`stages/<k>/.../value`,
    in the weights, the statistics or the optimizer state), else None.

    >>> _weight_of_variable(("stages", "0", "params", "layers", "kernel", "value"))
    ('stages', '0', 'params', 'layers', 'kernel')
    >>> _weight_of_variable(("stages", "0", "params", "layers", "kernel")) is None
    True
    """
    match path:
        case ("stages", _stage, _, *weight, "value") if weight:
            return path[:-1]
    return None


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
