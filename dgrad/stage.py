"""One pipeline stage as jitted pure functions of its state.

A stage is any Flax NNX module. `StageFunctions` splits it once into a graph
definition and its state (`params`: the `nnx.Param`s; `rest`: everything else,
e.g. BatchNorm statistics) and compiles the handful of pure functions the
pipeline needs. Every function is jitted once and then only ever sees arrays
on the stage's own device, so it compiles exactly once.

>>> import jax, jax.numpy as jnp, optax
>>> from flax import nnx
>>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), first=True)
>>> params, rest = fns.params, fns.rest
>>> y, rest = fns.forward(params, rest, jnp.ones((4, 3)))
>>> grads, _ = fns.backward_recompute(params, rest, jnp.ones((4, 3)), jnp.ones_like(y))
>>> jax.tree.map(jnp.shape, grads)["kernel"]
Param(
  value=(3, 2)
)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dgrad.optim.prediction import predict_weights

LossFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def _graphdef_in_mode(module: nnx.Module, train: bool):
    copy = nnx.merge(*nnx.split(module))
    copy.train() if train else copy.eval()
    return nnx.split(copy, nnx.Param, ...)[0]


class StageFunctions:
    """The jitted pure functions of one stage.

    Args:
      module: the stage, an initialised NNX module. It is not modified.
      optimizer: this stage's optax transformation.
      first: whether this is stage 0 (its input needs no cotangent).
      loss_fn: set on the last stage; `loss_step` uses it.
      donate_params: let `update` reuse the old parameter buffers. Only safe
        when no stashed copy of the parameters outlives the update.

    Attributes:
      params, rest: the module's initial state, not yet placed on a device.
    """

    def __init__(
        self,
        module: nnx.Module,
        optimizer: optax.GradientTransformation,
        *,
        first: bool = False,
        loss_fn: LossFn | None = None,
        donate_params: bool = False,
    ):
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"A stage must be a flax.nnx.Module, got {type(module).__name__}; build stages "
                "with flax.nnx (for example nnx.Sequential) or dgrad.models."
            )
        self.train_graph = _graphdef_in_mode(module, train=True)
        self.eval_graph = _graphdef_in_mode(module, train=False)
        _, self.params, self.rest = nnx.split(module, nnx.Param, ...)
        self.optimizer = optax.with_extra_args_support(optimizer)
        self.first = first
        self.loss_fn = loss_fn
        self._residual_treedef = None

        self.forward = jax.jit(self._forward)
        self.forward_keep = jax.jit(self._forward_keep)
        self.backward_kept = jax.jit(self._backward_kept)
        self.backward_recompute = jax.jit(self._backward_recompute)
        # The last stage's parameters are never stashed: always donate them.
        self.loss_step = jax.jit(self._loss_step, donate_argnums=(0, 2))
        self.predict = jax.jit(self._predict)
        self.predict_weights = jax.jit(predict_weights, static_argnums=(2, 3))
        self._undonated = {}
        self.update = jax.jit(
            self.apply_optimizer, donate_argnums=(0, 1) if donate_params else (1,)
        )

    def jitted(self) -> dict[str, Any]:
        """The jitted functions by name (for compilation counting)."""
        names = (
            "forward",
            "forward_keep",
            "backward_kept",
            "backward_recompute",
            "loss_step",
            "predict",
            "predict_weights",
            "update",
        )
        return {name: getattr(self, name) for name in names}

    DONATING = ("update", "loss_step")

    def undonated(self, name: str):
        """A jitted copy of donating function `name` that donates nothing (for tracing)."""
        if name not in self._undonated:
            pure = {"update": self.apply_optimizer, "loss_step": self._loss_step}[name]
            self._undonated[name] = jax.jit(pure)
        return self._undonated[name]

    # Pure functions (also used un-jitted by the fused BP step).

    def apply(self, params, rest, x, train: bool = True):
        """Runs the stage; returns its output and its updated non-parameter state."""
        model = nnx.merge(self.train_graph if train else self.eval_graph, params, rest, copy=True)
        y = model(x)
        return y, nnx.split(model, nnx.Param, ...)[2]

    def apply_optimizer(self, params, opt_state, grads, stale_params=None):
        """One optimizer step; `stale_params` (the weights the gradient was taken at,
        default `params`) reaches transforms that ask for it, e.g. delay compensation."""
        stale_params = params if stale_params is None else stale_params
        updates, opt_state = self.optimizer.update(
            grads, opt_state, params, stale_params=stale_params
        )
        return optax.apply_updates(params, updates), opt_state

    def _vjp(self, params, rest, x):
        """`(y, new_rest, vjp)`, differentiating w.r.t. params (and x unless first)."""
        if self.first:
            return jax.vjp(lambda p: self.apply(p, rest, x), params, has_aux=True)
        return jax.vjp(lambda p, h: self.apply(p, rest, h), params, x, has_aux=True)

    @staticmethod
    def _split_cotangents(cotangents):
        return (cotangents[0], None) if len(cotangents) == 1 else cotangents

    def _forward(self, params, rest, x):
        return self.apply(params, rest, x)

    def _forward_keep(self, params, rest, x):
        # A VJP object handed out of jit has a fresh treedef at every call, which
        # would retrace the backward each time: hand out its leaves, and rebuild
        # it in `_backward_kept` from the treedef of the first trace.
        y, vjp, new_rest = self._vjp(params, rest, x)
        residuals, treedef = jax.tree.flatten(vjp)
        if self._residual_treedef is None:
            self._residual_treedef = treedef
        return y, new_rest, residuals

    def _backward_kept(self, residuals, cotangent):
        vjp = jax.tree.unflatten(self._residual_treedef, residuals)
        return self._split_cotangents(vjp(cotangent))

    def _backward_recompute(self, params, rest, x, cotangent):
        _, vjp, _ = self._vjp(params, rest, x)
        return self._split_cotangents(vjp(cotangent))

    def _loss_and_backward(self, params, rest, x, labels):
        def loss(params, x):
            y, new_rest = self.apply(params, rest, x)
            value, metrics = self.loss_fn(y, labels)
            return value, (metrics, new_rest)

        argnums = 0 if self.first else (0, 1)
        (value, (metrics, new_rest)), grads = jax.value_and_grad(
            loss, argnums=argnums, has_aux=True
        )(params, x)
        grads, cotangent = (grads, None) if self.first else grads
        return grads, cotangent, new_rest, {"loss": value, **metrics}

    def _loss_step(self, params, rest, opt_state, x, labels, finite):
        """Loss, backward and update of the last stage in one function.

        Returns the new params, optimizer state and rest, the input cotangent
        (None on a single stage), the metrics, and `finite` and-ed with whether
        this loss is finite.
        """
        grads, cotangent, rest, metrics = self._loss_and_backward(params, rest, x, labels)
        params, opt_state = self.apply_optimizer(params, opt_state, grads)
        finite = finite & jnp.isfinite(metrics["loss"])
        return params, opt_state, rest, cotangent, metrics, finite

    def _predict(self, params, rest, x):
        return self.apply(params, rest, x, train=False)[0]
