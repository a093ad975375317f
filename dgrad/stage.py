"""One pipeline stage as pure functions of its state, each jitted once.

A stage is any Flax NNX module. `StageFunctions` splits it once into a graph
definition and its state (`params`: the `nnx.Param`s; `rest`: everything else,
e.g. BatchNorm statistics), both as plain nested dicts of arrays (`nnx.merge`
takes them as they are), and jits the few pure functions a pipeline calls, its
`Calls`:

- `forward`: the forward of a new batch, returning what the stage keeps for
  the batch's delayed backward (a `Residuals`, `Inputs` or `StashedInputs`
  record, by memory and weights policy);
- `step`: backward of an old batch, update, and forward of a new one, in one
  call (updating before the forward, as FDG does, or after it, as DDG does);
- `backward_update`: backward and update only (stage-by-stage backprop);
- `backward_sum`: backward, adding the gradient to a sum (microbatches);
- `backward_input`, `backward_weights`: the two halves of `backward_sum`, the
  input cotangent alone and the parameter gradient alone (zero-bubble's B and W;
  each compiles without the other's work);
- `apply_sum`: one update with the mean of a sum of gradients (the flush);
- `loss_step`: the last stage's loss, backward and update;
- `loss_sum`: the last stage's loss and backward, adding gradient and metrics
  to sums (microbatches);
- `loss_input`: the last stage's loss and input cotangent, keeping the loss's
  VJP for `backward_weights` (zero-bubble);
- `aux_step`: DGL: forward, the loss of the stage's own auxiliary head, backward
  and update (the stage is a `dgrad.models.AuxStage`);
- `predict`: the forward in evaluation mode;
- `gradient`, `loss_gradient`, `aux_gradient`: the parameter gradient alone
  (for the staleness probe);
- `recompute`: a kept record from what its forward was computed from (its
  `source`, which a checkpoint holds in its place).

Every call has one signature, `call(Vars, Given) -> (Vars, Out)`: the stage's state
it consumes (`Vars`, donated) and what it only reads (`Given`) in; the state it
changed and what it sends on (`Out`) out. A call is given only the fields it
touches. The options, the stage's place (its shardings: state replicated on the
stage's devices, what it sends split along the batch) and the layout of its
records are bound when it is compiled (`StageFunctions.compile`).

>>> import jax, jax.numpy as jnp, optax
>>> from flax import nnx
>>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), first=True)
>>> x = jnp.ones((4, 3))
>>> calls = fns.compile(fns.residual_layout(fns.params, fns.rest, x))
>>> params, opt_state = fns.params, fns.optimizer.init(fns.params)
>>> changed, out = calls.forward(Vars(), Given(params=params, rest=fns.rest, x=x))
>>> type(out.record).__name__, out.y.shape, sorted(changed.rest)  # a Linear has no statistics
('Residuals', (4, 2), [])
>>> changed, sent = calls.backward_update(
...     Vars(params=params, opt_state=opt_state),
...     Given(record=out.record, cotangent=jnp.ones_like(out.y)))
>>> sorted(changed.params), sent.cotangent is None  # the first stage sends no cotangent
(['bias', 'kernel'], True)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from dgrad.optim.compensation import reads_stale_params
from dgrad.optim.prediction import extrapolate_weights, predict_weights
from dgrad.options import Options

LossFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


@struct.dataclass
class Residuals:
    """The leaves of the forward's VJP, and the weights that forward used.

    The VJP is rebuilt from its leaves with the stage's `residual_layout`; its
    leaves hold whatever the backward needs of the weights. `params` is kept for
    the update's `stale_params` only where the stage's optimizer reads them
    (`dgrad.optim.reads_stale_params`, e.g. delay compensation), the probe
    measures how far the weights moved or the options ask for `record_sources`;
    else it is None, which saves a copy of the weights per kept batch. With
    `record_sources`, `inputs` and `rest` are the forward's input and statistics:
    with `params`, what the VJP is computed from again (`source`).

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), first=True)
    >>> _, _, record = fns.forward_record(fns.params, fns.rest, None, jnp.ones((4, 3)))
    >>> type(record).__name__, record.params  # plain SGD reads no stale weights: none kept
    ('Residuals', None)
    """

    residuals: list
    params: Any
    inputs: Any = None
    rest: Any = None

    @property
    def source(self) -> StashedInputs | None:
        """What this record's VJP was computed from, where it was kept (`record_sources`):
        what a checkpoint holds in its place.

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from dgrad.options import Options
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
        ...                      options=Options(record_sources=True))
        >>> _, _, record = fns.forward_record(fns.params, fns.rest, None, jnp.ones((4, 3)))
        >>> type(record.source).__name__, record.source.inputs.shape
        ('StashedInputs', (4, 3))
        """
        if self.inputs is None:
            return None
        return StashedInputs(self.inputs, self.params, self.rest)


@struct.dataclass
class Inputs:
    """The stage's input; the backward replays the forward on the stage's current weights.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from dgrad.options import Options
    >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                      options=Options(method="fr"))  # weights=current, memory=recompute
    >>> _, _, record = fns.forward_record(fns.params, fns.rest, None, jnp.ones((4, 3)))
    >>> type(record).__name__, record.inputs.shape
    ('Inputs', (4, 3))
    """

    inputs: Any


@struct.dataclass
class StashedInputs:
    """The stage's input with the weights and statistics its forward used (recomputed later).

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from dgrad.options import Options
    >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                      options=Options(memory="recompute"))  # weights=stash
    >>> _, _, record = fns.forward_record(fns.params, fns.rest, None, jnp.ones((4, 3)))
    >>> type(record).__name__, record.inputs.shape, sorted(record.params)
    ('StashedInputs', (4, 3), ['bias', 'kernel'])
    """

    inputs: Any
    params: Any
    rest: Any


Record = Residuals | Inputs | StashedInputs

PACKED_BYTES = 1 << 16  # the largest leaf a record packs (see ResidualLayout)


class ResidualLayout:
    """How a forward's VJP travels as a `Residuals` record: the VJP's structure, which of
    its leaves grow with the batch, and which travel packed, one flat array per dtype.

    A compiled call costs the host a share of its dispatch for every leaf it takes or
    gives back, and a VJP has many small leaves (a ResNet stage's per-channel statistics
    and scales: 63 of its 108 leaves hold 0.1 MiB of 34). The small ones that do not grow
    with the batch (at most `PACKED_BYTES` each) are kept concatenated; `unpack` cuts
    them out again, exactly. Tracing is deterministic, so every forward of the same shapes
    gives the same layout; it is bound into the backward calls when they are compiled.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> fns = StageFunctions(nnx.BatchNorm(3, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    >>> x = jnp.ones((8, 3))
    >>> layout = fns.residual_layout(fns.params, fns.rest, x)
    >>> _, _, record = fns.forward_record(fns.params, fns.rest, None, x)
    >>> layout.num_leaves, len(record.residuals)  # six small leaves kept in one array
    (8, 3)
    >>> vjp = layout.unpack(record.residuals)  # the VJP again, to back-propagate through
    >>> grads, dx = vjp(jnp.ones((8, 3)))
    >>> sorted(grads), dx.shape
    (['bias', 'scale'], (8, 3))
    """

    __slots__ = ("treedef", "batch_major", "packed", "_positions", "_key")

    def __init__(self, treedef, batch_major=None, packed=()):
        self.treedef = treedef
        self.batch_major = tuple(batch_major or (False,) * treedef.num_leaves)
        self.packed = tuple(packed)  # (leaf index, shape, dtype) of each packed leaf
        inside = {i for i, _, _ in self.packed}
        apart = iter(range(treedef.num_leaves))  # the next position of a leaf kept apart
        self._positions = tuple(
            None if i in inside else next(apart) for i in range(treedef.num_leaves)
        )
        self._key = (treedef, self.batch_major, self.packed)

    @classmethod
    def of(cls, shapes, twice, rows: int):
        """The layout of a VJP given as shapes: `shapes` for a batch of `rows`, `twice` for
        one of 2 * `rows`. A leaf is batch-major when its first axis is the batch's in both
        (a weight of that length stays whole).

        >>> import jax, jax.numpy as jnp
        >>> shapes = [jax.ShapeDtypeStruct((4, 3), jnp.float32),  # grows with the batch
        ...           jax.ShapeDtypeStruct((3,), jnp.float32)]
        >>> twice = [jax.ShapeDtypeStruct((8, 3), jnp.float32), shapes[1]]
        >>> layout = ResidualLayout.of(shapes, twice, rows=4)
        >>> layout.batch_major, layout.packed
        ((True, False), ((1, (3,), dtype('float32')),))
        """
        leaves, treedef = jax.tree.flatten(shapes)
        doubled = jax.tree.leaves(twice)
        batch_major = [
            bool(a.shape) and a.shape[0] == rows and b.shape[0] == 2 * rows
            for a, b in zip(leaves, doubled)
        ]
        packed = [
            (i, tuple(a.shape), np.dtype(a.dtype))
            for i, (a, b) in enumerate(zip(leaves, doubled))
            if a.shape == b.shape
            and np.prod(a.shape, dtype=int) * np.dtype(a.dtype).itemsize <= PACKED_BYTES
        ]
        return cls(treedef, batch_major, packed)

    @property
    def num_leaves(self) -> int:
        """How many leaves the VJP has (a record holds fewer where some are packed).

        >>> import jax, jax.numpy as jnp
        >>> ResidualLayout(jax.tree.structure([1, 2])).num_leaves
        2
        """
        return self.treedef.num_leaves

    @property
    def num_stored(self) -> int:
        """How many arrays a record holds: the leaves kept apart, then one per packed dtype.

        >>> import jax, jax.numpy as jnp
        >>> ResidualLayout(jax.tree.structure([0, 0]), packed=[(1, (2,), jnp.float32)]).num_stored
        2
        """
        return self.num_leaves - len(self.packed) + len(self._dtypes())

    def position(self, i: int) -> int | None:
        """Where the VJP's leaf `i` stands among a record's arrays; None where it is packed.

        >>> import jax, jax.numpy as jnp
        >>> layout = ResidualLayout(jax.tree.structure([0, 0, 0]), packed=[(1, (2,), jnp.float32)])
        >>> [layout.position(i) for i in range(3)]
        [0, None, 1]
        """
        return self._positions[i]

    def _dtypes(self):
        return list(dict.fromkeys(dtype for _, _, dtype in self.packed))

    def pack(self, leaves: list) -> list:
        """The record's arrays: the leaves not packed, in order, then one flat array per dtype.

        >>> import jax, jax.numpy as jnp
        >>> layout = ResidualLayout(jax.tree.structure([0, 0]), packed=[(1, (2,), jnp.float32)])
        >>> layout.pack([jnp.zeros((4, 3)), jnp.ones(2)])[1]
        Array([1., 1.], dtype=float32)
        """
        if not self.packed:
            return list(leaves)
        kept = [leaf for leaf, at in zip(leaves, self._positions) if at is not None]
        flats = [
            jnp.concatenate([jnp.ravel(leaves[i]) for i, _, d in self.packed if d == dtype])
            for dtype in self._dtypes()
        ]
        return kept + flats

    def unpack(self, stored: list):
        """The VJP whose leaves `pack` stored as `stored`.

        >>> import jax, jax.numpy as jnp
        >>> layout = ResidualLayout(jax.tree.structure([0, 0]), packed=[(1, (2,), jnp.float32)])
        >>> layout.unpack(layout.pack([jnp.zeros(3), jnp.ones(2)]))
        [Array([0., 0., 0.], dtype=float32), Array([1., 1.], dtype=float32)]
        """
        if not self.packed:
            return jax.tree.unflatten(self.treedef, stored)
        dtypes = self._dtypes()
        flat_of = dict(zip(dtypes, stored[len(stored) - len(dtypes) :]))
        offsets, leaves = dict.fromkeys(dtypes, 0), {}
        for i, shape, dtype in self.packed:
            size = int(np.prod(shape, dtype=int))
            start = offsets[dtype]
            leaves[i] = flat_of[dtype][start : start + size].reshape(shape)
            offsets[dtype] = start + size
        ordered = [leaves[i] if at is None else stored[at] for i, at in enumerate(self._positions)]
        return jax.tree.unflatten(self.treedef, ordered)

    def __eq__(self, other):
        return self is other or (isinstance(other, ResidualLayout) and self._key == other._key)

    __hash__ = None  # bound into a stage's functions, never a static argument

    def __repr__(self):
        return f"ResidualLayout({self.num_leaves} leaves, {len(self.packed)} packed)"


@struct.dataclass
class Vars:
    """A stage's state as a call takes it and gives it back: the call is given the fields
    it donates (consumes) and returns those it changes; None where it does not (no
    leaves, nothing to dispatch). `metrics` and `finite` are the last stage's: the sums of
    the step's metrics and whether every loss so far was finite.

    >>> import jax.numpy as jnp
    >>> Vars(params={"w": jnp.ones(2)}).replace(grad_sum={"w": jnp.zeros(2)}).rest is None
    True
    """

    params: Any = None
    rest: Any = None
    opt_state: Any = None
    grad_sum: Any = None
    metrics: Any = None
    finite: Any = None


@struct.dataclass
class Given:
    """What a call reads without consuming: the weights, statistics and optimizer state it
    only reads, its input `x` and `labels`, the `record` kept by its batch's forward and
    the `cotangent` received for it, the weights a gradient was taken at (`stale`), and
    how many gradients a sum holds (`count`). `update_first` (static) is FDG's order in
    `step`: the update before the forward.

    >>> import jax.numpy as jnp
    >>> Given(x=jnp.ones((4, 3))).record is None
    True
    """

    params: Any = None
    rest: Any = None
    opt_state: Any = None
    x: Any = None
    labels: Any = None
    record: Any = None
    cotangent: Any = None
    stale: Any = None
    count: Any = None
    finite: Any = None
    update_first: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class Out:
    """What a call sends beyond its stage: `y` on to the next stage, `cotangent` back to
    the one before, the `record` its stage keeps for the batch's backward, the `seed` of
    the loss's VJP (zero-bubble's last stage) and the gradient `grads` (the probe's).

    >>> Out().y is None
    True
    """

    y: Any = None
    cotangent: Any = None
    record: Any = None
    seed: Any = None
    grads: Any = None


class Calls(NamedTuple):
    """A stage's jitted functions (see the module docstring for what each does), each
    `function(Vars, Given) -> (Vars, Out)`, donating the `Vars` it is given.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), first=True)
    >>> x = jnp.ones((4, 3))
    >>> calls = fns.compile(fns.residual_layout(fns.params, fns.rest, x))
    >>> _, out = calls.forward(Vars(), Given(params=fns.params, rest=fns.rest, x=x))
    >>> state, _ = calls.backward_sum(
    ...     Vars(), Given(record=out.record, cotangent=jnp.ones_like(out.y)))
    >>> state.grad_sum["bias"]  # d(sum of outputs)/d(bias): one per row of the batch
    Array([4., 4.], dtype=float32)
    """

    forward: Callable
    step: Callable
    backward_update: Callable
    backward_sum: Callable
    backward_input: Callable
    backward_weights: Callable
    apply_sum: Callable
    loss_step: Callable
    loss_sum: Callable
    loss_input: Callable
    aux_step: Callable
    predict: Callable
    gradient: Callable
    loss_gradient: Callable
    aux_gradient: Callable
    recompute: Callable


# The calls that back-propagate a kept record, and so read the stage's residual layout.
_READS_LAYOUT = (
    "step",
    "backward_update",
    "backward_sum",
    "backward_input",
    "backward_weights",
    "gradient",
)


def shape_dtype(a) -> jax.ShapeDtypeStruct:
    """`a`'s shape and dtype (an array, a tracer, or a Python or NumPy scalar).

    >>> import jax.numpy as jnp, numpy as np
    >>> shape_dtype(jnp.ones((2, 3))), shape_dtype(np.float32(1.5))
    (ShapeDtypeStruct(shape=(2, 3), dtype=float32), ShapeDtypeStruct(shape=(), dtype=float32))
    """
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.result_type(a))


def split_state(module: nnx.Module) -> tuple[dict, dict]:
    """`module`'s parameters and the rest of its state, as plain nested dicts of arrays.

    Plain dicts cross a jitted call in JAX's C++ pytree code; `nnx.Variable`s
    are flattened in Python, one by one, which costs the host milliseconds a
    step on a deep model.

    >>> from flax import nnx
    >>> params, rest = split_state(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
    >>> sorted(params), sorted(rest)
    (['bias', 'scale'], ['mean', 'var'])
    """
    _, params, rest = nnx.split(module, nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def _graphdef_in_mode(module: nnx.Module, train: bool):
    copy = nnx.merge(*nnx.split(module))
    copy.train() if train else copy.eval()
    return nnx.split(copy, nnx.Param, ...)[0]


def _constrain(tree, sharding):
    return tree if sharding is None else jax.lax.with_sharding_constraint(tree, sharding)


class StageFunctions:
    """The pure functions of one stage, and their jitted `Calls`.

    Args:
      module: the stage, an initialised NNX module. It is not modified.
      optimizer: this stage's optax transformation.
      options: the pipeline's `Options` (memory and weights policies, method).
      first: whether the stage sends no cotangent back (stage 0; every DGL stage).
      loss_fn: set on the last stage (`loss_step`) and on DGL stages (`aux_step`).
      staleness: the stage's weight staleness (for weight prediction).
      replicated: the sharding of the stage's state (`sharded`: of its batches).
      sharded: the sharding of the stage's batches, activations and cotangents.

    Attributes:
      params, rest: the module's initial state as plain nested dicts (`split_state`), not
        yet placed on a device.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), first=True)
    >>> sorted(fns.params), fns.rest  # a Linear layer has no state but its weights
    (['bias', 'kernel'], {})
    """

    def __init__(
        self,
        module: nnx.Module,
        optimizer: optax.GradientTransformation,
        *,
        options: Options | None = None,
        first: bool = False,
        loss_fn: LossFn | None = None,
        staleness: int = 0,
        replicated: jax.sharding.Sharding | None = None,
        sharded: jax.sharding.Sharding | None = None,
    ):
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"A stage must be a flax.nnx.Module, got {type(module).__name__}; build stages "
                "with flax.nnx (for example nnx.Sequential) or dgrad.models."
            )
        self.train_graph = _graphdef_in_mode(module, train=True)
        self.eval_graph = _graphdef_in_mode(module, train=False)
        self.params, self.rest = split_state(module)
        self.optimizer = optax.with_extra_args_support(optimizer)
        options = options or Options()
        self.options, self.first, self.loss_fn = options, first, loss_fn
        self.predict_ahead = staleness if options.predict is not None else 0
        self.replicated, self.sharded = replicated, sharded
        reads_stale = reads_stale_params(self.optimizer, self.params)
        if reads_stale and options.accumulate > 1:
            raise ValueError(
                f"accumulate={options.accumulate} steps once per {options.accumulate} "
                "gradients, each taken at other weights, so an update that reads stale_params "
                "(delay compensation) has no one set of them to read; use accumulate=1 with it."
            )
        # A record of the forward's VJP keeps what it was computed from (`Residuals.source`);
        # under memory="recompute" every record already is its forward's input.
        self.keeps_sources = options.record_sources and options.memory != "recompute"
        self.keeps_forward_weights = (
            options.probe_every is not None or reads_stale or self.keeps_sources
        )
        # Where each output lives: the stage's state replicated on its devices, what it
        # sends split along the batch (a record's leaves are placed as it is made).
        self._out_shardings = (
            Vars(replicated, replicated, replicated, replicated, replicated, None),
            Out(sharded, sharded, None, None, None),
        )
        self._compiled: list[tuple[ResidualLayout | None, bool, Calls]] = []

    def compile(self, layout: ResidualLayout | None = None, *, donate: bool = True) -> Calls:
        """The stage's `Calls`, jitted once for records of `layout` (see `residual_layout`;
        None where no record of the forward's VJP is back-propagated) and kept; with
        `donate=False`, copies that donate nothing (for watching their inputs).

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), first=True)
        >>> _, out = fns.compile().predict(Vars(), Given(params=fns.params, rest=fns.rest,
        ...                                              x=jnp.ones((4, 3))))
        >>> out.y.shape, fns.compile() is fns.compile()
        ((4, 2), True)
        """
        for bound, donated, calls in self._compiled:
            if bound == layout and donated == donate:
                return calls
        jit = {"out_shardings": self._out_shardings}
        if donate:
            jit["donate_argnames"] = "state"
        calls = Calls(
            *(
                jax.jit(
                    functools.partial(function, layout=layout)
                    if name in _READS_LAYOUT
                    else function,
                    **jit,
                )
                for name, function in zip(
                    Calls._fields, (getattr(self, f"_{name}") for name in Calls._fields)
                )
            )
        )
        self._compiled.append((layout, donate, calls))
        return calls

    def forward_reads(self, opt_state):
        """The optimizer state `forward` reads: `opt_state` where the stage predicts the
        weights it forwards with, else None. A leaf a compiled call never reads still
        costs the host its share of every dispatch.

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9))
        >>> fns.forward_reads(fns.optimizer.init(fns.params)) is None  # no weight prediction
        True
        """
        return opt_state if self.predict_ahead else None

    def backward_reads(self, params, rest):
        """The weights and statistics a backward reads besides its record: the current ones
        where the record replays the forward (memory="recompute"), else none (None, None),
        since a record of the forward's VJP holds all the backward needs.

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        >>> fns.backward_reads(fns.params, fns.rest)  # memory="keep": the VJP's leaves suffice
        (None, None)
        """
        return (params, rest) if self.options.memory == "recompute" else (None, None)

    def residual_layout(self, params, rest, x) -> ResidualLayout:
        """How `forward` keeps the VJP of a forward of `x` (shapes suffice): see
        `ResidualLayout`. The backward rebuilds the VJP with it.

        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        >>> x = jnp.ones((4, 3))
        >>> layout = fns.residual_layout(fns.params, fns.rest, x)
        >>> layout.batch_major  # the kernel does not grow with the batch; the input does
        (False, True)
        >>> _, out = fns.compile(layout).forward(Vars(), Given(params=fns.params, x=x, rest={}))
        >>> jax.tree.map(jnp.shape, out.record.residuals)  # the kernel (3 x 2) kept flat
        [(4, 3), (6,)]
        """
        rows = jnp.shape(x)[0]
        twice = self._vjp_shapes(params, rest, x, 2 * rows)
        return ResidualLayout.of(self._vjp_shapes(params, rest, x), twice, rows)

    def _vjp_shapes(self, params, rest, x, batch_size=None):
        """The VJP of a forward of `x` (with `batch_size` rows, default x's) as shapes."""
        params, rest, x = jax.tree.map(shape_dtype, (params, rest, x))
        if batch_size is not None:
            x = x.update(shape=(batch_size, *x.shape[1:]))
        return jax.eval_shape(lambda p, r, h: self._vjp(p, r, h)[1], params, rest, x)

    def _split_like_the_batch(self, residuals, layout: ResidualLayout):
        """`residuals` with every leaf that grows with the batch split along it.

        Left alone, the compiler may replicate such a leaf on every replica.
        """
        if self.sharded is None or len(self.sharded.device_set) == 1:
            return residuals  # nothing to split
        return [
            _constrain(leaf, self.sharded) if grows else leaf
            for leaf, grows in zip(residuals, layout.batch_major)
        ]

    # ------------------------------------------------------- the stage's maths

    def apply(self, params, rest, x, train: bool = True):
        """Runs the stage; returns its output and its updated non-parameter state.

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> fns = StageFunctions(nnx.BatchNorm(2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        >>> y, rest = fns.apply(fns.params, fns.rest, jnp.array([[1.0, 2.0], [3.0, 6.0]]))
        >>> y.shape, rest["mean"]  # training mode: the running mean moved
        ((2, 2), Array([0.02, 0.04], dtype=float32))
        """
        model = nnx.merge(self.train_graph if train else self.eval_graph, params, rest, copy=True)
        y = model(x)
        return y, split_state(model)[1]

    def apply_optimizer(self, params, opt_state, grads, stale_params=None):
        """One optimizer step; `stale_params` (the weights the gradient was taken at,
        default `params`) reaches transforms that ask for it, e.g. delay compensation.

        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        >>> grads = jax.tree.map(jnp.ones_like, fns.params)
        >>> params, _ = fns.apply_optimizer(fns.params, fns.optimizer.init(fns.params), grads)
        >>> params["bias"]  # 0 - 0.1 * 1
        Array([-0.1, -0.1], dtype=float32)
        """
        stale_params = params if stale_params is None else stale_params
        updates, opt_state = self.optimizer.update(
            grads, opt_state, params, stale_params=stale_params
        )
        params = optax.apply_updates(params, updates)
        return _constrain(params, self.replicated), _constrain(opt_state, self.replicated)

    def _vjp(self, params, rest, x):
        """`(y, vjp, new_rest)`, differentiating w.r.t. params (and x unless first)."""
        apply = self.apply
        if self.options.memory == "dots":
            apply = jax.checkpoint(
                apply, policy=jax.checkpoint_policies.dots_saveable, static_argnums=(3,)
            )
        if self.first:
            return jax.vjp(lambda p: apply(p, rest, x, True), params, has_aux=True)
        return jax.vjp(lambda p, h: apply(p, rest, h, True), params, x, has_aux=True)

    def _forward_weights(self, params, opt_state):
        if not self.predict_ahead:
            return params
        if self.options.predict == "update":
            return extrapolate_weights(params, opt_state, self.predict_ahead)
        return predict_weights(params, opt_state, self.predict_ahead, self.options.predict_lr)

    def forward_record(self, params, rest, opt_state, x):
        """Forwards `x`; returns the output, the new statistics and the record to keep.

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        >>> y, rest, record = fns.forward_record(fns.params, fns.rest, None, jnp.ones((4, 3)))
        >>> y.shape, type(record).__name__
        ((4, 2), 'Residuals')
        """
        return self._forward_at(self._forward_weights(params, opt_state), rest, x)

    def _forward_at(self, params, rest, x):
        """`forward_record` at the weights `params` the forward uses (predicted already)."""
        if self.options.memory == "recompute":
            y, new_rest = self.apply(params, rest, x)
            inputs = _constrain(x, self.sharded)
            if self.options.weights == "current":
                record = Inputs(inputs)
            else:
                record = StashedInputs(inputs, params, rest)
        else:
            y, vjp, new_rest = self._vjp(params, rest, x)
            layout = self.residual_layout(params, rest, x)
            residuals = layout.pack(self._split_like_the_batch(jax.tree.leaves(vjp), layout))
            record = Residuals(residuals, params if self.keeps_forward_weights else None)
            if self.keeps_sources:
                record = record.replace(inputs=_constrain(x, self.sharded), rest=rest)
        return y, new_rest, record

    def _backward(self, record: Record, params, rest, cotangent, layout):
        """The parameter gradient and input cotangent of `record`'s batch (`layout`: see
        `residual_layout`; used for `Residuals`)."""
        if isinstance(record, Residuals):
            cotangents = layout.unpack(record.residuals)(cotangent)
        else:
            if isinstance(record, StashedInputs):
                params, rest = record.params, record.rest
            cotangents = self._vjp(params, rest, record.inputs)[1](cotangent)
        return (cotangents[0], None) if self.first else cotangents

    @staticmethod
    def _stale(record: Record):
        """The weights `record`'s gradient is taken at; None means the current ones."""
        return None if isinstance(record, Inputs) else record.params

    def _backward_and_update(self, params, rest, opt_state, record, cotangent, layout):
        grads, input_cotangent = self._backward(record, params, rest, cotangent, layout)
        params, opt_state = self.apply_optimizer(params, opt_state, grads, self._stale(record))
        return params, opt_state, input_cotangent

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

    def _loss_vjp(self, params, rest, x, labels):
        """`(loss, vjp, (metrics, new_rest))` of the last stage, w.r.t. params and x."""

        def loss(params, x):
            y, new_rest = self.apply(params, rest, x)
            value, metrics = self.loss_fn(y, labels)
            return value, (metrics, new_rest)

        return jax.vjp(loss, params, x, has_aux=True)

    def loss_residual_layout(self, params, rest, x, labels) -> ResidualLayout:
        """How `loss_input` keeps the loss's VJP: all its leaves as they are.

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from dgrad import losses
        >>> fns = StageFunctions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
        ...                      loss_fn=losses.softmax_cross_entropy)
        >>> x, labels = jnp.ones((4, 3)), jnp.array([0, 1, 0, 1])
        >>> _, out = fns.compile().loss_input(Vars(), Given(
        ...     params=fns.params, rest=fns.rest, x=x, labels=labels, finite=True))
        >>> fns.loss_residual_layout(fns.params, fns.rest, x, labels).num_leaves == len(
        ...     out.record.residuals)
        True
        """
        shapes = jax.tree.map(shape_dtype, (params, rest, x, labels))
        return ResidualLayout(
            jax.tree.structure(jax.eval_shape(lambda *a: self._loss_vjp(*a)[1], *shapes))
        )

    def _auxiliary_loss(self, params, rest, x, labels):
        model = nnx.merge(self.train_graph, params, rest, copy=True)
        y, logits = model.auxiliary(x)
        value, metrics = self.loss_fn(logits, labels)
        return value, (y, {"loss": value, **metrics}, split_state(model)[1])

    # --------------------------------- the calls: (Vars, Given) -> (Vars, Out)

    def _forward(self, state: Vars, given: Given):
        y, rest, record = self.forward_record(given.params, given.rest, given.opt_state, given.x)
        return Vars(rest=rest), Out(y=y, record=record)

    def _step(self, state: Vars, given: Given, layout=None):
        """Backward + update of `given.record`'s batch and forward of `given.x`, the update
        first if `given.update_first` (FDG), else the forward first (DDG)."""
        params, rest, opt_state = state.params, state.rest, state.opt_state
        backward = (given.record, given.cotangent, layout)
        if given.update_first:
            params, opt_state, cotangent = self._backward_and_update(
                params, rest, opt_state, *backward
            )
            y, rest, kept = self.forward_record(params, rest, opt_state, given.x)
        else:
            y, rest, kept = self.forward_record(params, rest, opt_state, given.x)
            params, opt_state, cotangent = self._backward_and_update(
                params, rest, opt_state, *backward
            )
        return Vars(params, rest, opt_state), Out(y=y, cotangent=cotangent, record=kept)

    def _backward_update(self, state: Vars, given: Given, layout=None):
        """Back-propagates `given.record`'s batch and updates (`given.rest`: the statistics
        a recomputed forward reads)."""
        params, opt_state, cotangent = self._backward_and_update(
            state.params, given.rest, state.opt_state, given.record, given.cotangent, layout
        )
        return Vars(params=params, opt_state=opt_state), Out(cotangent=cotangent)

    def _backward_sum(self, state: Vars, given: Given, layout=None):
        """Back-propagates `given.record`'s batch, adding its parameter gradient to
        `state.grad_sum` (started where it is None)."""
        grads, cotangent = self._backward(
            given.record, given.params, given.rest, given.cotangent, layout
        )
        if state.grad_sum is not None:
            grads = jax.tree.map(jnp.add, state.grad_sum, grads)
        return Vars(grad_sum=grads), Out(cotangent=cotangent)

    def _backward_input(self, state: Vars, given: Given, layout=None):
        """The input cotangent of `given.record`'s batch alone (zero-bubble's B)."""
        cotangent = self._backward(given.record, given.params, given.rest, given.cotangent, layout)[
            1
        ]
        return Vars(), Out(cotangent=cotangent)

    def _backward_weights(self, state: Vars, given: Given, layout=None):
        """The parameter gradient of `given.record`'s batch alone (zero-bubble's W) added to
        `state.grad_sum`; the record may be the last stage's `loss_input` VJP, the
        cotangent its seed."""
        return self._backward_sum(state, given, layout)[0], Out()

    def _apply_sum(self, state: Vars, given: Given):
        """One update of `given.params` with the mean of the `given.count` gradients in
        `state.grad_sum` (the weights before it may be kept: 2BW)."""
        grads = jax.tree.map(lambda g: g / given.count, state.grad_sum)
        params, opt_state = self.apply_optimizer(given.params, state.opt_state, grads, given.stale)
        return Vars(params=params, opt_state=opt_state), Out()

    def _loss_step(self, state: Vars, given: Given):
        """The last stage's loss, backward and update; `finite` and-ed with whether this
        loss is finite."""
        grads, cotangent, rest, metrics = self._loss_and_backward(
            state.params, state.rest, given.x, given.labels
        )
        params, opt_state = self.apply_optimizer(state.params, state.opt_state, grads)
        finite = given.finite & jnp.isfinite(metrics["loss"])
        return Vars(params, rest, opt_state, metrics=metrics, finite=finite), Out(
            cotangent=cotangent
        )

    def _loss_sum(self, state: Vars, given: Given):
        """The last stage's loss and backward, its gradient and metrics added to the sums
        (started where they are None)."""
        grads, cotangent, rest, metrics = self._loss_and_backward(
            given.params, given.rest, given.x, given.labels
        )
        if state.grad_sum is not None:
            grads = jax.tree.map(jnp.add, state.grad_sum, grads)
            metrics = jax.tree.map(jnp.add, state.metrics, metrics)
        finite = given.finite & jnp.isfinite(metrics["loss"])
        return Vars(rest=rest, grad_sum=grads, metrics=metrics, finite=finite), Out(
            cotangent=cotangent
        )

    def _loss_input(self, state: Vars, given: Given):
        """The last stage's loss and input cotangent, its metrics added to the sum (started
        where it is None); the loss's VJP is kept as the record `backward_weights` takes,
        with the `seed` it back-propagates (ones like the loss)."""
        value, vjp, (metrics, rest) = self._loss_vjp(
            given.params, given.rest, given.x, given.labels
        )
        seed = jnp.ones_like(value)
        cotangent = vjp(seed)[1]
        metrics = {"loss": value, **metrics}
        if state.metrics is not None:
            metrics = jax.tree.map(jnp.add, state.metrics, metrics)
        finite = given.finite & jnp.isfinite(value)
        record = Residuals(jax.tree.leaves(vjp), params=None)
        return Vars(rest=rest, metrics=metrics, finite=finite), Out(
            cotangent=cotangent, record=record, seed=seed
        )

    def _aux_step(self, state: Vars, given: Given):
        """DGL: forward, the auxiliary head's loss, backward and update; sends the output
        of the weights before the update."""
        grads, (y, metrics, rest) = jax.grad(self._auxiliary_loss, has_aux=True)(
            state.params, state.rest, given.x, given.labels
        )
        params, opt_state = self.apply_optimizer(state.params, state.opt_state, grads)
        return Vars(params, rest, opt_state, metrics=metrics), Out(y=jax.lax.stop_gradient(y))

    def _predict(self, state: Vars, given: Given):
        return Vars(), Out(y=self.apply(given.params, given.rest, given.x, train=False)[0])

    def _gradient(self, state: Vars, given: Given, layout=None):
        """The parameter gradient of `given.record`'s batch (what `backward_update` applies)."""
        grads = self._backward(given.record, given.params, given.rest, given.cotangent, layout)[0]
        return Vars(), Out(grads=grads)

    def _loss_gradient(self, state: Vars, given: Given):
        """The last stage's parameter gradient of its loss (what `loss_step` applies)."""
        grads = self._loss_and_backward(given.params, given.rest, given.x, given.labels)[0]
        return Vars(), Out(grads=grads)

    def _recompute(self, state: Vars, given: Given):
        """The record a forward kept, from its `source` (`given.record`; a checkpoint holds
        that in its place): the same forward at the same weights, computed again."""
        source = given.record
        return Vars(), Out(record=self._forward_at(source.params, source.rest, source.inputs)[2])

    def _aux_gradient(self, state: Vars, given: Given):
        """A DGL stage's gradient of its auxiliary loss (what `aux_step` applies)."""
        grads = jax.grad(self._auxiliary_loss, has_aux=True)(
            given.params, given.rest, given.x, given.labels
        )[0]
        return Vars(), Out(grads=grads)
