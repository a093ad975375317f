"""The pipeline engine: every method's timetable carried out over stages placed on
device groups.

A `Pipeline` holds the compiled per-stage functions and describes the
timetable; a `PipelineState` holds everything that changes: each stage's
parameters, non-parameter state and optimizer state, the records each stage
keeps for its delayed backwards, and the activations and cotangents in flight
between stages. `step` is a pure state transition that only dispatches work:
every value stays on its devices and nothing waits for the host. Where values
live and how they move is the `Placement`'s business.

>>> import jax, jax.numpy as jnp, optax
>>> from dgrad import models
>>> stages = models.mlp([4, 16, 3], num_stages=2, rngs=jax.random.key(0))
>>> pipe = Pipeline(stages, method="fdg", beta=0.5, optimizer=optax.sgd(0.1))
>>> batch = (jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
>>> state = pipe.init(batch)
>>> for _ in range(3):
...     state, metrics = pipe.step(state, batch)
>>> sorted(metrics), metrics["batch"]
(['accuracy', 'batch', 'loss'], 1)
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dgrad import losses
from dgrad.optim import accumulate, shrink
from dgrad.optim.per_stage import Optimizer, for_stage
from dgrad.optim.prediction import momentum_of, remember_update
from dgrad.options import MICROBATCHED, Options
from dgrad.placement import Placement, share
from dgrad.probe import Probe
from dgrad.schedule import (
    KINDS,
    Apply,
    Backward,
    BackwardForward,
    Forward,
    Fused,
    InputGradient,
    LocalLoss,
    Loss,
    LossInput,
    Schedule,
    Unit,
    WeightGradient,
)
from dgrad.stage import (
    Calls,
    Given,
    LossFn,
    Residuals,
    StageFunctions,
    StashedInputs,
    Vars,
    shape_dtype,
)
from dgrad.state import Message, PipelineState, StageState, stage_specs, structure


class _Work:
    """What one step's calls change as they run: the stages' states, the messages
    waiting for a stage (keyed by (stage, unit)), each stage's sum of gradients before
    its `Apply`, and the metrics of the units the last stage took its loss on."""

    def __init__(self, stages: list[StageState], finite):
        self.stages = [s.replace(gradient_sum=None) for s in stages]
        self.finite = finite
        self.activations: dict[tuple[int, Unit], Message] = {}
        self.cotangents: dict[tuple[int, Unit], Message] = {}
        self.gradients = {
            k: s.gradient_sum for k, s in enumerate(stages) if s.gradient_sum is not None
        }
        self.weights_due: dict[tuple[int, Unit], tuple] = {}  # zero-bubble: (record, cotangent)
        self.metric_sum, self.loss_count, self.loss_of = None, 0, None

    def metrics(self) -> dict[str, Any]:
        if self.metric_sum is None:
            return {}
        metrics = self.metric_sum
        if self.loss_count > 1:
            metrics = _mean(metrics, self.loss_count)
        return {**metrics, "batch": self.loss_of}


@functools.partial(jax.jit, static_argnums=1)
def _mean(sums, count: int):
    return jax.tree.map(lambda value: value / count, sums)


def _cut(inputs, labels, count: int):
    """Batch rows m*B/M to (m+1)*B/M for each microbatch m of M = `count`."""
    size = inputs.shape[0] // count
    return [
        (inputs[m * size : (m + 1) * size], labels[m * size : (m + 1) * size]) for m in range(count)
    ]


def _split_batch(batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"A batch must be a pair (inputs, labels), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            + "."
        )
    return batch[0], batch[1]


class Pipeline:
    """Trains a list of NNX stages with any of dgrad's methods on groups of devices.

    Args:
      stages: the model as a list of initialised `flax.nnx.Module`s; stage k's
        output is stage k+1's input, the last stage's output goes to `loss_fn`.
      optimizer: an optax transformation (each stage gets its own state) or a
        function from the stage index to one.
      options: the training options, a `dgrad.options.Options` (which says what each
        means; default `Options()`). Its fields may also be given as keywords
        (`method="ddg", beta=0.5`), which replace those of `options`.
      devices: which devices (default all); `placement` says how the stages and their
        `data_parallel` replicas map onto them, see `dgrad.placement.Placement`.
      loss_fn: `(outputs, labels) -> (mean loss, metrics)` for the last stage.

    >>> import jax.numpy as jnp, optax
    >>> from dgrad import models
    >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="fdg",
    ...                 optimizer=optax.sgd(0.1))
    >>> batch = (jnp.ones((4, 4)), jnp.array([0, 1, 2, 0]))
    >>> state = pipe.init(batch)
    >>> state, metrics = pipe.step(state, batch)
    >>> pipe.num_stages, state.step, metrics  # FDG fills: no batch reached the loss yet
    (2, 1, {})
    >>> state, metrics = pipe.step(state, batch)
    >>> metrics["batch"], sorted(metrics)
    (0, ['accuracy', 'batch', 'loss'])
    >>> pipe.predict(state, batch[0]).shape
    (4, 3)
    >>> from dgrad.options import Options  # the same options, as one object
    >>> Pipeline(models.mlp([4, 8, 3], num_stages=2), Options(method="fdg"),
    ...          optimizer=optax.sgd(0.1)).options == pipe.options
    True
    """

    def __init__(
        self,
        stages: Sequence[nnx.Module],
        options: Options | None = None,
        *,
        optimizer: Optimizer,
        devices: Sequence[jax.Device] | None = None,
        placement: str | Sequence = "spread",
        loss_fn: LossFn = losses.softmax_cross_entropy,
        **option_fields,
    ):
        if isinstance(stages, nnx.Module) or not isinstance(stages, Sequence) or not stages:
            raise TypeError(
                "stages must be a non-empty list of flax.nnx.Module stages (a single module "
                "is a one-stage pipeline: pass [module])."
            )
        self.options = options = Options.of(options, **option_fields)
        self.num_stages = len(stages)
        self.schedule = Schedule(
            options.method,
            self.num_stages,
            microbatches=options.microbatches,
            fused=options.fused,
            virtual_stages=options.virtual_stages,
        )
        _check_aux_heads(stages, self.schedule)
        self.placement = Placement(
            self.num_stages,
            devices,
            placement,
            data_parallel=options.data_parallel,
            fused=options.fused,
            virtual_stages=options.virtual_stages,
            group_of=self.schedule.device_of,
        )
        self.loss_fn = loss_fn
        last, locally = self.num_stages - 1, self.schedule.trains_locally
        self.stages = [
            StageFunctions(
                module,
                self._stage_optimizer(optimizer, k),
                options=options,
                first=not self.schedule.sends_cotangent(k),
                loss_fn=loss_fn if k == last or locally(k) else None,
                staleness=self.schedule.weight_staleness(k),
                replicated=self.placement.replicated(k),
                sharded=self.placement.sharded(k),
            )
            for k, module in enumerate(stages)
        ]
        self._calls: list[Calls] = []  # each stage's, compiled for its records by `init`
        self._watch = None  # see `observed`
        self._fused = jax.jit(self._fused_step, donate_argnums=(0, 1, 2))
        self._microbatches = jax.jit(
            functools.partial(_cut, count=options.microbatches),
            out_shardings=self.placement.sharded(0),
        )
        self._evaluation_sums = jax.jit(self._evaluation_sums_fn)
        self._probe = Probe(self.stages, loss_fn, self.placement, self.schedule)
        self.probe_window = self.schedule.longest_wait() if options.probe_every is not None else 0
        self._batch_shapes = None
        self.specs = None  # each stage's `dgrad.state.StageSpec`, once `init` has run

    def _stage_optimizer(self, optimizer: Optimizer, k: int) -> optax.GradientTransformation:
        tx = for_stage(optimizer, k)
        if self.options.shrinks:
            tx = optax.chain(shrink(self.options.beta, self.schedule.shrink_depth(k)), tx)
        every = self.options.accumulate
        if every > 1:
            tx = accumulate(tx, every, total=True)
        if self.options.predict == "update" and self.schedule.weight_staleness(k) > 0:
            tx = remember_update(tx)
        return tx

    @property
    def devices(self) -> list[jax.Device]:
        """The first device of each stage's group."""
        return self.placement.devices

    def __repr__(self):
        """The method and what sets its timetable, its options and its placement.

        >>> import jax, optax
        >>> from dgrad import models
        >>> Pipeline(models.mlp([4, 8, 8, 8, 3], num_stages=4), method="zb", microbatches=2,
        ...          virtual_stages=2, optimizer=optax.sgd(0.1), devices=jax.devices()[:1])
        Pipeline(method='zb', num_stages=4, microbatches=2, virtual_stages=2, beta=1.0, ...)
        """
        o = self.options
        split = f"microbatches={o.microbatches}, " if o.method in MICROBATCHED else ""
        if o.virtual_stages > 1:
            split += f"virtual_stages={o.virtual_stages}, "
        return (
            f"Pipeline(method={o.method!r}, num_stages={self.num_stages}, {split}beta={o.beta}, "
            f"weights={o.weights!r}, memory={o.memory!r}, {self.placement})"
        )

    def observed(self, wrap: Callable[[int, str, Callable], Callable]) -> Pipeline:
        """A view of this pipeline whose stage functions are `wrap(k, name, function)`.

        The functions are copies that donate no buffers, so a watcher may hold on
        to their inputs and outputs (see `dgrad.measure.timeline`). The view shares
        everything else with this pipeline and takes its states.

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> calls = []
        >>> def wrap(k, name, fn):
        ...     def watched(*args):
        ...         calls.append((k, name))
        ...         return fn(*args)
        ...     return watched
        >>> view = pipe.observed(wrap)
        >>> batch = (jnp.ones((4, 4)), jnp.array([0, 1, 2, 0]))
        >>> state, _ = view.step(view.init(batch), batch)
        >>> state, _ = view.step(state, batch)
        >>> calls  # FDG: stage 0's forward in each step, stage 1's loss step from the second
        [(0, 'forward'), (0, 'forward'), (1, 'loss_step')]
        """
        view = copy.copy(self)
        view._watch = wrap
        view._fused = wrap(0, "fused_step", jax.jit(self._fused_step))
        if self.specs is not None:
            view._calls = view._compile()
        return view

    # ------------------------------------------------------------------ init

    def init(self, example_batch) -> PipelineState:
        """Places each stage's state on its devices and checks that the stages fit together.

        `example_batch` is an `(inputs, labels)` pair; every later batch must have
        its shapes and dtypes.

        >>> import jax, jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((4, 4)), jnp.zeros((4,), jnp.int32)))
        >>> state.step, jax.tree.map(jnp.shape, state.stages[1].params)
        (0, {'layers': {0: {'linear': {'bias': (3,), 'kernel': (8, 3)}}}})
        >>> pipe.step(state, (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32)))
        Traceback (most recent call last):
            ...
        ValueError: This batch's (inputs, labels) are (float32[2, 4], int32[2]), but init saw ...
        """
        inputs, labels = _split_batch(example_batch)
        rows, count = np.shape(inputs)[0], len(self.schedule.units(0))
        replicas = self.placement.data_parallel
        if rows % count or (count > 1 and rows // count % replicas):
            split = f" each split between data_parallel={replicas} replicas" if replicas > 1 else ""
            raise ValueError(
                f"A batch of {rows} cannot be cut into microbatches={count} equal parts{split}; "
                f"use a batch size that is a multiple of {count * replicas}."
            )
        self.placement.check_batch_size(rows // count)
        self._batch_shapes = (shape_dtype(inputs), shape_dtype(labels))
        self.specs = stage_specs(
            self.stages,
            *(s.update(shape=(rows // count, *s.shape[1:])) for s in self._batch_shapes),
        )
        stages = []
        for k, fns in enumerate(self.stages):
            params, rest = self.placement.put((fns.params, fns.rest), k)
            init = jax.jit(fns.optimizer.init, out_shardings=self.placement.replicated(k))
            previous = params if self.schedule.keeps_previous_weights else None
            stages.append(StageState(params, rest, init(params), previous=previous))
        if self.options.predict == "momentum":
            for fns, stage in zip(self.stages, stages):
                if fns.predict_ahead:
                    momentum_of(stage.opt_state)  # raises if the optimizer has no momentum
        self._calls = self._compile()
        none = (None,) * self.num_stages
        finite = self.placement.put(jnp.array(True), self.num_stages - 1)
        return PipelineState(0, tuple(stages), none, none, finite)

    def _compile(self) -> list[Calls]:
        """Each stage's calls, compiled for its records' layout (undonated and wrapped in
        `observed`'s watcher where there is one)."""
        calls = [
            fns.compile(spec.residual_layout, donate=self._watch is None)
            for fns, spec in zip(self.stages, self.specs)
        ]
        if self._watch is None:
            return calls
        return [
            Calls(*(self._watch(k, name, fn) for name, fn in zip(Calls._fields, stage_calls)))
            for k, stage_calls in enumerate(calls)
        ]

    def model_flops(self) -> float:
        """A training step's model FLOPs, as XLA counts them: three times the forward of
        every stage on the whole batch init saw (the backward costs twice the forward;
        recomputation, auxiliary heads and optimizers are not the model's work).

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> _ = pipe.init((jnp.ones((2, 4)), jnp.array([0, 1])))
        >>> pipe.model_flops() >= 3 * 2 * 2 * (4 * 8 + 8 * 3)  # 2 examples, 2 per multiply-add
        True
        """
        if self._batch_shapes is None:
            raise RuntimeError("Call pipe.init(example_batch) before pipe.model_flops.")
        x, forward_flops = self._batch_shapes[0], 0.0
        for fns in self.stages:
            args = jax.tree.map(shape_dtype, (fns.params, fns.rest)) + (x,)
            lowered = jax.jit(fns.apply).lower(*args)
            forward_flops += lowered.cost_analysis().get("flops", 0.0)
            x = lowered.out_info[0]  # the stage's output: the next one's input
        return 3 * forward_flops

    def _check_batch(self, batch):
        if self._batch_shapes is None:
            raise RuntimeError("Call pipe.init(example_batch) before pipe.step.")
        batch = _split_batch(batch)
        got = tuple(shape_dtype(a) for a in batch)
        if got != self._batch_shapes:

            def describe(shapes):
                return ", ".join(f"{s.dtype}{list(s.shape)}" for s in shapes)

            raise ValueError(
                f"This batch's (inputs, labels) are ({describe(got)}), but init saw "
                f"({describe(self._batch_shapes)}); every batch must match (drop the last "
                "partial batch, or pad it, and cast to the same dtype)."
            )
        return batch

    # ------------------------------------------------------------------ step

    def step(self, state: PipelineState, batch) -> tuple[PipelineState, dict[str, Any]]:
        """Consumes `batch` (the t-th of the stream) and advances every stage once.

        Returns the new state and the metrics of the batch the last stage took
        its loss on in this step: device arrays (`loss` and what `loss_fn`
        reports, means over the batch) plus `batch`, that batch's index in the
        stream. While an FDG pipeline fills, the last stage has no batch yet and
        the metrics are `{}`. On probed steps (`probe_every`) they also hold
        `probe` (see `probe`) and `probe_step`, this step's index.

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="ddg",
        ...                 optimizer=optax.sgd(0.1))
        >>> batch = (jnp.ones((4, 4)), jnp.array([0, 1, 2, 0]))
        >>> state, metrics = pipe.step(pipe.init(batch), batch)
        >>> state.step, metrics["batch"], metrics["loss"].shape  # DDG: batch 0's loss at once
        (1, 0, ())
        """
        inputs, labels = self.placement.put_batch(self._check_batch(batch), 0)
        probe = None
        every = self.options.probe_every
        if every is not None and state.step % every == 0:
            probe = self.probe(state, (inputs, labels))
        state, metrics = self._carry_out(state, inputs, labels)
        if self.probe_window:
            kept = state.recent + (Message(state.step - 1, inputs, labels),)
            state = state.replace(recent=kept[-self.probe_window :])
        if probe:
            metrics = {**metrics, "probe": probe, "probe_step": state.step - 1}
        return state, metrics

    def _carry_out(self, state: PipelineState, inputs, labels):
        """Does the timetable's work of step `state.step`, one call after another."""
        t = state.step
        units = self.schedule.units(t)
        if units == [t]:
            pieces = [(inputs, labels)]
        else:
            pieces = self._microbatches(inputs, labels)
        work = _Work(list(state.stages), state.finite)
        work.activations = {(0, u): Message(u, *piece) for u, piece in zip(units, pieces)}
        for waiting, box in [
            (state.activations, work.activations),
            (state.cotangents, work.cotangents),
        ]:
            box.update({(k, m.batch): m for k, m in enumerate(waiting) if m is not None})
        for call in self.schedule.work(t):
            _CARRIERS[type(call)](self, call, work)
        stages = [s.replace(gradient_sum=work.gradients.get(k)) for k, s in enumerate(work.stages)]
        return state.replace(
            step=t + 1,
            stages=tuple(stages),
            activations=self._waiting(work.activations, "activation"),
            cotangents=self._waiting(work.cotangents, "cotangent"),
            finite=work.finite,
        ), work.metrics()

    def _waiting(self, messages: dict, kind: str) -> tuple[Message | None, ...]:
        """The messages left at the end of a step, by the stage they wait for."""
        waiting = [None] * self.num_stages
        for (k, unit), message in messages.items():
            if waiting[k] is not None or (kind == "activation" and k == 0):
                raise AssertionError(
                    f"the timetable left more than one {kind} for stage {k} (of {unit} and "
                    f"{waiting[k] and waiting[k].batch}); the pipeline state is corrupt"
                )
            waiting[k] = message
        return tuple(waiting)

    def _move(self, value, src: int, dst: int):
        return self.placement.move(value, src, dst)

    def _send_on(self, k: int, work: _Work, unit, y, labels) -> None:
        if k < self.num_stages - 1:
            work.activations[(k + 1, unit)] = Message(unit, *self._move((y, labels), k, k + 1))

    def _send_back(self, k: int, work: _Work, unit, cotangent) -> None:
        if cotangent is not None:
            work.cotangents[(k - 1, unit)] = Message(unit, self._move(cotangent, k, k - 1))

    def _do_forward(self, call: Forward, work: _Work) -> None:
        k, stage = call.stage, work.stages[call.stage]
        message = work.activations.pop((k, call.unit))
        given = Given(
            params=stage.previous if call.previous else stage.params,
            rest=stage.rest,
            opt_state=self.stages[k].forward_reads(stage.opt_state),
            x=message.value,
        )
        changed, out = self._calls[k].forward(Vars(), given)
        work.stages[k] = stage.replace(rest=changed.rest).keep(out.record, call.unit)
        self._send_on(k, work, call.unit, out.y, message.labels)

    def _do_backward_forward(self, call: BackwardForward, work: _Work) -> None:
        k = call.stage
        message = work.activations.pop((k, call.forward))
        received = work.cotangents.pop((k, call.backward))
        record, stage = work.stages[k].take(call.backward, k)
        changed, out = self._calls[k].step(
            Vars(stage.params, stage.rest, stage.opt_state),
            Given(
                record=record,
                cotangent=received.value,
                x=message.value,
                update_first=call.update_first,
            ),
        )
        stage = stage.replace(params=changed.params, rest=changed.rest, opt_state=changed.opt_state)
        work.stages[k] = stage.keep(out.record, call.forward)
        self._send_back(k, work, call.backward, out.cotangent)
        self._send_on(k, work, call.forward, out.y, message.labels)

    def _backward_given(self, k: int, stage, record, cotangent) -> Given:
        """What a backward of `record` reads: the weights and statistics only where it
        replays the forward (see `StageFunctions.backward_reads`)."""
        params, rest = self.stages[k].backward_reads(stage.params, stage.rest)
        return Given(params=params, rest=rest, record=record, cotangent=cotangent)

    def _do_backward(self, call: Backward, work: _Work) -> None:
        k = call.stage
        received = work.cotangents.pop((k, call.unit))
        record, stage = work.stages[k].take(call.unit, k)
        given = self._backward_given(k, stage, record, received.value)
        if call.apply:
            changed, out = self._calls[k].backward_update(
                Vars(params=stage.params, opt_state=stage.opt_state), given
            )
            stage = stage.replace(params=changed.params, opt_state=changed.opt_state)
        else:
            changed, out = self._calls[k].backward_sum(Vars(grad_sum=work.gradients.get(k)), given)
            work.gradients[k] = changed.grad_sum
        work.stages[k] = stage
        self._send_back(k, work, call.unit, out.cotangent)

    def _do_input_gradient(self, call: InputGradient, work: _Work) -> None:
        k = call.stage
        received = work.cotangents.pop((k, call.unit))
        record, stage = work.stages[k].take(call.unit, k)
        given = self._backward_given(k, stage, record, received.value)
        _, out = self._calls[k].backward_input(Vars(), given)
        work.stages[k] = stage
        work.weights_due[(k, call.unit)] = (record, received.value)
        self._send_back(k, work, call.unit, out.cotangent)

    def _do_weight_gradient(self, call: WeightGradient, work: _Work) -> None:
        k, stage = call.stage, work.stages[call.stage]
        record, cotangent = work.weights_due.pop((k, call.unit))
        changed, _ = self._calls[k].backward_weights(
            Vars(grad_sum=work.gradients.get(k)),
            self._backward_given(k, stage, record, cotangent),
        )
        work.gradients[k] = changed.grad_sum

    def _do_loss_input(self, call: LossInput, work: _Work) -> None:
        k, stage = call.stage, work.stages[call.stage]
        message = work.activations.pop((k, call.unit))
        changed, out = self._calls[k].loss_input(
            Vars(metrics=work.metric_sum),
            Given(
                params=stage.params,
                rest=stage.rest,
                x=message.value,
                labels=message.labels,
                finite=work.finite,
            ),
        )
        work.stages[k] = stage.replace(rest=changed.rest)
        work.metric_sum, work.finite = changed.metrics, changed.finite
        work.weights_due[(k, call.unit)] = (out.record, out.seed)
        work.loss_of, work.loss_count = call.unit[0], work.loss_count + 1
        self._send_back(k, work, call.unit, out.cotangent)

    def _do_loss(self, call: Loss, work: _Work) -> None:
        k, stage = call.stage, work.stages[call.stage]
        message = work.activations.pop((k, call.unit))
        batch = Given(x=message.value, labels=message.labels, finite=work.finite)
        if call.apply:
            changed, out = self._calls[k].loss_step(
                Vars(stage.params, stage.rest, stage.opt_state), batch
            )
            work.stages[k] = stage.replace(
                params=changed.params, rest=changed.rest, opt_state=changed.opt_state
            )
            work.loss_of, work.loss_count = call.unit, 1
        else:
            changed, out = self._calls[k].loss_sum(
                Vars(grad_sum=work.gradients.get(k), metrics=work.metric_sum),
                batch.replace(
                    params=stage.previous if call.previous else stage.params, rest=stage.rest
                ),
            )
            work.stages[k] = stage.replace(rest=changed.rest)
            work.gradients[k] = changed.grad_sum
            work.loss_of, work.loss_count = call.unit[0], work.loss_count + 1
        work.metric_sum, work.finite = changed.metrics, changed.finite
        self._send_back(k, work, call.unit, out.cotangent)

    def _do_local_loss(self, call: LocalLoss, work: _Work) -> None:
        k, stage = call.stage, work.stages[call.stage]
        message = work.activations.pop((k, call.unit))
        changed, out = self._calls[k].aux_step(
            Vars(stage.params, stage.rest, stage.opt_state),
            Given(x=message.value, labels=message.labels),
        )
        work.stages[k] = stage.replace(
            params=changed.params, rest=changed.rest, opt_state=changed.opt_state
        )
        self._send_on(k, work, call.unit, out.y, message.labels)

    def _do_apply(self, call: Apply, work: _Work) -> None:
        k, stage = call.stage, work.stages[call.stage]
        changed, _ = self._calls[k].apply_sum(
            Vars(opt_state=stage.opt_state, grad_sum=work.gradients.pop(k)),
            Given(
                params=stage.params,
                stale=stage.previous if call.keep_previous else None,
                count=call.count,
            ),
        )
        previous = stage.params if call.keep_previous else stage.previous
        work.stages[k] = stage.replace(
            params=changed.params, opt_state=changed.opt_state, previous=previous
        )

    def _do_fused(self, call: Fused, work: _Work) -> None:
        message = work.activations.pop((0, call.unit))
        stages = work.stages
        params, rests, opt_states, metrics, work.finite = self._fused(
            [s.params for s in stages],
            [s.rest for s in stages],
            [s.opt_state for s in stages],
            message.value,
            message.labels,
            work.finite,
        )
        work.stages = [StageState(p, r, o) for p, r, o in zip(params, rests, opt_states)]
        work.loss_of, work.metric_sum, work.loss_count = call.unit, metrics, 1

    def _fused_step(self, params, rests, opt_states, x, labels, finite):
        def loss(params):
            h, new_rests = x, []
            for fns, p, r in zip(self.stages, params, rests):
                h, r = fns.apply(p, r, h)
                new_rests.append(r)
            value, metrics = self.loss_fn(h, labels)
            return value, (metrics, new_rests)

        (value, (metrics, new_rests)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updated = [
            fns.apply_optimizer(p, o, g)
            for fns, p, o, g in zip(self.stages, params, opt_states, grads)
        ]
        new_params, new_opt_states = zip(*updated)
        replicated = self.placement.replicated(0)
        metrics, new_rests = jax.lax.with_sharding_constraint(
            ({"loss": value, **metrics}, new_rests), replicated
        )
        finite = finite & jnp.isfinite(value)
        return list(new_params), new_rests, list(new_opt_states), metrics, finite

    def probe(self, state: PipelineState, batch) -> dict[int, dict[str, jax.Array]]:
        """How stale the gradients are that the next `step(state, batch)` applies.

        For every stage k that applies a gradient in that step (of batch b_k):
        `cosine` and `relative_difference` (|applied - fresh| / |fresh|) of the
        gradient it applies against the gradient of b_k's loss at the current
        weights of every stage (`fresh`, one backprop of the whole model per
        batch, on the first stage's devices), and `weight_drift`, |w_now - w_b| /
        |w_now| with w_b the weights of b_k's forward where the stage keeps them
        (weights=stash; NaN otherwise; 0 where the gradient is fresh). For DGL the
        applied gradient is that of the stage's own head's loss, compared with the
        model's loss gradient on the stage's body. Device arrays, keyed by stage;
        needs `probe_every` (the state keeps the batches whose gradients are due).
        See `dgrad.probe`.

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="ddg",
        ...                 optimizer=optax.sgd(0.1), probe_every=1)
        >>> batch = (jnp.ones((4, 4)), jnp.array([0, 1, 2, 0]))
        >>> state, _ = pipe.step(pipe.init(batch), batch)
        >>> probe = pipe.probe(state, batch)
        >>> sorted(probe), sorted(probe[0])
        ([0, 1], ['cosine', 'relative_difference', 'weight_drift'])
        >>> float(probe[1]["cosine"]), float(probe[0]["cosine"]) < 1  # the last stage's is fresh
        (1.0, True)
        """
        return self._probe.measure(state, batch, self.specs)

    # ------------------------------------------------------- use the weights

    def predict(self, state: PipelineState, inputs) -> jax.Array:
        """The model's outputs in evaluation mode with each stage's current weights.

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((2, 4)), jnp.array([0, 1])))
        >>> logits = pipe.predict(state, jnp.ones((2, 4)))  # through both stages
        >>> logits.shape, bool((logits[0] == logits[1]).all())
        ((2, 3), True)
        """
        x = self.placement.put_batch(inputs, 0)
        for k, stage in enumerate(state.stages):
            given = Given(params=stage.params, rest=stage.rest, x=self._move(x, max(k - 1, 0), k))
            x = self._calls[k].predict(Vars(), given)[1].y
        return x

    def _evaluation_sums_fn(self, outputs, labels, mask):
        def one_example(output, label):
            loss, metrics = self.loss_fn(output[None], label[None])
            return {"loss": loss, **metrics}

        per_example = jax.vmap(one_example)(outputs, labels)
        weights = mask.astype(jnp.float32)
        sums = {name: jnp.sum(value * weights) for name, value in per_example.items()}
        sums["count"] = jnp.sum(weights)
        return jax.lax.with_sharding_constraint(
            sums, self.placement.replicated(self.num_stages - 1)
        )

    def evaluation_sums(self, state: PipelineState, batch, mask=None) -> dict[str, jax.Array]:
        """Sums over the examples where `mask` is true of `loss_fn`'s loss and metrics,
        each example scored alone, with the current weights in evaluation mode; and
        `count`. Padded batches give exact means over a dataset (device arrays).

        >>> import jax.numpy as jnp, numpy as np, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> batch = (jnp.ones((4, 4)), jnp.array([0, 1, 2, 0]))
        >>> state = pipe.init(batch)
        >>> sums = pipe.evaluation_sums(state, batch, mask=np.array([True, True, True, False]))
        >>> sorted(sums), float(sums["count"])  # the fourth example is padding
        (['accuracy', 'count', 'loss'], 3.0)
        """
        inputs, labels = _split_batch(batch)
        if mask is None:
            mask = np.ones(np.shape(labels)[0], bool)
        outputs = self.predict(state, inputs)
        last = self.num_stages - 1
        labels, mask = self._move(self.placement.put_batch((labels, mask), 0), 0, last)
        return self._evaluation_sums(outputs, labels, mask)

    def evaluate(self, state: PipelineState, batch) -> dict[str, jax.Array]:
        """`loss_fn`'s loss and metrics on `batch` in evaluation mode (means, device arrays).

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> batch = (jnp.ones((4, 4)), jnp.array([0, 0, 0, 0]))
        >>> metrics = pipe.evaluate(pipe.init(batch), batch)
        >>> {name: round(float(value), 4) for name, value in metrics.items()}
        {'accuracy': 1.0, 'loss': 0.317}
        """
        sums = self.evaluation_sums(state, batch)
        count = sums.pop("count")
        return {name: value / count for name, value in sums.items()}

    @staticmethod
    def check_finite(state: PipelineState) -> None:
        """Raises FloatingPointError if any loss so far was NaN or infinite.

        This waits for the device: call it once an epoch, not every step.

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> batch = (jnp.ones((2, 4)), jnp.array([0, 1]))
        >>> state = pipe.init(batch)
        >>> pipe.check_finite(state)  # every loss so far finite: returns None
        >>> state, _ = pipe.step(state, (jnp.full((2, 4), jnp.nan), batch[1]))
        >>> pipe.check_finite(state)
        Traceback (most recent call last):
            ...
        FloatingPointError: A training loss was NaN or infinite at or before step 1; ...
        """
        if not bool(share(state.finite)):
            raise FloatingPointError(
                f"A training loss was NaN or infinite at or before step {state.step}; lower the "
                "learning rate, shrink more (smaller beta), or check the data for bad values."
            )

    # ------------------------------------------------------ state structure

    def recompute_records(self, state: PipelineState) -> PipelineState:
        """`state` with each record held as its source (a checkpoint holds a record of a
        VJP that way: `dgrad.stage.Residuals.source`) computed again: the stage's forward
        at the source's weights and statistics, the same bits as the record it replaces.

        >>> import jax, jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), record_sources=True,
        ...                 optimizer=optax.sgd(0.1))
        >>> batch = (jnp.ones((4, 4)), jnp.array([0, 1, 2, 0]))
        >>> state, _ = pipe.step(pipe.init(batch), batch)
        >>> record = state.stages[0].kept[0]
        >>> held = state.replace(stages=(state.stages[0].replace(kept=(record.source,)),
        ...                              state.stages[1]))
        >>> again = pipe.recompute_records(held).stages[0].kept[0]
        >>> all(jax.tree.leaves(jax.tree.map(jnp.array_equal, again, record)))
        True
        """
        stages = list(state.stages)
        for k, (fns, spec) in enumerate(zip(self.stages, self.specs)):
            if not fns.keeps_sources:
                continue  # none of its records was held as its source
            recompute = fns.compile(spec.residual_layout).recompute
            kept = tuple(
                recompute(Vars(), Given(record=record))[1].record
                if isinstance(record, StashedInputs)
                else record
                for record in stages[k].kept
            )
            stages[k] = stages[k].replace(kept=kept)
        return state.replace(stages=tuple(stages))

    def state_structure(self, step: int) -> PipelineState:
        """The state after `step` steps as `jax.ShapeDtypeStruct`s with their shardings.

        What is in flight follows from the timetable (`dgrad.schedule`) and the
        stages' shapes alone, so a checkpoint restores into this structure; see
        `dgrad.state.structure`.

        >>> import jax.numpy as jnp, optax
        >>> from dgrad import models
        >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), optimizer=optax.sgd(0.1))
        >>> state = pipe.init((jnp.ones((4, 4)), jnp.array([0, 1, 2, 0])))
        >>> pipe.state_structure(0).activations  # nothing in flight before the first step
        (None, None)
        >>> message = pipe.state_structure(5).activations[1]
        >>> message.batch, message.value.shape, message.value.dtype
        (4, (4, 8), dtype('float32'))
        """
        if self.specs is None:
            raise RuntimeError("Call pipe.init(example_batch) before asking for state shapes.")
        return structure(
            step,
            schedule=self.schedule,
            placement=self.placement,
            stages=self.stages,
            specs=self.specs,
            labels=self._batch_shapes[1],
            recent=self.probe_window,
        )


# What carries out each kind of timetable call: `Pipeline._do_<the kind's name>` (built
# once; a view from `observed` is passed as `self`, so it runs its own watched functions).
_CARRIERS = {kind: getattr(Pipeline, f"_do_{kind.name}") for kind in KINDS}


def _check_aux_heads(stages, schedule: Schedule) -> None:
    from dgrad.models.aux import AuxStage

    missing = [
        k
        for k, stage in enumerate(stages)
        if schedule.trains_locally(k) and not isinstance(stage, AuxStage)
    ]
    if missing:
        raise ValueError(
            f"method={schedule.method} trains every stage but the last on its own auxiliary "
            f"head, but stage(s) "
            f"{missing} have none; add them with dgrad.models.with_aux_heads(stages, "
            "num_classes, example_input) or wrap a stage as dgrad.models.AuxStage(stage, head)."
        )


# The state's parts stay importable from here.
__all__ = ["Message", "Pipeline", "PipelineState", "Residuals", "StageState"]
