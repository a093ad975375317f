"""Checkpoints of a whole pipeline state, including what is in flight, with orbax.

A `PipelineState` between two steps holds more than weights: each stage's
optimizer state, the records kept for delayed backwards (stashed weights,
residuals or inputs) and the activations and cotangents travelling between
stages. `Checkpointer` saves all of it, so that a resumed run continues
bit for bit. The arrays go to an orbax checkpoint, flattened under names
like `stage1.pending0.params.00003`; which batch each record and message
belongs to (host integers) goes beside them as JSON. Each save is atomic:
orbax writes into a temporary directory and renames it when complete, so a
run killed while saving resumes from the last complete checkpoint.

Restoring needs a freshly initialised state of the same pipeline (its
parameter and optimizer-state structure) and places every array on the
device of its stage in *that* pipeline, so a run may resume on a different
device layout with the same number of stages.

>>> import tempfile, jax, jax.numpy as jnp, optax
>>> import dgrad
>>> from dgrad import models
>>> stages = models.mlp([4, 8, 3], num_stages=2)
>>> pipe = dgrad.Pipeline(stages, method="fdg", optimizer=optax.sgd(0.1))
>>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
>>> state, _ = pipe.step(pipe.init(batch), batch)
>>> with Checkpointer(tempfile.mkdtemp()) as checkpoints:
...     checkpoints.save(state, {"note": "after one step"})
...     restored, extra = checkpoints.restore(pipe, pipe.init(batch))
>>> restored.step, restored.activations[1].batch, extra["note"]
(1, 0, 'after one step')
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from dgrad.pipeline import Message, Pending, PipelineState, StageState

_RECORD_FIELDS = ("residuals", "inputs", "params", "rest")
_PART_FORMAT = "{:05d}"


def flatten_state(state: PipelineState) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """The state's arrays under flat names, and its layout (JSON) to rebuild it.

    >>> import jax.numpy as jnp
    >>> state = PipelineState(3, (), (None,), (None,), jnp.array(True))
    >>> arrays, layout = flatten_state(state)
    >>> list(arrays), layout["step"], layout["activations"]
    (['finite'], 3, [None])
    """
    arrays: dict[str, jax.Array] = {"finite": state.finite}

    def put(prefix, tree):
        for i, leaf in enumerate(jax.tree.leaves(tree)):
            arrays[f"{prefix}.{_PART_FORMAT.format(i)}"] = leaf

    layout: dict[str, Any] = {"step": state.step, "stages": []}
    for k, stage in enumerate(state.stages):
        for field in ("params", "rest", "opt_state"):
            put(f"stage{k}.{field}", getattr(stage, field))
        records = []
        for j, record in enumerate(stage.pending):
            present = [f for f in _RECORD_FIELDS if getattr(record, f) is not None]
            for field in present:
                put(f"stage{k}.pending{j}.{field}", getattr(record, field))
            records.append({"batch": record.batch, "fields": present})
        layout["stages"].append({"pending": records})
    for kind in ("activations", "cotangents"):
        messages = []
        for k, message in enumerate(getattr(state, kind)):
            if message is None:
                messages.append(None)
                continue
            for field in ("value", "labels"):
                value = getattr(message, field)
                if value is None:
                    continue
                if not isinstance(value, jax.Array):
                    raise TypeError(
                        f"Checkpoints support stages that exchange single arrays; the {field} "
                        f"of {kind}[{k}] is a {type(value).__name__}."
                    )
                arrays[f"{kind}{k}.{field}"] = value
            messages.append({"batch": message.batch, "labels": message.labels is not None})
        layout[kind] = messages
    return arrays, layout


def unflatten_state(
    template: PipelineState, arrays: dict[str, jax.Array], layout: dict[str, Any]
) -> PipelineState:
    """Rebuilds a state from `flatten_state`'s output; `template` gives the tree structures."""
    _check_num_stages(layout, len(template.stages))

    def take(prefix, treedef=None):
        names = sorted(n for n in arrays if n.startswith(prefix + "."))
        leaves = [arrays[n] for n in names]
        return leaves if treedef is None else jax.tree.unflatten(treedef, leaves)

    stages = []
    for k, (entry, like) in enumerate(zip(layout["stages"], template.stages)):
        structure = {
            f: jax.tree.structure(getattr(like, f)) for f in ("params", "rest", "opt_state")
        }
        pending = []
        for j, record in enumerate(entry["pending"]):
            fields = {}
            for field in record["fields"]:
                prefix = f"stage{k}.pending{j}.{field}"
                if field == "residuals":
                    fields[field] = take(prefix)
                elif field == "inputs":
                    (fields[field],) = take(prefix)
                else:
                    fields[field] = take(prefix, structure[field])
            pending.append(Pending(record["batch"], **fields))
        stages.append(
            StageState(
                *(take(f"stage{k}.{f}", structure[f]) for f in ("params", "rest", "opt_state")),
                pending=tuple(pending),
            )
        )
    messages = {}
    for kind in ("activations", "cotangents"):
        messages[kind] = tuple(
            None
            if entry is None
            else Message(
                entry["batch"],
                arrays[f"{kind}{k}.value"],
                arrays[f"{kind}{k}.labels"] if entry["labels"] else None,
            )
            for k, entry in enumerate(layout[kind])
        )
    return PipelineState(
        layout["step"],
        tuple(stages),
        messages["activations"],
        messages["cotangents"],
        arrays["finite"],
    )


def _check_num_stages(layout: dict[str, Any], num_stages: int) -> None:
    if len(layout["stages"]) != num_stages:
        raise ValueError(
            f"The checkpoint holds {len(layout['stages'])} stages but this pipeline has "
            f"{num_stages}; resume with the same number of stages."
        )


def _stage_of(name: str, num_stages: int) -> int:
    """The stage whose device holds array `name` (`finite` lives with the last stage)."""
    head = name.split(".", 1)[0]
    for prefix in ("stage", "activations", "cotangents"):
        if head.startswith(prefix):
            return int(head[len(prefix) :])
    return num_stages - 1


class Checkpointer:
    """Saves and restores pipeline states in `directory`, keeping the newest `keep`.

    Args:
      directory: where the numbered checkpoints go (created if missing).
      keep: how many of the newest checkpoints to keep.
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
        self._manager.close()

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, state: PipelineState, extra: dict[str, Any] | None = None) -> None:
        """Saves `state` (and the JSON-able `extra`) as checkpoint number `state.step`."""
        arrays, layout = flatten_state(state)
        meta = {"layout": layout, "extra": extra or {}}
        self._manager.save(
            state.step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def extra(self, step: int | None = None) -> dict[str, Any]:
        """The `extra` saved with checkpoint `step` (default the newest), without its arrays."""
        return self._meta(self._require(step))["extra"]

    def _meta(self, step: int) -> dict[str, Any]:
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def restore(
        self, pipe, template: PipelineState, step: int | None = None
    ) -> tuple[PipelineState, dict[str, Any]]:
        """Checkpoint `step` (default the newest) as a state of `pipe`, and its `extra`.

        `template` is `pipe.init(example_batch)`: its structure is reused, and
        every array goes to the device `pipe` places its stage on.
        """
        step = self._require(step)
        meta = self._meta(step)
        _check_num_stages(meta["layout"], pipe.num_stages)  # before the shapes, to say why
        metadata = self._manager.item_metadata(step)["state"].tree
        _check_shapes(template, metadata)
        abstract = {
            name: jax.ShapeDtypeStruct(
                tuple(info.shape),
                info.dtype,
                sharding=jax.sharding.SingleDeviceSharding(
                    pipe.devices[_stage_of(name, pipe.num_stages)]
                ),
            )
            for name, info in metadata.items()
        }
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )
        return unflatten_state(template, dict(restored["state"]), meta["layout"]), meta["extra"]

    def _require(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(
                f"No complete checkpoint{'' if step is None else f' for step {step}'} in "
                f"{self.directory} (found steps {self.all_steps()})."
            )
        return step


def _check_shapes(template: PipelineState, metadata) -> None:
    """Stage parameters in the checkpoint must match the pipeline's (a clear error, not orbax's)."""
    for k, stage in enumerate(template.stages):
        expected = [np.shape(a) for a in jax.tree.leaves(stage.params)]
        prefix = f"stage{k}.params."
        found = [tuple(metadata[n].shape) for n in sorted(metadata) if n.startswith(prefix)]
        if found != [tuple(s) for s in expected]:
            raise ValueError(
                f"Stage {k}'s parameters in the checkpoint ({len(found)} arrays) do not match "
                f"this pipeline's ({len(expected)} arrays, or other shapes): the checkpoint is "
                "of another model or split. Resume with the configuration it was written with."
            )
