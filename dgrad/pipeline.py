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
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dgrad import losses
from dgrad.optim import accumulate, shrink
from dgrad.optim.per_stage import Optimizer, for_stage
from dgrad.optim.prediction import momentum_of
from dgrad.options import Options
from dgrad.placement import Placement, share
from dgrad.probe import Probe
from dgrad.schedule import Schedule
from dgrad.stage import LossFn, Residuals, StageFunctions, shape_dtype
from dgrad.state import Message, PipelineState, StageState, stage_specs, structure


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
            self._calls[0]["fused_step"] = jax.jit(self._fused_step, donate_argnums=(0, 1, 2))
        self._evaluation_sums = jax.jit(self._evaluation_sums_fn)
        self._probe = Probe(self)
        self.probe_window = self.schedule.longest_wait() if probe_every is not None else 0
        self._batch_shapes = None
        self.specs = None  # each stage's `dgrad.state.StageSpec`, once `init` has run

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
        self.placement.check_batch_size(np.shape(inputs)[0])
        self._batch_shapes = (shape_dtype(inputs), shape_dtype(labels))
        self.specs = stage_specs(self.stages, *self._batch_shapes)
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
        reports) plus `batch`, that batch's index in the stream. While an FDG
        pipeline fills, the last stage has no batch yet and the metrics are `{}`.
        On probed steps (`probe_every`) they also hold `probe` (see `probe`) and
        `probe_step`, this step's index.

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
        if self.fused:
            state, metrics = self._step_fused(state, inputs, labels)
        else:
            step = self._step_bp if self.method == "bp" else self._step_staged
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

    def _backward_and_forward(self, k: int, stage: StageState, received: Message, x, batch: int):
        """Stage k's backward + update of `received`'s batch and forward of `x`, one call."""
        self._check_record(k, stage, received)
        params, rest, opt_state, cotangent, y, record = self._calls[k]["step"](
            stage.params,
            stage.rest,
            stage.opt_state,
            stage.kept[0],
            received.value,
            x,
            self.specs[k].residual_treedef,
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
            self.specs[k].residual_treedef,
        )
        stage = stage.replace(params=params, opt_state=opt_state).drop_oldest()
        return stage, self._cotangent_for(k, received.batch, cotangent)

    def _cotangent_for(self, k: int, batch: int, cotangent) -> Message | None:
        """The message stage k sends stage k-1 with its input cotangent (none from stage 0
        and from stages that train on their own loss)."""
        return None if cotangent is None else Message(batch, self._move(cotangent, k, k - 1))

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

    def _step_staged(self, state, x, labels):
        """DDG, FR, FDG and DGL: each stage takes the batch that reaches it, applies the
        gradient it is due (one call) and passes its output on: in the same step under
        DDG and FR, in the next one under FDG and DGL (the forward is unlocked)."""
        t, last, unlocked = state.step, self.num_stages - 1, self.method in ("fdg", "dgl")
        stages = list(state.stages)
        activations, cotangents = [None] * self.num_stages, [None] * self.num_stages
        message, metrics, finite = Message(t, x, labels), {}, state.finite
        for k in range(self.num_stages):
            if unlocked and k > 0:
                message = state.activations[k]
            if message is None:  # the pipeline is still filling up to stage k
                break
            if k == last:
                stages[k], sent, finite, metrics = self._loss_step(
                    stages[k], message.value, message.labels, message.batch, finite
                )
            else:
                y, stages[k], sent = self._advance(k, stages[k], state.cotangents[k], message)
            if k > 0:
                cotangents[k - 1] = sent
            if k < last:
                message = Message(message.batch, *self._move((y, message.labels), k, k + 1))
                if unlocked:
                    activations[k + 1] = message
        return state.replace(
            step=t + 1,
            stages=tuple(stages),
            activations=tuple(activations),
            cotangents=tuple(cotangents),
            finite=finite,
        ), metrics

    def _advance(self, k: int, stage: StageState, received: Message | None, message: Message):
        """Stage k's one call on `message`'s batch: forward only while it has no gradient
        due, else backward, update and forward; DGL: its own head's loss step."""
        if self.method == "dgl":
            params, opt_state, rest, y, _ = self._calls[k]["aux_step"](
                stage.params, stage.rest, stage.opt_state, message.value, message.labels
            )
            return y, stage.replace(params=params, opt_state=opt_state, rest=rest), None
        if received is None:
            return (*self._forward(k, stage, message.value, message.batch), None)
        return self._backward_and_forward(k, stage, received, message.value, message.batch)

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
        return self._probe.measure(state, batch)

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
        >>> pipe.evaluate(pipe.init(batch), batch)
        {'accuracy': Array(1., dtype=float32), 'loss': Array(0.31700826, dtype=float32)}
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


def _check_aux_heads(stages) -> None:
    from dgrad.models.aux import AuxStage

    missing = [k for k, stage in enumerate(stages[:-1]) if not isinstance(stage, AuxStage)]
    if missing:
        raise ValueError(
            f"method=dgl trains every stage but the last on its own auxiliary head, but stage(s) "
            f"{missing} have none; add them with dgrad.models.with_aux_heads(stages, "
            "num_classes, example_input) or wrap a stage as dgrad.models.AuxStage(stage, head)."
        )


# The state's parts stay importable from here.
__all__ = ["Message", "Pipeline", "PipelineState", "Residuals", "StageState"]
