"""The pipeline engine: BP, DDG and FDG over stages placed on device groups.

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
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from dgrad import losses
from dgrad.optim import accumulate, shrink
from dgrad.optim.per_stage import Optimizer, for_stage
from dgrad.optim.prediction import momentum_of
from dgrad.options import Options
from dgrad.placement import Placement, share
from dgrad.schedule import Schedule
from dgrad.stage import LossFn, Record, Residuals, StageFunctions


@struct.dataclass
class StageState:
    """One stage's state: weights, statistics, optimizer state, and the records it keeps
    (`kept[i]` for the forward of batch `kept_batches[i]`, oldest first)."""

    params: Any
    rest: Any
    opt_state: Any
    kept: tuple[Record, ...] = ()
    kept_batches: tuple[int, ...] = struct.field(pytree_node=False, default=())

    def keep(self, record: Record, batch: int) -> StageState:
        return self.replace(kept=self.kept + (record,), kept_batches=self.kept_batches + (batch,))

    def drop_oldest(self) -> StageState:
        return self.replace(kept=self.kept[1:], kept_batches=self.kept_batches[1:])


@struct.dataclass
class Message:
    """An activation (with its labels) or a cotangent of `batch` in flight."""

    batch: int = struct.field(pytree_node=False)
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
    >>> from dgrad import models
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
    """Shapes of what stage k receives, sends and keeps (global shapes, whole batch)."""

    inputs: jax.ShapeDtypeStruct
    outputs: jax.ShapeDtypeStruct | None  # None for the last stage
    record: Record | None  # of ShapeDtypeStructs; None for the last stage
    residual_treedef: Any = None  # see StageFunctions.residual_treedef


def _shape_dtype(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.result_type(a))


def _abstract(tree, sharding):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s placed by `sharding`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _split_batch(batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"A batch must be a pair (inputs, labels), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            + "."
        )
    return batch[0], batch[1]


class Pipeline:
    """Trains a list of NNX stages with BP, DDG or FDG on groups of devices.

    Args:
      stages: the model as a list of initialised `flax.nnx.Module`s; stage k's
        output is stage k+1's input, the last stage's output goes to `loss_fn`.
      optimizer: an optax transformation (each stage gets its own state) or a
        function from the stage index to one.
      method, beta, weights, memory, fused, predict_lr, data_parallel, accumulate,
        probe_every: the training options, see `dgrad.options.Options` (also for
        what they mean).
      devices, placement: which devices, and how stages (and their
        `data_parallel` replicas) map onto them; see `dgrad.placement.Placement`.
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
    """

    def __init__(
        self,
        stages: Sequence[nnx.Module],
        *,
        optimizer: Optimizer,
        method: str = "fdg",
        beta: float = 1.0,
        weights: str | None = None,
        memory: str | None = None,
        fused: bool = False,
        predict_lr: float | None = None,
        data_parallel: int = 1,
        accumulate: int = 1,
        probe_every: int | None = None,
        devices: Sequence[jax.Device] | None = None,
        placement: str | Sequence = "spread",
        loss_fn: LossFn = losses.softmax_cross_entropy,
    ):
        if isinstance(stages, nnx.Module) or not isinstance(stages, Sequence) or not stages:
            raise TypeError(
                "stages must be a non-empty list of flax.nnx.Module stages (a single module "
                "is a one-stage pipeline: pass [module])."
            )
        self.options = Options(
            method=method,
            beta=beta,
            weights=weights,
            memory=memory,
            fused=fused,
            predict_lr=predict_lr,
            data_parallel=data_parallel,
            accumulate=accumulate,
            probe_every=probe_every,
        )
        self.num_stages = len(stages)
        if method == "dgl":
            _check_aux_heads(stages)
        self.schedule = Schedule(method, self.num_stages)
        self.placement = Placement(
            self.num_stages, devices, placement, data_parallel=data_parallel, fused=fused
        )
        self.loss_fn = loss_fn
        last, greedy = self.num_stages - 1, method == "dgl"
        self.stages = [
            StageFunctions(
                module,
                self._stage_optimizer(optimizer, k),
                options=self.options,
                first=k == 0 or greedy,
                loss_fn=loss_fn if k == last or greedy else None,
                staleness=self.schedule.weight_staleness(k),
                replicated=self.placement.replicated(k),
                sharded=self.placement.sharded(k),
            )
            for k, module in enumerate(stages)
        ]
        self._calls = [fns.jitted() for fns in self.stages]
        if fused:
            self._calls[0]["fused_step"] = jax.jit(self._fused_step, donate_argnums=(0, 2))
        self._evaluation_sums = jax.jit(self._evaluation_sums_fn)
        self._fresh_gradients = jax.jit(self._fresh_gradients_fn)
        self._compare = jax.jit(_compare_gradients)
        self._batch_shapes, self._specs = None, None

    def _stage_optimizer(self, optimizer: Optimizer, k: int) -> optax.GradientTransformation:
        tx = for_stage(optimizer, k)
        if self.options.shrinks:
            tx = optax.chain(shrink(self.options.beta, self.schedule.shrink_depth(k)), tx)
        every = self.options.accumulate
        if every > 1:
            tx = accumulate(tx, every, total=True)
        return tx

    method = property(lambda self: self.options.method)
    beta = property(lambda self: self.options.beta)
    weights = property(lambda self: self.options.weights)
    memory = property(lambda self: self.options.memory)
    fused = property(lambda self: self.options.fused)

    @property
    def devices(self) -> list[jax.Device]:
        """The first device of each stage's group."""
        return self.placement.devices

    def __repr__(self):
        o = self.options
        return (
            f"Pipeline(method={o.method!r}, num_stages={self.num_stages}, beta={o.beta}, "
            f"weights={o.weights!r}, memory={o.memory!r}, {self.placement})"
        )

    def observed(self, wrap: Callable[[int, str, Callable], Callable]) -> Pipeline:
        """A view of this pipeline whose stage functions are `wrap(k, name, function)`.

        The functions are copies that donate no buffers, so a watcher may hold on
        to their inputs and outputs (see `dgrad.timeline`). The view shares
        everything else with this pipeline and takes its states.
        """
        view = copy.copy(self)
        view._calls = []
        for k, fns in enumerate(self.stages):
            functions = fns.undonated()
            if self.fused and k == 0:
                functions["fused_step"] = jax.jit(self._fused_step)
            view._calls.append({name: wrap(k, name, fn) for name, fn in functions.items()})
        return view

    # ------------------------------------------------------------------ init

    def init(self, example_batch) -> PipelineState:
        """Places each stage's state on its devices and checks that the stages fit together.

        `example_batch` is an `(inputs, labels)` pair; every later batch must have
        its shapes and dtypes.
        """
        inputs, labels = _split_batch(example_batch)
        self.placement.check_batch_size(np.shape(inputs)[0])
        self._batch_shapes = (_shape_dtype(inputs), _shape_dtype(labels))
        self._specs = self._stage_specs(*self._batch_shapes)
        stages = []
        for k, fns in enumerate(self.stages):
            params, rest = self.placement.put((fns.params, fns.rest), k)
            init = jax.jit(fns.optimizer.init, out_shardings=self.placement.replicated(k))
            stages.append(StageState(params, rest, init(params)))
        if self.options.predict_lr is not None:
            for k, stage in enumerate(stages):
                if self.schedule.weight_staleness(k) > 0:
                    momentum_of(stage.opt_state)  # raises if the optimizer has no momentum
        none = (None,) * self.num_stages
        finite = self.placement.put(jnp.array(True), self.num_stages - 1)
        return PipelineState(0, tuple(stages), none, none, finite)

    @property
    def probe_window(self) -> int:
        """How many past batches the probe keeps: the longest a batch waits for its last
        gradient (0 without a probe)."""
        if self.options.probe_every is None:
            return 0
        s = self.schedule
        return max(s.forward_lag(k) + s.gradient_delay(k) for k in range(self.num_stages))

    def _stage_specs(self, inputs, labels) -> list[StageSpec]:
        specs, shape = [], inputs
        for k, fns in enumerate(self.stages):
            source = "the batch" if k == 0 else f"stage {k - 1}"
            try:
                if k == self.num_stages - 1:
                    jax.eval_shape(fns._loss_and_backward, fns.params, fns.rest, shape, labels)
                    specs.append(StageSpec(shape, None, None))
                else:
                    opt_state = jax.eval_shape(fns.optimizer.init, fns.params)
                    outputs, _, record = jax.eval_shape(
                        fns._forward, fns.params, fns.rest, opt_state, shape
                    )
                    treedef = None
                    if isinstance(record, Residuals):
                        treedef = fns.residual_treedef(fns.params, fns.rest, shape)
                    specs.append(StageSpec(shape, outputs, record, treedef))
                    shape = outputs
            except Exception as error:  # noqa: BLE001 -- re-raised with the stage named
                raise ValueError(
                    f"Stage {k} of {self.num_stages} cannot take input of shape {shape.shape} "
                    f"and dtype {shape.dtype} (from {source}); check where the model was split. "
                    f"Error: {error}"
                ) from error
        return specs

    def _check_batch(self, batch):
        if self._batch_shapes is None:
            raise RuntimeError("Call pipe.init(example_batch) before pipe.step.")
        batch = _split_batch(batch)
        got = tuple(_shape_dtype(a) for a in batch)
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
        reports) plus `batch`, that batch's index in the stream. While an FDG
        pipeline fills, the last stage has no batch yet and the metrics are `{}`.
        On probed steps (`probe_every`) they also hold `probe` (see `probe`) and
        `probe_step`, this step's index.
        """
        inputs, labels = self.placement.put_batch(self._check_batch(batch), 0)
        probe = None
        every = self.options.probe_every
        if every is not None and state.step % every == 0:
            probe = self.probe(state, (inputs, labels))
        if self.fused:
            state, metrics = self._step_fused(state, inputs, labels)
        else:
            step = {
                "bp": self._step_bp,
                "ddg": self._step_ddg,
                "fr": self._step_ddg,
                "fdg": self._step_fdg,
                "dgl": self._step_dgl,
            }[self.method]
            state, metrics = step(state, inputs, labels)
        if self.probe_window:
            kept = state.recent + (Message(state.step - 1, inputs, labels),)
            state = state.replace(recent=kept[-self.probe_window :])
        if probe:
            metrics = {**metrics, "probe": probe, "probe_step": state.step - 1}
        return state, metrics

    def _move(self, value, src: int, dst: int):
        return self.placement.move(value, src, dst)

    def _forward(self, k: int, stage: StageState, x, batch: int) -> tuple[Any, StageState]:
        y, rest, record = self._calls[k]["forward"](stage.params, stage.rest, stage.opt_state, x)
        return y, stage.replace(rest=rest).keep(record, batch)

    def _step_stage(self, k: int, stage: StageState, received: Message, x, batch: int):
        """Stage k's backward + update of `received`'s batch and forward of `x`, one call."""
        self._check_record(k, stage, received)
        params, rest, opt_state, cotangent, y, record = self._calls[k]["step"](
            stage.params,
            stage.rest,
            stage.opt_state,
            stage.kept[0],
            received.value,
            x,
            self._specs[k].residual_treedef,
        )
        stage = stage.replace(params=params, rest=rest, opt_state=opt_state).drop_oldest()
        return y, stage.keep(record, batch), self._cotangent_for(k, received.batch, cotangent)

    def _backward_update(self, k: int, stage: StageState, received: Message):
        self._check_record(k, stage, received)
        params, opt_state, cotangent = self._calls[k]["backward_update"](
            stage.params,
            stage.rest,
            stage.opt_state,
            stage.kept[0],
            received.value,
            self._specs[k].residual_treedef,
        )
        stage = stage.replace(params=params, opt_state=opt_state).drop_oldest()
        return stage, self._cotangent_for(k, received.batch, cotangent)

    def _cotangent_for(self, k: int, batch: int, cotangent) -> Message | None:
        """The message stage k sends stage k-1 with its input cotangent (none from stage 0)."""
        return None if k == 0 else Message(batch, self._move(cotangent, k, k - 1))

    @staticmethod
    def _check_record(k: int, stage: StageState, received: Message) -> None:
        if not stage.kept_batches or stage.kept_batches[0] != received.batch:
            raise AssertionError(
                f"stage {k} holds batches {stage.kept_batches} but received the cotangent of "
                f"batch {received.batch}; the pipeline state is corrupt"
            )

    def _loss_step(self, stage: StageState, x, labels, batch: int, finite):
        """The last stage: loss, backward and update in one dispatch."""
        k = self.num_stages - 1
        params, opt_state, rest, cotangent, metrics, finite = self._calls[k]["loss_step"](
            stage.params, stage.rest, stage.opt_state, x, labels, finite
        )
        stage = stage.replace(params=params, rest=rest, opt_state=opt_state)
        return stage, self._cotangent_for(k, batch, cotangent), finite, {**metrics, "batch": batch}

    def _step_bp(self, state, x, labels):
        t, last = state.step, self.num_stages - 1
        stages = list(state.stages)
        for k in range(last):
            y, stages[k] = self._forward(k, stages[k], x, t)
            x = self._move(y, k, k + 1)
        stages[last], sent, finite, metrics = self._loss_step(
            stages[last], x, self._move(labels, 0, last), t, state.finite
        )
        for k in reversed(range(last)):
            stages[k], sent = self._backward_update(k, stages[k], sent)
        return state.replace(step=t + 1, stages=tuple(stages), finite=finite), metrics

    def _step_ddg(self, state, x, labels):
        t, last = state.step, self.num_stages - 1
        stages, cotangents = list(state.stages), [None] * self.num_stages
        for k in range(last):
            received = state.cotangents[k]
            if received is None:
                y, stages[k] = self._forward(k, stages[k], x, t)
            else:
                y, stages[k], cotangents[k - 1] = self._step_stage(k, stages[k], received, x, t)
            x = self._move(y, k, k + 1)
        stages[last], sent, finite, metrics = self._loss_step(
            stages[last], x, self._move(labels, 0, last), t, state.finite
        )
        if last > 0:
            cotangents[last - 1] = sent
        return state.replace(
            step=t + 1, stages=tuple(stages), cotangents=tuple(cotangents), finite=finite
        ), metrics

    def _step_fdg(self, state, x, labels):
        t, last = state.step, self.num_stages - 1
        stages = list(state.stages)
        activations, cotangents = [None] * self.num_stages, [None] * self.num_stages
        arriving = (Message(t, x, labels),) + state.activations[1:]
        for k in range(last):
            message, received = arriving[k], state.cotangents[k]
            if message is None:  # the pipeline is still filling up to stage k
                continue
            if received is None:
                y, stages[k] = self._forward(k, stages[k], message.value, message.batch)
            else:
                y, stages[k], cotangents[k - 1] = self._step_stage(
                    k, stages[k], received, message.value, message.batch
                )
            activations[k + 1] = Message(
                message.batch, self._move(y, k, k + 1), self._move(message.labels, k, k + 1)
            )
        metrics, finite = {}, state.finite
        if arriving[last] is not None:
            message = arriving[last]
            stages[last], sent, finite, metrics = self._loss_step(
                stages[last], message.value, message.labels, message.batch, state.finite
            )
            if last > 0:
                cotangents[last - 1] = sent
        return state.replace(
            step=t + 1,
            stages=tuple(stages),
            activations=tuple(activations),
            cotangents=tuple(cotangents),
            finite=finite,
        ), metrics

    def _step_dgl(self, state, x, labels):
        """Every stage but the last trains on its own head's loss; outputs go on, one hop
        per iteration; no cotangent goes back."""
        t, last = state.step, self.num_stages - 1
        stages, activations = list(state.stages), [None] * self.num_stages
        arriving = (Message(t, x, labels),) + state.activations[1:]
        for k in range(last):
            message = arriving[k]
            if message is None:
                continue
            stage = stages[k]
            params, opt_state, rest, y, _ = self._calls[k]["aux_step"](
                stage.params, stage.rest, stage.opt_state, message.value, message.labels
            )
            stages[k] = stage.replace(params=params, opt_state=opt_state, rest=rest)
            activations[k + 1] = Message(
                message.batch, self._move(y, k, k + 1), self._move(message.labels, k, k + 1)
            )
        metrics, finite = {}, state.finite
        if arriving[last] is not None:
            message = arriving[last]
            stages[last], _, finite, metrics = self._loss_step(
                stages[last], message.value, message.labels, message.batch, state.finite
            )
        return state.replace(
            step=t + 1, stages=tuple(stages), activations=tuple(activations), finite=finite
        ), metrics

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

    def _step_fused(self, state, x, labels):
        stages = state.stages
        params, rests, opt_states, metrics, finite = self._calls[0]["fused_step"](
            [s.params for s in stages],
            [s.rest for s in stages],
            [s.opt_state for s in stages],
            x,
            labels,
            state.finite,
        )
        stages = tuple(StageState(p, r, o) for p, r, o in zip(params, rests, opt_states))
        return (
            state.replace(step=state.step + 1, stages=stages, finite=finite),
            {**metrics, "batch": state.step},
        )

    # ------------------------------------------------------------ the probe

    def _fresh_gradients_fn(self, params, rests, x, labels):
        """Every stage's gradient of the loss of (x, labels) at `params` (one backprop of
        the whole model; statistics are not updated)."""

        def loss(params):
            h = x
            for fns, p, r in zip(self.stages, params, rests):
                h, _ = fns.apply(p, r, h)
            return self.loss_fn(h, labels)[0]

        return jax.grad(loss)(params)

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
        """
        t, last = state.step, self.num_stages - 1
        known = {m.batch: (m.value, m.labels) for m in state.recent}
        known[t] = self.placement.put_batch(tuple(batch), 0)
        due = {k: self.schedule.backward_batch(k, t) for k in range(self.num_stages)}
        params = [self._move(s.params, k, 0) for k, s in enumerate(state.stages)]
        rests = [self._move(s.rest, k, 0) for k, s in enumerate(state.stages)]
        fresh_of = {}
        results = {}
        for k, b in due.items():
            if b is None or b not in known:
                continue
            if b not in fresh_of:
                fresh_of[b] = self._fresh_gradients(params, rests, *known[b])
            applied, drift = self._applied_gradient(k, state, known, b)
            fresh = fresh_of[b][k]
            if applied is None:
                applied = self._move(fresh, 0, k)
            if self.method == "dgl" and k < last:
                applied, fresh, drift = applied["body"], fresh["body"], drift["body"]
                now = state.stages[k].params["body"]
            else:
                now = state.stages[k].params
            results[k] = self._compare(
                self._move(applied, k, 0), fresh, self._move(now, k, 0), self._move(drift, k, 0)
            )
        return results

    def _applied_gradient(self, k, state, known, batch):
        """Stage k's gradient in the coming step (None where that step computes it from the
        current weights of every stage: the fresh gradient itself), and the weights of its
        batch's forward (NaN where the stage does not keep them)."""
        stage, last, calls = state.stages[k], self.num_stages - 1, self._calls[k]
        if self.method == "dgl" and k < last:
            if k == 0:
                x, labels = self._move(known[batch], 0, k)
            else:
                x, labels = state.activations[k].value, state.activations[k].labels
            return calls["aux_gradient"](stage.params, stage.rest, x, labels), stage.params
        if k == last:
            message = state.activations[k]
            if message is None:  # its input is this step's forward at the current weights
                return None, stage.params
            grads = calls["loss_gradient"](stage.params, stage.rest, message.value, message.labels)
            return grads, stage.params
        if not stage.kept_batches or stage.kept_batches[0] != batch:  # bp: this step's forward
            return None, stage.params
        record, received = stage.kept[0], state.cotangents[k]
        grads = calls["gradient"](
            record, stage.params, stage.rest, received.value, self._specs[k].residual_treedef
        )
        forward_weights = getattr(record, "params", None)
        if forward_weights is None:
            forward_weights = jax.tree.map(lambda w: jnp.full_like(w, jnp.nan), stage.params)
        return grads, forward_weights

    # ------------------------------------------------------- use the weights

    def predict(self, state: PipelineState, inputs) -> jax.Array:
        """The model's outputs in evaluation mode with each stage's current weights."""
        x = self.placement.put_batch(inputs, 0)
        for k, stage in enumerate(state.stages):
            x = self._calls[k]["predict"](stage.params, stage.rest, self._move(x, max(k - 1, 0), k))
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
        `count`. Padded batches give exact means over a dataset (device arrays)."""
        inputs, labels = _split_batch(batch)
        if mask is None:
            mask = np.ones(np.shape(labels)[0], bool)
        outputs = self.predict(state, inputs)
        last = self.num_stages - 1
        labels, mask = self._move(self.placement.put_batch((labels, mask), 0), 0, last)
        return self._evaluation_sums(outputs, labels, mask)

    def evaluate(self, state: PipelineState, batch) -> dict[str, jax.Array]:
        """`loss_fn`'s loss and metrics on `batch` in evaluation mode (means, device arrays)."""
        sums = self.evaluation_sums(state, batch)
        count = sums.pop("count")
        return {name: value / count for name, value in sums.items()}

    @staticmethod
    def check_finite(state: PipelineState) -> None:
        """Raises FloatingPointError if any loss so far was NaN or infinite.

        This waits for the device: call it once an epoch, not every step.
        """
        if not bool(share(state.finite)):
            raise FloatingPointError(
                f"A training loss was NaN or infinite at or before step {state.step}; lower the "
                "learning rate, shrink more (smaller beta), or check the data for bad values."
            )

    # ------------------------------------------------------ state structure

    def state_structure(self, step: int) -> PipelineState:
        """The state after `step` steps as `jax.ShapeDtypeStruct`s with their shardings.

        What is in flight follows from the timetable (`dgrad.schedule`) and the
        stages' shapes alone, so a checkpoint restores into this structure.
        """
        if self._specs is None:
            raise RuntimeError("Call pipe.init(example_batch) before asking for state shapes.")
        schedule, placement, on = self.schedule, self.placement, _abstract
        stages = []
        for k, (fns, spec) in enumerate(zip(self.stages, self._specs)):
            replicated = placement.replicated(k)
            params, rest = on(fns.params, replicated), on(fns.rest, replicated)
            opt_state = on(jax.eval_shape(fns.optimizer.init, fns.params), replicated)
            stage = StageState(params, rest, opt_state)
            for batch in schedule.kept_batches(k, step):
                stage = stage.keep(self._record_structure(k, spec, opt_state), batch)
            stages.append(stage)
        labels = self._batch_shapes[1]
        activations, cotangents = [], []
        for k, spec in enumerate(self._specs):
            batch = schedule.activation_batch(k, step)
            activations.append(
                None
                if batch is None
                else Message(
                    batch,
                    on(self._specs[k - 1].outputs, placement.sharded(k)),
                    on(labels, placement.sharded(k)),
                )
            )
            batch = schedule.cotangent_batch(k, step)
            cotangents.append(
                None if batch is None else Message(batch, on(spec.outputs, placement.sharded(k)))
            )
        finite = on(jax.ShapeDtypeStruct((), jnp.bool_), placement.replicated(self.num_stages - 1))
        sharded = placement.sharded(0)
        recent = tuple(
            Message(b, on(self._batch_shapes[0], sharded), on(labels, sharded))
            for b in range(max(0, step - self.probe_window), step)
        )
        return PipelineState(
            step, tuple(stages), tuple(activations), tuple(cotangents), finite, recent
        )

    def _record_structure(self, k: int, spec: StageSpec, opt_state) -> Record:
        """Stage k's record, with the shardings its forward gives the arrays it keeps."""
        fns = self.stages[k]
        replicated, sharded = self.placement.replicated(k), self.placement.sharded(k)
        if self.placement.data_parallel == 1:  # one device: nothing to ask the compiler
            return _abstract(spec.record, replicated)
        args = (
            _abstract(fns.params, replicated),
            _abstract(fns.rest, replicated),
            opt_state,
            _abstract(spec.inputs, sharded),
        )
        compiled = jax.jit(fns._forward).lower(*args).compile()
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            spec.record,
            compiled.output_shardings[2],
        )


def _check_aux_heads(stages) -> None:
    from dgrad.models.aux import AuxStage

    missing = [k for k, stage in enumerate(stages[:-1]) if not isinstance(stage, AuxStage)]
    if missing:
        raise ValueError(
            f"method=dgl trains every stage but the last on its own auxiliary head, but stage(s) "
            f"{missing} have none; add them with dgrad.models.with_aux_heads(stages, "
            "num_classes, example_input) or wrap a stage as dgrad.models.AuxStage(stage, head)."
        )


def _norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(tree)))


def _compare_gradients(applied, fresh, now, forward_weights):
    dot = sum(jnp.sum(a * f) for a, f in zip(jax.tree.leaves(applied), jax.tree.leaves(fresh)))
    difference = jax.tree.map(lambda a, f: a - f, applied, fresh)
    moved = jax.tree.map(lambda w, v: w - v, now, forward_weights)
    return {
        "cosine": dot / (_norm(applied) * _norm(fresh)),
        "relative_difference": _norm(difference) / _norm(fresh),
        "weight_drift": _norm(moved) / _norm(now),
    }


__all__ = ["Message", "Pipeline", "PipelineState", "Residuals", "StageState"]
