"""What a pipeline carries between steps, and its shapes from the timetable alone.

A `PipelineState` holds each stage's `StageState` (parameters, non-parameter
state, optimizer state and the records it keeps for delayed backwards) and
the `Message`s in flight between stages. `structure` gives the state after
any step as `jax.ShapeDtypeStruct`s with their shardings, without running a
step: what is in flight follows from the `Schedule` and the stages' shapes,
which `stage_specs` finds by tracing each stage once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from dgrad.options import SPLIT_BACKWARD
from dgrad.placement import Placement
from dgrad.schedule import Schedule, Unit
from dgrad.stage import Given, Record, Residuals, StageFunctions, Vars


@struct.dataclass
class StageState:
    """One stage's state: weights, statistics, optimizer state, the records it keeps
    (`kept[i]` for the forward of unit `kept_batches[i]`, oldest first), and, where the
    timetable keeps two weight versions (PipeDream-2BW), the weights of the one before and
    the sum of the gradients of the batch whose backwards go on in the next step.

    >>> import jax, jax.numpy as jnp
    >>> stage = StageState(params={"w": jnp.ones(2)}, rest={}, opt_state=())
    >>> stage.kept, stage.kept_batches, jax.tree.leaves(stage)  # a pytree of its arrays
    ((), (), [Array([1., 1.], dtype=float32)])
    """

    params: Any
    rest: Any
    opt_state: Any
    kept: tuple[Record, ...] = ()
    kept_batches: tuple[Unit, ...] = struct.field(pytree_node=False, default=())
    previous: Any = None
    gradient_sum: Any = None

    def keep(self, record: Record, batch: int) -> StageState:
        """This state with `record`, of the forward of `batch`, kept as the newest.

        >>> import jax.numpy as jnp
        >>> from dgrad.stage import Inputs
        >>> stage = StageState(params={"w": jnp.ones(2)}, rest={}, opt_state=())
        >>> stage.keep(Inputs(jnp.ones(3)), 5).keep(Inputs(jnp.zeros(3)), 6).kept_batches
        (5, 6)
        """
        return self.replace(kept=self.kept + (record,), kept_batches=self.kept_batches + (batch,))

    def take(self, unit: Unit, stage: int = 0) -> tuple[Record, StageState]:
        """The record of `unit`'s forward, and this state without it (for its backward);
        `stage` only names the stage if the record is missing.

        >>> import jax.numpy as jnp
        >>> from dgrad.stage import Inputs
        >>> stage = StageState(params={"w": jnp.ones(2)}, rest={}, opt_state=())
        >>> stage = stage.keep(Inputs(jnp.ones(3)), 5).keep(Inputs(jnp.zeros(3)), 6)
        >>> record, rest = stage.take(6)
        >>> record.inputs, rest.kept_batches
        (Array([0., 0., 0.], dtype=float32), (5,))
        """
        if unit not in self.kept_batches:
            raise AssertionError(
                f"stage {stage} holds the records of {self.kept_batches} but is asked to "
                f"back-propagate {unit}; the pipeline state is corrupt"
            )
        i = self.kept_batches.index(unit)
        return self.kept[i], self.replace(
            kept=self.kept[:i] + self.kept[i + 1 :],
            kept_batches=self.kept_batches[:i] + self.kept_batches[i + 1 :],
        )


@struct.dataclass
class Message:
    """An activation (with its labels) or a cotangent of `batch` in flight.

    >>> import jax, jax.numpy as jnp
    >>> message = Message(3, jnp.ones((2, 4)), jnp.array([0, 1]))  # batch 3's activation
    >>> message.batch, [leaf.shape for leaf in jax.tree.leaves(message)]  # batch: not a leaf
    (3, [(2, 4), (2,)])
    >>> Message(4, jnp.ones(2)).labels  # a cotangent carries no labels
    """

    batch: Unit = struct.field(pytree_node=False)
    value: Any
    labels: Any = None


@struct.dataclass
class PipelineState:
    """Everything a pipeline carries from one step to the next.

    Attributes:
      step: how many batches `step` has consumed.
      stages: one `StageState` per stage, on its devices.
      activations: `activations[k]` is the input waiting for stage k (FDG).
      cotangents: `cotangents[k]` is the cotangent waiting for stage k.
      finite: False once any loss was NaN or infinite (see `Pipeline.check_finite`).
      recent: with `probe_every`, the batches whose gradients some stage has still to
        apply (the probe recomputes their gradients at the current weights).

    After one FDG step of two stages, stage 0 keeps the record of batch 0 for
    its delayed backward, and batch 0's activation waits for stage 1, as the
    schedule says:

    >>> import jax.numpy as jnp, optax
    >>> from dgrad import Pipeline, models
    >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
    >>> batch = (jnp.ones((4, 4)), jnp.zeros((4,), jnp.int32))
    >>> state, _ = pipe.step(pipe.init(batch), batch)
    >>> state.step, state.stages[0].kept_batches, state.activations[1].batch
    (1, (0,), 0)
    >>> pipe.schedule.kept_batches(0, state.step), pipe.schedule.activation_batch(1, state.step)
    ([0], 0)
    """

    step: int = struct.field(pytree_node=False)
    stages: tuple[StageState, ...]
    activations: tuple[Message | None, ...]
    cotangents: tuple[Message | None, ...]
    finite: jax.Array
    recent: tuple[Message, ...] = ()


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """Shapes of what stage k receives, sends and keeps (global shapes, whole batch).

    >>> import jax, jax.numpy as jnp, optax
    >>> from dgrad import models, losses
    >>> stages = [StageFunctions(m, optax.sgd(0.1), first=k == 0,
    ...                          loss_fn=losses.softmax_cross_entropy if k == 1 else None)
    ...           for k, m in enumerate(models.mlp([4, 8, 3], num_stages=2))]
    >>> batch = (jax.ShapeDtypeStruct((5, 4), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.int32))
    >>> first, last = stage_specs(stages, *batch)
    >>> first.outputs.shape, type(first.record).__name__, last.outputs, last.record
    ((5, 8), 'Residuals', None, None)
    """

    inputs: jax.ShapeDtypeStruct
    outputs: jax.ShapeDtypeStruct | None  # None for the last stage
    record: Record | None  # of ShapeDtypeStructs; None for the last stage
    residual_layout: Any = None  # see StageFunctions.residual_layout


def stage_specs(stages: Sequence[StageFunctions], inputs, labels) -> list[StageSpec]:
    """Each stage's `StageSpec` for batches of `inputs` and `labels` (shapes), by tracing
    every stage once; a stage that cannot take what its predecessor sends is named.

    >>> import jax, jax.numpy as jnp, optax
    >>> from dgrad import models, losses
    >>> stages = [StageFunctions(m, optax.sgd(0.1), first=k == 0,
    ...                          loss_fn=losses.softmax_cross_entropy if k == 1 else None)
    ...           for k, m in enumerate(models.mlp([4, 8, 3], num_stages=2))]
    >>> batch = (jax.ShapeDtypeStruct((5, 4), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.int32))
    >>> [spec.inputs.shape for spec in stage_specs(stages, *batch)]
    [(5, 4), (5, 8)]
    """
    specs, shape, last = [], inputs, len(stages) - 1
    for k, fns in enumerate(stages):
        source = "the batch" if k == 0 else f"stage {k - 1}"
        try:
            if k == last:
                given = Given(params=fns.params, rest=fns.rest, x=shape, labels=labels)
                jax.eval_shape(fns.compile().loss_gradient, Vars(), given)
                layout = None
                if fns.options.method in SPLIT_BACKWARD and k > 0:  # its W: the loss's VJP
                    layout = fns.loss_residual_layout(fns.params, fns.rest, shape, labels)
                specs.append(StageSpec(shape, None, None, layout))
            else:
                opt_state = jax.eval_shape(fns.optimizer.init, fns.params)
                outputs, _, record = jax.eval_shape(
                    fns.forward_record, fns.params, fns.rest, opt_state, shape
                )
                layout = None
                if isinstance(record, Residuals):
                    layout = fns.residual_layout(fns.params, fns.rest, shape)
                specs.append(StageSpec(shape, outputs, record, layout))
                shape = outputs
        except Exception as error:  # noqa: BLE001 -- re-raised with the stage named
            raise ValueError(
                f"Stage {k} of {len(stages)} cannot take input of shape {shape.shape} "
                f"and dtype {shape.dtype} (from {source}); check where the model was split. "
                f"Error: {error}"
            ) from error
    return specs


def _abstract(tree, sharding):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s placed by `sharding`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def structure(
    step: int,
    *,
    schedule: Schedule,
    placement: Placement,
    stages: Sequence[StageFunctions],
    specs: Sequence[StageSpec],
    labels: jax.ShapeDtypeStruct,
    recent: int = 0,
) -> PipelineState:
    """The state after `step` steps as `jax.ShapeDtypeStruct`s with their shardings
    (`recent`: how many past batches the state keeps for the probe).

    >>> import jax, optax
    >>> from dgrad import Pipeline, models
    >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="fdg",
    ...                 optimizer=optax.sgd(0.1))
    >>> state = pipe.init((jax.numpy.ones((4, 4)), jax.numpy.zeros(4, int)))
    >>> shapes = pipe.state_structure(3)  # calls this function
    >>> shapes.stages[0].kept_batches, shapes.activations[1].value.shape
    ((1, 2), (4, 8))
    """
    on, last = _abstract, len(stages) - 1
    in_flight = schedule.in_flight(step)
    stage_states = []
    for k, (fns, spec) in enumerate(zip(stages, specs)):
        replicated = placement.replicated(k)
        params, rest = on(fns.params, replicated), on(fns.rest, replicated)
        opt_state = on(jax.eval_shape(fns.optimizer.init, fns.params), replicated)
        previous = params if schedule.keeps_previous_weights else None
        gradient_sum = None if in_flight.summing[k] is None else params
        stage = StageState(params, rest, opt_state, previous=previous, gradient_sum=gradient_sum)
        for unit in in_flight.kept[k]:
            stage = stage.keep(_record_structure(placement, k, fns, spec, opt_state), unit)
        stage_states.append(stage)
    activations, cotangents = [], []
    for k, spec in enumerate(specs):
        sharded = placement.sharded(k)
        unit = in_flight.activations[k]
        activations.append(
            None
            if unit is None
            else Message(unit, on(specs[k - 1].outputs, sharded), on(labels, sharded))
        )
        unit = in_flight.cotangents[k]
        cotangents.append(None if unit is None else Message(unit, on(spec.outputs, sharded)))
    finite = on(jax.ShapeDtypeStruct((), jnp.bool_), placement.replicated(last))
    sharded = placement.sharded(0)
    recent_batches = tuple(
        Message(b, on(specs[0].inputs, sharded), on(labels, sharded))
        for b in range(max(0, step - recent), step)
    )
    return PipelineState(
        step, tuple(stage_states), tuple(activations), tuple(cotangents), finite, recent_batches
    )


def _record_structure(placement, k: int, fns: StageFunctions, spec: StageSpec, opt_state):
    """Stage k's record, with the shardings its forward gives the arrays it keeps."""
    replicated, sharded = placement.replicated(k), placement.sharded(k)
    if placement.data_parallel == 1:  # one device: nothing to ask the compiler
        return _abstract(spec.record, replicated)
    given = Given(
        params=_abstract(fns.params, replicated),
        rest=_abstract(fns.rest, replicated),
        opt_state=fns.forward_reads(opt_state),
        x=_abstract(spec.inputs, sharded),
    )
    forward = fns.compile(spec.residual_layout).forward  # the function the pipeline runs
    compiled = forward.lower(Vars(), given).compile()
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        spec.record,
        compiled.output_shardings[1].record,
    )
