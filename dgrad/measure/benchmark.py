"""Side-by-side speed of training layouts, measured round-robin in one process.

Every case (a pipeline, or the plain JAX step that is the floor) is built,
compiled and filled first; then timed windows go round-robin over the cases,
so each round compares them under the same machine load. `measure` returns,
per case, the samples/s of every window, the host's milliseconds per step
(the CPU time of the thread that dispatches a step: what the host costs
when the devices are fast; time it spends blocked, e.g. waiting for a full
dispatch queue, is not counted),
and the cores busy (process CPU time over wall time). Each case steps on the batch
placed once where its step takes it, as the training command's stream hands batches
over (placed on its prefetch threads): copying a host batch every step would charge
the dispatching thread 0.1-0.2 ms of the copy no training step pays. `state_bytes_per_device`
is the memory a state holds on each device, counted from its arrays (the CPU
backend reports no peak); `peak_memory` is the backend's own peak where it
reports one (GPUs). `steady_allocator` keeps glibc's allocator from favouring
some cases over others on CPUs.

>>> import jax.numpy as jnp, optax
>>> from dgrad import models
>>> batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
>>> floor = plain_case("plain", models.mlp([6, 16, 3]), optax.sgd(0.1), batch)
>>> results = measure([floor], batch, windows=2, steps=2)
>>> len(results[0].rates), results[0].host_ms[0] > 0
(2, True)
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dgrad import losses


@dataclasses.dataclass
class Case:
    """One configuration to time: `step(state, batch) -> (state, metrics)` from `state`,
    on `batch` where it is given (placed where the step takes it), else on `measure`'s.

    >>> import jax.numpy as jnp
    >>> case = Case("count", 1, 1, lambda state, batch: (state + 1, {}), jnp.zeros(()))
    >>> measure([case], batch=(jnp.ones((4, 1)),), windows=3, steps=2)[0].state  # 3 x 2 steps
    Array(6., dtype=float32)
    >>> len(case.rates), len(case.host_ms), len(case.cores_busy)  # one per window
    (3, 3, 3)
    """

    name: str
    num_stages: int
    data_parallel: int
    step: Callable
    state: Any
    pipe: Any = None  # the Pipeline, when the case is one
    batch: Any = None
    rates: list[float] = dataclasses.field(default_factory=list)
    host_ms: list[float] = dataclasses.field(default_factory=list)
    cores_busy: list[float] = dataclasses.field(default_factory=list)


def pipeline_case(name: str, pipe, batch, *, warmup: int | None = None) -> Case:
    """A case of `pipe`, compiled and filled (2K + 2 steps) on `batch`, which it steps on
    placed on the first stage's devices as `dgrad.data.Stream` places it.

    >>> import jax.numpy as jnp, optax
    >>> import dgrad
    >>> from dgrad import models
    >>> batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    >>> pipe = dgrad.Pipeline(models.mlp([6, 16, 3], num_stages=2), optimizer=optax.sgd(0.1))
    >>> case = pipeline_case("fdg", pipe, batch)
    >>> case.name, case.num_stages, case.data_parallel, case.state.step  # filled: 2K + 2 steps
    ('fdg', 2, 1, 6)
    >>> case.batch[0].sharding == pipe.placement.sharded(0)
    True
    """
    batch = pipe.placement.put_batch(batch, 0)
    state = pipe.init(batch)
    for _ in range(2 * pipe.num_stages + 2 if warmup is None else warmup):
        state, _ = pipe.step(state, batch)
    jax.block_until_ready(state)
    groups = pipe.schedule.num_devices  # K: interleaved chunks share their groups
    return Case(name, groups, pipe.placement.data_parallel, pipe.step, state, pipe, batch)


def plain_case(
    name: str,
    stages: Sequence[nnx.Module],
    optimizer: optax.GradientTransformation,
    batch,
    loss_fn=losses.softmax_cross_entropy,
) -> Case:
    """The floor: the whole model's train step written the usual way with Flax's
    functional API and optax, on the first device, without dgrad.

    >>> import jax.numpy as jnp, optax
    >>> from dgrad import models
    >>> batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    >>> floor = plain_case("plain", models.mlp([6, 16, 3]), optax.sgd(0.1), batch)
    >>> state, metrics = floor.step(floor.state, batch)  # (params, rest, opt_state), donated
    >>> floor.num_stages, len(state), sorted(metrics)
    (1, 3, ['loss'])
    """
    model = nnx.Sequential(*stages)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    device = jax.devices()[0]
    # Copies: the step donates them, and `stages` keeps its own arrays.
    params, rest = jax.device_put((params, rest), device, may_alias=False)
    opt_state = jax.device_put(optimizer.init(params), device, may_alias=False)

    def train_step(params, rest, opt_state, inputs, labels):
        def loss(params):
            model = nnx.merge(graphdef, params, rest, copy=True)
            value, _ = loss_fn(model(inputs), labels)
            return value, nnx.split(model, nnx.Param, ...)[2]

        (value, rest), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, value

    jitted = jax.jit(train_step, donate_argnums=(0, 1, 2))

    def step(state, batch):
        params, rest, opt_state, loss = jitted(*state, *jax.device_put(batch, device))
        return (params, rest, opt_state), {"loss": loss}

    state, batch = (params, rest, opt_state), jax.device_put(batch, device)
    for _ in range(2):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    return Case(name, 1, 1, step, state, batch=batch)


def dispatched_per_step(pipe, step: int = 100) -> tuple[int, int]:
    """The stage calls and the moves between device groups the host dispatches in `step`
    (the batch's own placement and cut not counted).

    >>> import jax, optax
    >>> from dgrad import Pipeline, models
    >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="gpipe", microbatches=2,
    ...                 optimizer=optax.sgd(0.1), devices=jax.devices()[:2])
    >>> dispatched_per_step(pipe)  # 2 forwards, 2 backwards, 2 losses, 2 updates; 2 + 2 moves
    (8, 4)
    """
    calls = pipe.schedule.work(step)
    groups = pipe.placement.groups
    moves = sum(
        groups[stage] != groups[work.stage]
        for work in calls
        for _, stage, _ in work.sends(pipe.schedule)
    )
    return len(calls), moves


def _replayable_calls(pipe, state, batch) -> list[Callable[[], Any]]:
    """One step of `pipe` from `state` as the host dispatched it: each stage call, and each
    move between device groups as a bare `jax.device_put`, bound to its arguments and ready
    to dispatch again (compiled and warm)."""
    runs = []

    def wrap(k, name, fn):
        def recorded(*args):
            runs.append(functools.partial(fn, *args))
            return fn(*args)

        return recorded

    view = pipe.observed(wrap)
    placement = view.placement = copy.copy(pipe.placement)

    def recorded_move(tree, src, dst):
        if pipe.placement.groups[src] != pipe.placement.groups[dst]:
            leaves = jax.tree.leaves(tree)
            targets = [pipe.placement._target_sharding(x, dst) for x in leaves]
            runs.append(functools.partial(jax.device_put, leaves, targets))
        return pipe.placement.move(tree, src, dst)

    placement.move = recorded_move
    jax.block_until_ready(view.step(state, batch)[0])
    jax.block_until_ready([run() for run in runs])  # compiled (the watched copies) and warm
    return runs


def _host_seconds(sequence, *, wait_each: bool = False) -> float:
    """The host's CPU time running `sequence` as a bare loop (`out = run()`) does: each
    call dispatched (and waited for, where `wait_each`), the call before's outputs freed
    as the loop drops them (30-60 µs a ResNet-20 stage call, which the engine pays too),
    the last call's once the devices are done (each call's smallest output is held to
    wait on)."""
    seconds, output, flight = 0.0, None, []
    for run in sequence:
        start = time.thread_time()
        output = run()
        seconds += time.thread_time() - start
        flight.append(min(jax.tree.leaves(output), key=lambda leaf: leaf.size, default=None))
        if wait_each:
            jax.block_until_ready(output)
    jax.block_until_ready(flight)
    start = time.thread_time()
    del output
    return seconds + time.thread_time() - start


def dispatch_floor(pipe, state, batch, *, repeats: int = 20) -> tuple[float, float]:
    """The host's seconds per dispatched call at the floor, two ways: each stage call of
    one step of `pipe` from `state`, and each of its moves between device groups as a
    bare `jax.device_put`, repeated `repeats` times in a bare loop with the same
    arguments; and the step's calls and moves replayed in their order, `repeats` times,
    each time waited for (the same work with none of the engine's bookkeeping). The
    host's CPU time, as `measure` counts it, freeing the outputs included (the engine
    frees every array it is given back), divided by the calls and moves (see
    `dispatched_per_step`).

    >>> import jax, optax
    >>> import jax.numpy as jnp
    >>> from dgrad import Pipeline, models
    >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="gpipe", microbatches=2,
    ...                 optimizer=optax.sgd(0.1), devices=jax.devices()[:2])
    >>> batch = (jnp.ones((4, 4)), jnp.zeros((4,), jnp.int32))
    >>> each, in_order = dispatch_floor(pipe, pipe.init(batch), batch, repeats=2)
    >>> 0 < each < 0.1 and 0 < in_order < 0.1
    True
    """
    runs = _replayable_calls(pipe, state, batch)
    for run in runs:  # the heap grown to what `repeats` calls in flight hold, untimed
        _host_seconds([run] * repeats)
    each = sum(_host_seconds([run] * repeats) for run in runs)
    in_order = sum(_host_seconds(runs) for _ in range(repeats))  # a step's worth at a time
    return each / repeats / len(runs), in_order / repeats / len(runs)


def dispatch_by_queue(pipe, state, batch, *, repeats: int = 10) -> dict[str, float]:
    """The host's seconds per dispatched call of one step of `pipe` (its calls and moves,
    as `dispatch_floor` replays them) in four states of the devices' queues, which the
    host's cost of the same call depends on:

    - `repeated alone`: each call `repeats` times back to back (`dispatch_floor`'s first);
    - `in order`: the step's calls in their order, a step at a time (its second);
    - `in order, behind busy devices`: the same, each time behind a computation on every
      device of the step that lasts longer than the step's dispatch;
    - `each on an idle device`: the step's calls in order, each waited for before the next.

    >>> import jax, optax
    >>> import jax.numpy as jnp
    >>> from dgrad import Pipeline, models
    >>> pipe = Pipeline(models.mlp([4, 8, 3], num_stages=2), method="gpipe", microbatches=2,
    ...                 optimizer=optax.sgd(0.1), devices=jax.devices()[:2])
    >>> batch = (jnp.ones((4, 4)), jnp.zeros((4,), jnp.int32))
    >>> states = dispatch_by_queue(pipe, pipe.init(batch), batch, repeats=2)
    >>> list(states)
    ['repeated alone', 'in order', 'in order, behind busy devices', 'each on an idle device']
    >>> all(0 < seconds < 0.1 for seconds in states.values())
    True
    """
    runs = _replayable_calls(pipe, state, batch)
    for run in runs:  # the heap grown to what `repeats` calls in flight hold, untimed
        _host_seconds([run] * repeats)
    devices = {d for leaf in jax.tree.leaves(state) for d in leaf.devices()}
    blocks = [jax.device_put(np.full((256, 256), 1e-3, np.float32), d) for d in devices]
    jax.block_until_ready(_busy(blocks[0], 1))  # compiled
    busy_step = time.perf_counter()
    jax.block_until_ready(_busy(blocks[0], 1))
    unit = time.perf_counter() - busy_step  # one round of the busy computation
    start = time.perf_counter()
    _host_seconds(runs)
    rounds = max(1, int(4 * (time.perf_counter() - start) / max(unit, 1e-6)))
    jax.block_until_ready([_busy(block, rounds) for block in blocks])  # compiled

    def behind_busy_devices() -> float:
        busy = [_busy(block, rounds) for block in blocks]
        seconds = _host_seconds(runs)
        jax.block_until_ready(busy)
        return seconds

    totals = {
        "repeated alone": sum(_host_seconds([run] * repeats) for run in runs),
        "in order": sum(_host_seconds(runs) for _ in range(repeats)),
        "in order, behind busy devices": sum(behind_busy_devices() for _ in range(repeats)),
        "each on an idle device": sum(_host_seconds(runs, wait_each=True) for _ in range(repeats)),
    }
    return {name: seconds / repeats / len(runs) for name, seconds in totals.items()}


@functools.partial(jax.jit, static_argnums=1)
def _busy(block, rounds: int):
    """`rounds` dependent matrix products: a device kept busy for a while."""
    return jax.lax.fori_loop(0, rounds, lambda _, x: jnp.tanh(x @ block), block)


def measure(cases: Sequence[Case], batch, *, windows: int = 9, steps: int = 6) -> list[Case]:
    """Times `steps` steps of every case per window, round-robin for `windows` rounds,
    each round starting at another case, on the case's own placed batch where it has one
    (else on `batch`); fills the cases' `rates`, `host_ms` and `cores_busy` and returns them.

    >>> import jax.numpy as jnp, optax
    >>> from dgrad import models
    >>> batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    >>> floor = plain_case("plain", models.mlp([6, 16, 3]), optax.sgd(0.1), batch)
    >>> (result,) = measure([floor], batch, windows=2, steps=2)
    >>> result is floor, len(result.rates), all(rate > 0 for rate in result.rates)
    (True, 2, True)
    """
    for round_ in range(windows):
        shift = round_ % len(cases)
        for case in list(cases[shift:]) + list(cases[:shift]):
            state, fed = case.state, batch if case.batch is None else case.batch
            cpu, host, start = time.process_time(), time.thread_time(), time.perf_counter()
            for _ in range(steps):
                state, _ = case.step(state, fed)
            host = time.thread_time() - host
            jax.block_until_ready(state)
            wall = time.perf_counter() - start
            case.state = state
            case.rates.append(steps * len(jax.tree.leaves(batch)[0]) / wall)
            case.host_ms.append(1e3 * host / steps)
            case.cores_busy.append((time.process_time() - cpu) / wall)
    return list(cases)


def ratios(case: Case, baseline: Case) -> np.ndarray:
    """`case`'s samples/s over `baseline`'s, window by window (they ran side by side).

    >>> fast = Case("fast", 2, 1, None, None, rates=[200.0, 300.0])
    >>> slow = Case("slow", 1, 1, None, None, rates=[100.0, 200.0])
    >>> ratios(fast, slow)
    array([2. , 1.5])
    """
    return np.array(case.rates) / np.array(baseline.rates)


def summary(values) -> str:
    """`median [min-max]`.

    >>> summary([1.0, 3.0, 2.5])
    '2.50 [1.00-3.00]'
    """
    values = np.asarray(values)
    return f"{np.median(values):.2f} [{values.min():.2f}-{values.max():.2f}]"


def state_bytes_per_device(state) -> dict[int, int]:
    """Bytes of a state's arrays (weights, optimizer, kept records, messages) on each
    device; a buffer held twice (a stashed copy of unchanged weights) counts once.

    >>> import jax.numpy as jnp
    >>> weights = jnp.zeros((4, 4))  # 64 bytes
    >>> state_bytes_per_device({"w": weights, "b": jnp.zeros(4)})
    {0: 80}
    >>> state_bytes_per_device((weights, weights))  # the same buffer counts once
    {0: 64}
    """
    totals, seen = {}, set()
    for leaf in jax.tree.leaves(state):
        for shard in getattr(leaf, "addressable_shards", ()):
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                totals[shard.device.id] = totals.get(shard.device.id, 0) + shard.data.nbytes
    return dict(sorted(totals.items()))


def records_bytes_at_peak(pipe) -> dict[int, int]:
    """Bytes of the records each device's stages hold at the busiest moment of a step
    (`Schedule.most_kept` times one record's size, a replicated stage's replicas
    together, counted on its first device): what a method keeps for its backwards,
    which GPipe grows with M and 1F1B bounds by K.

    >>> import jax.numpy as jnp, optax
    >>> import dgrad
    >>> from dgrad import models
    >>> batch = (jnp.ones((8, 6)), jnp.zeros((8,), jnp.int32))
    >>> def peak(method):
    ...     pipe = dgrad.Pipeline(models.mlp([6, 16, 16, 3], num_stages=3), method=method,
    ...                           microbatches=4, optimizer=optax.sgd(0.1))
    ...     pipe.init(batch)
    ...     return records_bytes_at_peak(pipe)[0]
    >>> peak("gpipe") > peak("1f1b")  # all 4 microbatches against at most K - k = 3
    True
    """
    t = pipe.schedule.longest_wait() + len(pipe.schedule.units(0)) + 1  # well past the fill
    totals = {}
    for k, spec in enumerate(pipe.specs):
        if spec.record is None:
            continue
        one = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(spec.record))
        device = pipe.placement.groups[k][0].id
        totals[device] = totals.get(device, 0) + one * pipe.schedule.most_kept(k, t)
    return dict(sorted(totals.items()))


def peak_memory(devices) -> dict[int, float]:
    """Peak bytes in use per device where the backend reports it (GPUs do, CPUs do not).

    >>> import jax
    >>> peak_memory(jax.devices("cpu"))  # CPUs report no peak; GPUs give {id: bytes}
    {}
    """
    peaks = {}
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks[device.id] = stats["peak_bytes_in_use"]
    return peaks


def median(values) -> float:
    """The median of `values` as a float.

    >>> median([3, 1, 2]), median([1, 2, 3, 4])
    (2.0, 2.5)
    """
    return float(statistics.median(values))


def steady_allocator() -> bool:
    """Fixes glibc malloc's thresholds for the rest of the process (False without glibc).

    XLA's CPU backend takes every call's buffers from malloc. glibc moves its mmap
    threshold after each large free and hands freed heap back to the system, so
    what a step's allocations cost depends on what the process freed before: in
    one process holding a plain JAX step, fused BP and an FDG pipeline, fused BP
    measured 1.09-1.19x slower than the very same plain step, against 0.97-1.00x
    with fixed thresholds. Call it before JAX allocates; it keeps up to 1 GiB of
    freed memory for reuse.

    >>> steady_allocator() in (True, False)
    True
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False
    trim_threshold, top_pad, mmap_threshold = -1, -2, -3  # glibc's M_* parameters
    settings = {mmap_threshold: 32 << 20, trim_threshold: 1 << 30, top_pad: 64 << 20}
    return all(mallopt(parameter, value) == 1 for parameter, value in settings.items())
