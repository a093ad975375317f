"""The pipeline engine: BP, DDG and FDG over stages placed on devices.

A `Pipeline` holds the compiled per-stage functions; a `PipelineState` holds
everything that changes: each stage's parameters, non-parameter state and
optimizer state, the records each stage keeps for its delayed backward, and
the activations and cotangents in flight between stages. `step` is a pure
state transition that only dispatches work: every value stays on its device
and nothing waits for the host.

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

import contextlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from dgrad import losses
from dgrad.optim import check_beta, shrink
from dgrad.optim.per_stage import Optimizer, for_stage
from dgrad.optim.prediction import momentum_of
from dgrad.placement import place_stages
from dgrad.schedule import Schedule, check_method
from dgrad.stage import LossFn, StageFunctions

WEIGHT_POLICIES = ("stash", "current")
MEMORY_POLICIES = ("residuals", "recompute")


@struct.dataclass
class Pending:
    """What a stage keeps from the forward of `batch` for its delayed backward.

    With `memory="residuals"`, `residuals` (the VJP's saved values); with
    `"recompute"`, `inputs` and, under `weights="stash"`, the `rest` that the
    forward used. Under `weights="stash"` also the forward's `params` (for the
    recomputation, and as the stale weights for delay compensation).
    """

    batch: int = struct.field(pytree_node=False)
    residuals: Any = None
    inputs: Any = None
    params: Any = None
    rest: Any = None


@struct.dataclass
class Message:
    """An activation (with its labels) or a cotangent of `batch` in flight."""

    batch: int = struct.field(pytree_node=False)
    value: Any
    labels: Any = None


@struct.dataclass
class StageState:
    params: Any
    rest: Any
    opt_state: Any
    pending: tuple[Pending, ...] = ()


@struct.dataclass
class PipelineState:
    """Everything a pipeline carries from one step to the next.

    Attributes:
      step: how many batches `step` has consumed.
      stages: one `StageState` per stage, on its device.
      activations: `activations[k]` is the input waiting for stage k (FDG).
      cotangents: `cotangents[k]` is the cotangent waiting for stage k.
      finite: False once any loss was NaN or infinite (see `Pipeline.check_finite`).
    """

    step: int = struct.field(pytree_node=False)
    stages: tuple[StageState, ...]
    activations: tuple[Message | None, ...]
    cotangents: tuple[Message | None, ...]
    finite: jax.Array


def _shape_dtype(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.result_type(a))


def _spec(tree):
    return jax.tree.map(lambda a: f"{_shape_dtype(a).dtype}{list(_shape_dtype(a).shape)}", tree)


def _split_batch(batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"A batch must be a pair (inputs, labels), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            + "."
        )
    return batch[0], batch[1]


class Pipeline:
    """Trains a list of NNX stages with BP, DDG or FDG.

    Args:
      stages: the model as a list of initialised `flax.nnx.Module`s; stage k's
        output is stage k+1's input, the last stage's output goes to `loss_fn`.
      method: `"bp"` (backprop; stage by stage, or `fused=True` for one jitted
        step on one device), `"ddg"` (decoupled backward, Huo et al. 2018) or
        `"fdg"` (fully decoupled, Zhuang et al. 2019). `dgrad.schedule` fixes the timing.
      optimizer: an optax transformation (each stage gets its own state) or a
        function from the stage index to one.
      beta: FDG gradient shrinking: stage k's gradient is scaled by
        `beta ** (K-1-k)` before its optimizer (so weight decay is not shrunk).
      weights: `"stash"` back-propagates each batch with the weights its
        forward used; `"current"` with the stage's weights at backward time.
      memory: `"residuals"` keeps the forward's VJP residuals until the
        backward; `"recompute"` keeps the stage input and recomputes.
      devices, placement: where the stages run, see `dgrad.placement.place_stages`.
      loss_fn: `(outputs, labels) -> (loss, metrics)` for the last stage.
      fused: with `method="bp"`, run the whole step as one jitted function
        (all stages must then share one device).
      predict_lr: forward with weights predicted as far ahead as the stage's
        weight staleness tau_k: `w - tau_k * predict_lr * momentum` (SpecTrain
        weight prediction, `dgrad.optim.predict_weights`); under
        `weights="stash"` the backward uses the same predicted weights. Needs an
        optimizer with momentum; set it to the optimizer's learning rate.
    """

    def __init__(
        self,
        stages: Sequence[nnx.Module],
        *,
        optimizer: Optimizer,
        method: str = "fdg",
        beta: float = 1.0,
        weights: str = "stash",
        memory: str = "residuals",
        devices: Sequence[jax.Device] | None = None,
        placement: str | Sequence[int] = "spread",
        loss_fn: LossFn = losses.softmax_cross_entropy,
        fused: bool = False,
        predict_lr: float | None = None,
    ):
        if isinstance(stages, nnx.Module) or not isinstance(stages, Sequence) or not stages:
            raise TypeError(
                "stages must be a non-empty list of flax.nnx.Module stages (a single module "
                "is a one-stage pipeline: pass [module])."
            )
        self.method = check_method(method)
        self.beta = check_beta(beta)
        if method != "fdg" and self.beta != 1.0:
            raise ValueError(
                f"beta={beta} asks for gradient shrinking, which is part of FDG; use "
                f"method='fdg' or leave beta at 1.0 for method={method!r}."
            )
        if weights not in WEIGHT_POLICIES:
            raise ValueError(
                f"Unknown weights policy {weights!r}; choose one of {WEIGHT_POLICIES}."
            )
        if memory not in MEMORY_POLICIES:
            raise ValueError(f"Unknown memory policy {memory!r}; choose one of {MEMORY_POLICIES}.")
        if weights == "current" and memory == "residuals":
            raise ValueError(
                "weights='current' needs memory='recompute': residuals kept from the forward "
                "hold the old weights, so the backward would mix stale activations with live "
                "weights; use weights='stash' to keep residuals."
            )
        self.weights, self.memory = weights, memory
        self.num_stages = len(stages)
        self.schedule = Schedule(method, self.num_stages)
        self.devices = place_stages(self.num_stages, devices, placement)
        if fused and method != "bp":
            raise ValueError(
                f"fused=True is a form of backprop; it needs method='bp', not {method!r}."
            )
        if fused and len(set(self.devices)) > 1:
            raise ValueError(
                "fused=True runs the whole step as one function on one device, but the stages "
                f"are placed on {len(set(self.devices))} devices; pass one device "
                "(devices=[jax.devices()[0]]) or fused=False for stage-by-stage backprop."
            )
        self.fused = fused
        if predict_lr is not None and not (isinstance(predict_lr, (int, float)) and predict_lr > 0):
            raise ValueError(
                f"predict_lr must be a positive learning rate (or None for no weight "
                f"prediction), got {predict_lr!r}."
            )
        self.predict_lr = None if predict_lr is None else float(predict_lr)
        self.loss_fn = loss_fn
        # Records holding stashed parameters must outlive the update that
        # replaces them, so only donate parameters no record can refer to.
        keeps_params = self._keeps_params = method != "bp" and weights == "stash"
        self.stages = [
            StageFunctions(
                module,
                self._stage_optimizer(optimizer, k),
                first=k == 0,
                loss_fn=loss_fn if k == self.num_stages - 1 else None,
                donate_params=not keeps_params,
            )
            for k, module in enumerate(stages)
        ]
        self._fused_step = jax.jit(self._fused_step_fn, donate_argnums=(0, 2)) if fused else None
        self._fused_step_undonated = jax.jit(self._fused_step_fn) if fused else None  # tracing
        self._loss = jax.jit(loss_fn)
        self._batch_spec = None
        self._timeline = None

    def _stage_optimizer(self, optimizer: Optimizer, k: int) -> optax.GradientTransformation:
        tx = for_stage(optimizer, k)
        if self.method == "fdg":
            tx = optax.chain(shrink(self.beta, self.schedule.shrink_depth(k)), tx)
        return tx

    def __repr__(self):
        return (
            f"Pipeline(method={self.method!r}, num_stages={self.num_stages}, beta={self.beta}, "
            f"weights={self.weights!r}, memory={self.memory!r}, devices={self.devices})"
        )

    # ------------------------------------------------------------------ init

    def init(self, example_batch) -> PipelineState:
        """Places each stage's state on its device and checks the stages fit together.

        `example_batch` is an `(inputs, labels)` pair; every later batch must have
        its shapes and dtypes.
        """
        inputs, labels = _split_batch(example_batch)
        self._batch_spec = _spec((inputs, labels))
        shape = _shape_dtype(inputs)
        for k, fns in enumerate(self.stages):
            try:
                if k == self.num_stages - 1:
                    jax.eval_shape(
                        fns._loss_and_backward, fns.params, fns.rest, shape, _shape_dtype(labels)
                    )
                else:
                    # Tracing `forward_keep` also fixes the residuals' structure, which a
                    # state restored from a checkpoint needs before its first forward.
                    forward = fns.forward_keep if self.memory == "residuals" else fns.forward
                    shape = jax.eval_shape(forward, fns.params, fns.rest, shape)[0]
            except Exception as error:  # noqa: BLE001 -- re-raised with the stage named
                raise ValueError(
                    f"Stage {k} of {self.num_stages} cannot take input of shape {shape.shape} "
                    f"and dtype {shape.dtype} (from "
                    f"{'the batch' if k == 0 else f'stage {k - 1}'}); check where the model "
                    f"was split. Error: {error}"
                ) from error
        stages = []
        for fns, device in zip(self.stages, self.devices):
            # Copies, so that donation never deletes the arrays of the user's modules.
            params, rest = jax.device_put((fns.params, fns.rest), device, may_alias=False)
            opt_state = jax.device_put(fns.optimizer.init(params), device, may_alias=False)
            stages.append(StageState(params, rest, opt_state))
        if self.predict_lr is not None:
            for k, stage in enumerate(stages):
                if self.schedule.weight_staleness(k) > 0:
                    momentum_of(stage.opt_state)  # raises if the optimizer has no momentum
        none = (None,) * self.num_stages
        finite = jax.device_put(jnp.array(True), self.devices[-1])
        return PipelineState(0, tuple(stages), none, none, finite)

    def _check_batch(self, batch):
        if self._batch_spec is None:
            raise RuntimeError("Call pipe.init(example_batch) before pipe.step.")
        got = _spec(_split_batch(batch))
        if got != self._batch_spec:
            raise ValueError(
                f"This batch's (inputs, labels) are {got}, but init saw {self._batch_spec}; every "
                "batch must match (drop the last partial batch, or pad it, and cast to the same "
                "dtype)."
            )
        return batch

    # ------------------------------------------------------------------ step

    def step(self, state: PipelineState, batch) -> tuple[PipelineState, dict[str, Any]]:
        """Consumes `batch` (the t-th of the stream) and advances every stage once.

        Returns the new state and the metrics of the batch the last stage took
        its loss on in this step: device arrays (`loss` and what `loss_fn`
        reports) plus `batch`, that batch's index in the stream. While an FDG
        pipeline fills, the last stage has no batch yet and the metrics are `{}`.
        """
        inputs, labels = self._check_batch(batch)
        inputs, labels = jax.device_put((inputs, labels), self.devices[0])
        if self.fused:
            return self._step_fused(state, inputs, labels)
        return {"bp": self._step_bp, "ddg": self._step_ddg, "fdg": self._step_fdg}[self.method](
            state, inputs, labels
        )

    def _run(self, k, name, batch, *args):
        """Calls stage k's jitted `name`, and shows it to the timeline when tracing."""
        fns = self.stages[k]
        if self._timeline is None:
            return getattr(fns, name)(*args)
        fn = fns.undonated(name) if name in fns.DONATING else getattr(fns, name)
        outputs = fn(*args)
        self._timeline.record(self.devices[k], k, name, batch, args, outputs)
        return outputs

    @contextlib.contextmanager
    def trace(self, timeline):
        """Records every stage function run inside the block into `timeline`.

        See `dgrad.timeline.Timeline`; the timeline is closed when the block ends.
        """
        self._timeline = timeline
        try:
            yield timeline
        finally:
            self._timeline = None
            timeline.close()

    def _put(self, value, k):
        return jax.device_put(value, self.devices[k])

    def _forward(self, k, stage: StageState, x, batch: int):
        """Stage k forwards `x`; returns its output and the stage with the record kept."""
        params, stash = stage.params, self.weights == "stash"
        tau = self.schedule.weight_staleness(k)
        if self.predict_lr is not None and tau > 0:
            params = self._run(
                k, "predict_weights", batch, params, stage.opt_state, tau, self.predict_lr
            )
        if self.memory == "residuals":
            y, rest, residuals = self._run(k, "forward_keep", batch, params, stage.rest, x)
            record = Pending(batch, residuals=residuals, params=params if stash else None)
        else:
            y, rest = self._run(k, "forward", batch, params, stage.rest, x)
            record = Pending(
                batch,
                inputs=x,
                params=params if stash else None,
                rest=stage.rest if stash else None,
            )
        return y, stage.replace(rest=rest, pending=stage.pending + (record,))

    def _backward_and_update(self, k, stage: StageState, cotangent: Message):
        """Stage k back-propagates its oldest record and updates; returns the input cotangent."""
        record, pending = stage.pending[0], stage.pending[1:]
        if record.batch != cotangent.batch:
            raise AssertionError(
                f"stage {k} holds batch {record.batch} but received the cotangent of batch "
                f"{cotangent.batch}; the pipeline state is corrupt"
            )
        if record.residuals is not None:
            grads, input_cotangent = self._run(
                k, "backward_kept", record.batch, record.residuals, cotangent.value
            )
        else:
            params, rest = (
                (record.params, record.rest)
                if record.params is not None
                else (stage.params, stage.rest)
            )
            grads, input_cotangent = self._run(
                k, "backward_recompute", record.batch, params, rest, record.inputs, cotangent.value
            )
        # The weights the gradient was taken at, for transforms that compensate
        # staleness; None means the current ones (and lets `update` donate them).
        stale = record.params if self._keeps_params else None
        params, opt_state = self._run(
            k, "update", record.batch, stage.params, stage.opt_state, grads, stale
        )
        return stage.replace(params=params, opt_state=opt_state, pending=pending), input_cotangent

    def _loss_and_update(self, state: PipelineState, stage: StageState, x, labels, batch: int):
        """The last stage: loss, backward and update in one dispatch."""
        k = self.num_stages - 1
        params, opt_state, rest, cotangent, metrics, finite = self._run(
            k,
            "loss_step",
            batch,
            stage.params,
            stage.rest,
            stage.opt_state,
            x,
            labels,
            state.finite,
        )
        stage = stage.replace(params=params, rest=rest, opt_state=opt_state)
        sent = None if k == 0 else Message(batch, self._put(cotangent, k - 1))
        return stage, sent, finite, {**metrics, "batch": batch}

    def _forward_in_order(self, state, x, labels):
        """BP and DDG: every stage forwards batch t in turn; the last takes its loss and updates.

        Returns the stage states, the cotangent the last stage sends, the finite
        flag and the metrics.
        """
        t, last = state.step, self.num_stages - 1
        stages = list(state.stages)
        for k in range(last):
            y, stages[k] = self._forward(k, stages[k], x, t)
            x = self._put(y, k + 1)
        stages[last], sent, finite, metrics = self._loss_and_update(
            state, stages[last], x, self._put(labels, last), t
        )
        return stages, sent, finite, metrics

    def _step_bp(self, state, x, labels):
        t, last = state.step, self.num_stages - 1
        stages, sent, finite, metrics = self._forward_in_order(state, x, labels)
        for k in reversed(range(last)):
            stages[k], cotangent = self._backward_and_update(k, stages[k], sent)
            sent = None if k == 0 else Message(t, self._put(cotangent, k - 1))
        return state.replace(step=t + 1, stages=tuple(stages), finite=finite), metrics

    def _step_ddg(self, state, x, labels):
        t, last = state.step, self.num_stages - 1
        stages, sent, finite, metrics = self._forward_in_order(state, x, labels)
        cotangents = [None] * self.num_stages
        if last > 0:
            cotangents[last - 1] = sent
        for k in range(last):
            received = state.cotangents[k]
            if received is None:
                continue
            stages[k], cotangent = self._backward_and_update(k, stages[k], received)
            if k > 0:
                cotangents[k - 1] = Message(received.batch, self._put(cotangent, k - 1))
        return state.replace(
            step=t + 1, stages=tuple(stages), cotangents=tuple(cotangents), finite=finite
        ), metrics

    def _step_fdg(self, state, x, labels):
        t, last = state.step, self.num_stages - 1
        stages = list(state.stages)
        activations = [None] * self.num_stages
        cotangents = [None] * self.num_stages
        arriving = (Message(t, x, labels),) + state.activations[1:]
        for k in range(last):
            received = state.cotangents[k]
            if received is not None:
                stages[k], cotangent = self._backward_and_update(k, stages[k], received)
                if k > 0:
                    cotangents[k - 1] = Message(received.batch, self._put(cotangent, k - 1))
            if arriving[k] is not None:
                y, stages[k] = self._forward(k, stages[k], arriving[k].value, arriving[k].batch)
                activations[k + 1] = Message(
                    arriving[k].batch, self._put(y, k + 1), self._put(arriving[k].labels, k + 1)
                )
        metrics, finite = {}, state.finite
        if arriving[last] is not None:
            message = arriving[last]
            stages[last], sent, finite, metrics = self._loss_and_update(
                state, stages[last], message.value, message.labels, message.batch
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

    def _fused_step_fn(self, params, rests, opt_states, x, labels, finite):
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
        finite = finite & jnp.isfinite(value)
        return list(new_params), new_rests, list(new_opt_states), {"loss": value, **metrics}, finite

    def _step_fused(self, state, x, labels):
        stages = state.stages
        fused_step = self._fused_step if self._timeline is None else self._fused_step_undonated
        args = (
            [s.params for s in stages],
            [s.rest for s in stages],
            [s.opt_state for s in stages],
            x,
            labels,
            state.finite,
        )
        params, rests, opt_states, metrics, finite = outputs = fused_step(*args)
        if self._timeline is not None:
            self._timeline.record(self.devices[0], 0, "fused_step", state.step, args, outputs)
        stages = tuple(StageState(p, r, o) for p, r, o in zip(params, rests, opt_states))
        return (
            state.replace(step=state.step + 1, stages=stages, finite=finite),
            {**metrics, "batch": state.step},
        )

    # ------------------------------------------------------- use the weights

    def predict(self, state: PipelineState, inputs) -> jax.Array:
        """The model's outputs in evaluation mode with each stage's current weights."""
        x = inputs
        for k, (fns, stage) in enumerate(zip(self.stages, state.stages)):
            x = fns.predict(stage.params, stage.rest, self._put(x, k))
        return x

    def evaluate(self, state: PipelineState, batch) -> dict[str, jax.Array]:
        """`loss_fn`'s loss and metrics on `batch` in evaluation mode (device arrays)."""
        inputs, labels = _split_batch(batch)
        outputs = self.predict(state, inputs)
        loss, metrics = self._loss(outputs, self._put(labels, self.num_stages - 1))
        return {"loss": loss, **metrics}

    @staticmethod
    def check_finite(state: PipelineState) -> None:
        """Raises FloatingPointError if any loss so far was NaN or infinite.

        This waits for the device: call it once an epoch, not every step.
        """
        if not bool(state.finite):
            raise FloatingPointError(
                f"A training loss was NaN or infinite at or before step {state.step}; lower the "
                "learning rate, shrink more (smaller beta), or check the data for bad values."
            )
