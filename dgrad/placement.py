"""Where each stage runs, and how values travel between stages and processes.

A pipeline of K stages with D data-parallel replicas gives stage k a group of
D devices, a `jax.sharding.Mesh` with one axis, `data`. On its group a stage's
parameters, non-parameter state, optimizer state and stashed weights are
replicated (`replicated(k)`); batches, activations, cotangents, kept inputs
and kept residuals with a batch axis are split along it (`sharded(k)`). Jitted
functions over these arrays compute the mean gradient over the whole batch and
BatchNorm statistics of the whole batch: XLA inserts the all-reduces, so the
numbers do not depend on D.

Under `jax.distributed` the groups may span processes. Every process runs the
same program; a function whose arrays live on other processes' devices returns
at once there. `move` carries values from one stage's group to another's:
`jax.device_put` inside a process, each replica's own copy where every replica
stays inside its process, and otherwise point-to-point transfers between the
processes (`jax.device_put` across hosts). `share` makes values readable on
every process (metrics, checkpoints) the same way, and `unshare` puts them
back. No move is a collective: on CPUs the processes' collectives (gloo) are
matched in the order each device runs them, which XLA does not keep between
programs in flight at once, and a move among them froze runs.

>>> import jax
>>> one = Placement(3, jax.devices()[:1])  # three stages sharing one device
>>> one.groups == ((jax.devices()[0],),) * 3
True
>>> two = Placement(2, jax.devices()[:4], data_parallel=2)
>>> [[d.id for d in group] for group in two.groups]
[[0, 1], [2, 3]]
>>> x = two.put_batch(jax.numpy.arange(8.0), 0)
>>> sorted(d.id for d in two.move(x, 0, 1).sharding.device_set)
[2, 3]
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from dgrad.options import PLACEMENTS

try:  # the batched copy `jax.device_put` ends in, without its per-call Python (~50 us a move)
    from jax._src.lib import xla_client as _xc

    _copy_to_devices = _xc.batched_copy_array_to_devices_with_sharding
    _REUSE_INPUT = _xc.ArrayCopySemantics.REUSE_INPUT  # what device_put asks for by default
except (ImportError, AttributeError):  # another jax: every move goes through jax.device_put
    _copy_to_devices = None

FAKE_DEVICES_HINT = (
    "On a CPU-only machine, ask for fake devices before JAX starts: "
    "jax.config.update('jax_num_cpu_devices', N) right after `import jax`."
)


def _resolve_data_parallel(data_parallel: int, num_groups: int, num_devices: int) -> int:
    if data_parallel != -1:
        return data_parallel
    if num_devices < num_groups:
        raise ValueError(
            f"data_parallel=-1 divides the devices between the stages, but {num_groups} stage "
            f"group(s) need more than the {num_devices} device(s) given. {FAKE_DEVICES_HINT}"
        )
    return num_devices // num_groups


def _groups(num_stages, devices, placement, data_parallel, fused):
    count = len(devices)
    if not isinstance(placement, str):
        return _explicit_groups(num_stages, devices, placement, data_parallel)
    if placement not in PLACEMENTS:
        raise ValueError(
            f"Unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)} or a list of "
            "device indices (or index lists) per stage."
        )
    num_groups = 1 if fused else num_stages
    replicas = _resolve_data_parallel(data_parallel, num_groups, count)
    if fused:
        if replicas > count:
            raise ValueError(
                f"data_parallel={replicas} needs {replicas} devices, got {count}. "
                f"{FAKE_DEVICES_HINT}"
            )
        return (tuple(_one_per_process_in_turn(devices)[:replicas]),) * num_stages, replicas
    if replicas == 1 and placement == "spread":
        used = min(count, num_stages)
        return tuple((devices[k * used // num_stages],) for k in range(num_stages)), 1
    if num_stages * replicas > count:
        raise ValueError(
            f"{num_stages} stages x {replicas} replicas need {num_stages * replicas} devices, "
            f"got {count}; lower data_parallel or num_stages (data_parallel=-1 uses every "
            f"device). {FAKE_DEVICES_HINT}"
        )
    if placement == "interleaved":
        groups = [
            tuple(devices[r * num_stages + k] for r in range(replicas)) for k in range(num_stages)
        ]
    else:
        groups = [tuple(devices[k * replicas : (k + 1) * replicas]) for k in range(num_stages)]
    return tuple(groups), replicas


def _one_per_process_in_turn(devices):
    """The devices reordered to take one from each process in turn (unchanged on one
    process), so that a group of the first n spans as many processes as it can."""
    seen: dict[int, int] = {}
    ranks = []
    for device in devices:
        seen[device.process_index] = seen.get(device.process_index, -1) + 1
        ranks.append(seen[device.process_index])
    return [device for _, device in sorted(zip(ranks, devices), key=lambda pair: pair[0])]


def _explicit_groups(num_stages, devices, placement, data_parallel):
    entries = list(placement)
    if len(entries) != num_stages:
        raise ValueError(
            f"placement lists {len(entries)} entries for {num_stages} stages; give exactly one "
            "device index (or list of indices) per stage."
        )
    groups = []
    for entry in entries:
        indices = [entry] if isinstance(entry, (int, np.integer)) else list(entry)
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
                raise ValueError(f"placement index {index!r} is not an integer.")
            if not 0 <= index < len(devices):
                raise ValueError(
                    f"placement index {index} is not a valid index into {len(devices)} devices."
                )
        groups.append(tuple(devices[i] for i in indices))
    sizes = sorted({len(g) for g in groups})
    if len(sizes) != 1 or sizes[0] == 0:
        raise ValueError(
            f"Every stage needs the same number of devices, but the placement gives groups of "
            f"sizes {[len(g) for g in groups]}; give each stage D devices."
        )
    if data_parallel not in (-1, 1, sizes[0]):
        raise ValueError(
            f"data_parallel={data_parallel} but the placement gives each stage {sizes[0]} "
            "device(s); make them agree (or leave data_parallel out)."
        )
    return tuple(groups), sizes[0]


class Placement:
    """Each stage's group of devices, and the moves between them.

    Args:
      num_stages: K.
      devices: the devices to use (default `jax.devices()`, all processes' devices).
      placement: `"spread"`: stage k on `devices[k*D:(k+1)*D]` (with D = 1 and
        fewer devices than stages, contiguous stages share a device);
        `"interleaved"`: replica r of stage k on `devices[r*K + k]`, so each run of
        K devices holds a whole pipeline (with devices listed by process, every
        process then holds every stage); `"one_per_device"`: like spread but
        never shares; or a list of K device indices (or K lists of D indices;
        with V > 1, one per device group).
      data_parallel: D, devices per stage; -1 uses them all (D = devices // K).
        Explicit index lists say D themselves (a D other than 1 or -1 must agree).
      fused: one group for all stages (fused backprop, data parallel over D).
      virtual_stages: V; the K*V stages are chunks, V to a group, and chunk j shares the
        group that `placement` gives stage `group_of(j)` of K.
      group_of: chunk j's group with V > 1 (default j mod K, interleaved 1F1B's; the
        pipeline passes its `Schedule.device_of`).

    >>> import jax, jax.numpy as jnp
    >>> [[d.id for d in g] for g in Placement(4, jax.devices()[:2], virtual_stages=2).groups]
    [[0], [1], [0], [1]]
    >>> v_shape = [0, 1, 1, 0].__getitem__  # ZB-V's
    >>> placed = Placement(4, jax.devices()[:2], virtual_stages=2, group_of=v_shape)
    >>> [[d.id for d in g] for g in placed.groups]
    [[0], [1], [1], [0]]
    >>> listed = Placement(4, jax.devices()[:2], [1, 0], virtual_stages=2, group_of=v_shape)
    >>> [[d.id for d in g] for g in listed.groups]  # the groups listed, the chunks in a V
    [[1], [0], [0], [1]]
    >>> shared = Placement(2, jax.devices()[:1])  # two stages on one device
    >>> shared.data_parallel, shared.groups[0] == shared.groups[1]
    (1, True)
    >>> x = shared.put_batch(jnp.ones((4, 3)), 0)
    >>> shared.move(x, 0, 1) is x  # the same group: nothing moves
    True
    >>> Placement(1, data_parallel=-1).data_parallel == jax.device_count()  # every device
    True
    """

    def __init__(
        self,
        num_stages: int,
        devices: Sequence[jax.Device] | None = None,
        placement: str | Sequence = "spread",
        *,
        data_parallel: int = 1,
        fused: bool = False,
        virtual_stages: int = 1,
        group_of: Callable[[int], int] | None = None,
    ):
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("devices is empty; pass at least one device or None for all.")
        for device in devices:
            if not isinstance(device, jax.Device):
                raise TypeError(
                    f"devices must hold jax.Device objects (from jax.devices()), got {device!r}."
                )
        if len(set(devices)) != len(devices):
            raise ValueError("devices lists a device twice; pass each device once.")
        self.num_stages = num_stages
        if virtual_stages > 1:  # chunk j on group_of(j)
            num_groups = num_stages // virtual_stages
            if not isinstance(placement, str) and len(placement) != num_groups:
                raise ValueError(
                    f"placement lists {len(placement)} entries for {num_stages} chunks = "
                    f"{num_groups} device groups x virtual_stages={virtual_stages}; give one "
                    f"device index (or list of indices) per group, {num_groups} in all: the "
                    "schedule puts each chunk on its group."
                )
            groups, self.data_parallel = _groups(
                num_groups, devices, placement, data_parallel, fused
            )
            group_of = group_of or (lambda j: j % len(groups))
            self.groups = tuple(groups[group_of(j)] for j in range(num_stages))
        else:
            self.groups, self.data_parallel = _groups(
                num_stages, devices, placement, data_parallel, fused
            )
        if fused and len(set(self.groups)) > 1:
            raise ValueError(
                "fused=True runs the whole step as one function on one device group, but the "
                f"placement gives {len(set(self.groups))} groups; use one group or fused=False."
            )
        for a in set(self.groups):
            for b in set(self.groups):
                if a != b and set(a) & set(b):
                    raise ValueError(
                        f"Stage device groups {[d.id for d in a]} and {[d.id for d in b]} "
                        "overlap; groups must be identical or disjoint."
                    )
        used = {d.process_index for group in self.groups for d in group}
        idle = sorted(set(range(jax.process_count())) - used)
        if idle:
            raise ValueError(
                f"Process(es) {idle} of {jax.process_count()} hold none of the pipeline's "
                f"devices ({num_stages} stages x {self.data_parallel} replicas); start fewer "
                "processes, or more stages or replicas."
            )
        meshes = {g: Mesh(np.array(g), ("data",)) for g in set(self.groups)}
        self.meshes = tuple(meshes[g] for g in self.groups)
        self._process = jax.process_index()
        # One sharding object per stage and kind: JAX caches its per-sharding facts (device
        # lists, addressability) on the object, so a fresh one per move costs every transfer.
        if self.data_parallel == 1:
            single = tuple(SingleDeviceSharding(group[0]) for group in self.groups)
            self._replicated, self._sharded = single, single
        else:
            self._replicated = tuple(NamedSharding(mesh, P()) for mesh in self.meshes)
            self._sharded = tuple(NamedSharding(mesh, P("data")) for mesh in self.meshes)
        self._routes = {}  # (src, dst) -> {source sharding: (target sharding, its devices)}

    def __repr__(self):
        groups = ", ".join("[" + " ".join(str(d.id) for d in g) + "]" for g in self.groups)
        return f"Placement({groups})"

    @property
    def devices(self) -> list[jax.Device]:
        """The first device of each stage's group."""
        return [group[0] for group in self.groups]

    def replicated(self, k: int) -> jax.sharding.Sharding:
        """A copy on each of stage k's devices (a single device's sharding when D = 1, which
        is what jitted functions give back there).

        >>> import jax
        >>> Placement(2, jax.devices()[:1]).replicated(1)  # D = 1: the stage's one device
        SingleDeviceSharding(device=CpuDevice(id=0), memory_kind=device)
        """
        return self._replicated[k]

    def sharded(self, k: int) -> jax.sharding.Sharding:
        """Split along the first (batch) axis over stage k's devices.

        >>> import jax
        >>> Placement(2, jax.devices()[:1]).sharded(0)  # D = 1: nothing to split over
        SingleDeviceSharding(device=CpuDevice(id=0), memory_kind=device)
        """
        return self._sharded[k]

    def is_local(self, k: int) -> bool:
        """Whether this process holds a device of stage k.

        >>> import jax
        >>> Placement(2, jax.devices()[:1]).is_local(1)  # one process holds every device
        True
        """
        return any(d.process_index == self._process for d in self.groups[k])

    def check_batch_size(self, batch_size: int) -> None:
        """Raises ValueError unless `batch_size` splits evenly between the D replicas.

        >>> import jax
        >>> Placement(1, jax.devices()[:1]).check_batch_size(7)  # D = 1: any batch splits
        """
        if batch_size % self.data_parallel:
            raise ValueError(
                f"The batch of {batch_size} examples does not split between "
                f"data_parallel={self.data_parallel} replicas; use a batch size divisible by "
                f"{self.data_parallel}."
            )

    # ------------------------------------------------------------- placing

    def put(self, tree, k: int):
        """A copy of `tree` replicated on stage k's devices (every process passes the same).

        >>> import jax, jax.numpy as jnp
        >>> placement = Placement(2, jax.devices()[:1])
        >>> params = placement.put({"w": jnp.ones(3)}, 1)
        >>> params["w"].sharding == placement.replicated(1)
        True
        """
        leaves, treedef = jax.tree.flatten(tree)
        return treedef.unflatten(_place(leaves, self.replicated(k)))

    def put_batch(self, tree, k: int):
        """`tree`'s arrays split along their first axis over stage k's devices.

        Arrays already placed so are returned as they are. Under several
        processes, host arrays must hold the whole batch on every process;
        `dgrad.data.Stream` builds batches from each process's own rows instead.

        >>> import jax, numpy as np
        >>> placement = Placement(2, jax.devices()[:1])
        >>> x = placement.put_batch(np.ones((4, 3)), 0)  # host arrays are copied over
        >>> type(x).__name__, x.sharding == placement.sharded(0)
        ('ArrayImpl', True)
        >>> placement.put_batch(x, 0) is x  # already in place
        True
        """
        sharding = self.sharded(k)

        def placed(leaf):
            is_array = isinstance(leaf, jax.Array)
            return is_array and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)

        leaves, treedef = jax.tree.flatten(tree)
        missing = [i for i, leaf in enumerate(leaves) if not placed(leaf)]
        if not missing:  # even an empty `device_put` costs the host a few microseconds
            return tree
        for i, copy in zip(missing, _place([leaves[i] for i in missing], sharding)):
            leaves[i] = copy
        return treedef.unflatten(leaves)

    # -------------------------------------------------------------- moving

    def move(self, tree, src: int, dst: int):
        """`tree` (placed on stage `src`'s group) placed alike on stage `dst`'s group.

        >>> import jax, jax.numpy as jnp
        >>> placement = Placement(2)  # with two devices or more, stage 1 has a device of its own
        >>> x = placement.put(jnp.arange(3.0), 0)
        >>> moved = placement.move(x, 0, 1)
        >>> list(moved.devices()) == [placement.devices[1]], moved.tolist()
        (True, [0.0, 1.0, 2.0])
        """
        if self.groups[src] == self.groups[dst]:
            return tree
        route = self._local_route(src, dst)
        if route is not None:
            leaves, treedef = jax.tree.flatten(tree)
            targets = [route.get(getattr(leaf, "sharding", None)) for leaf in leaves]
            if None not in targets:  # every leaf placed as stage src places it: copy at once
                shardings, devices = zip(*targets) if targets else ((), ())
                copies = _copy_to_devices(
                    leaves, list(devices), list(shardings), [_REUSE_INPUT] * len(leaves)
                )
                return treedef.unflatten(copies)
        source, target = self.groups[src], self.groups[dst]
        everything_here = all(d.process_index == self._process for d in source + target)
        every_replica_crosses = all(
            a.process_index != b.process_index for a, b in zip(source, target)
        )
        if everything_here or every_replica_crosses:
            leaves, treedef = jax.tree.flatten(tree)
            shardings = [self._target_sharding(leaf, dst) for leaf in leaves]
            if not everything_here:
                _computed(leaves)
            return treedef.unflatten(jax.device_put(leaves, shardings))  # one batched transfer
        return jax.tree.map(lambda leaf: self._move_leaf(leaf, src, dst), tree)

    def _local_route(self, src: int, dst: int):
        """For a move inside this process between groups of one size: each of stage src's
        shardings mapped to stage dst's alike, with its devices (the same shard of every
        array on each device, so a plain copy of the shards); None for any other move."""
        if (src, dst) not in self._routes:
            source, target = self.groups[src], self.groups[dst]
            here = all(d.process_index == self._process for d in source + target)
            route = None
            if here and _copy_to_devices is not None and len(source) == len(target):
                kinds = (self._replicated, self._sharded)
                try:
                    route = {
                        kind[src]: (
                            kind[dst],
                            kind[dst]._internal_device_list.addressable_device_list,
                        )
                        for kind in kinds
                    }
                except AttributeError:  # another jax: jax.device_put does the move
                    route = None
            self._routes[(src, dst)] = route
        return self._routes[(src, dst)]

    def _target_sharding(self, leaf, dst):
        return self.sharded(dst) if _split(leaf) else self.replicated(dst)

    def _move_leaf(self, leaf, src, dst):
        """One array to a group where some replicas cross processes and others stay: each
        replica's own transfer (JAX moves a whole array across hosts only if every shard
        crosses)."""
        source, target = self.groups[src], self.groups[dst]
        sharding = self._target_sharding(leaf, dst)
        crossing = [a.process_index != b.process_index for a, b in zip(source, target)]
        pieces = {shard.device: shard.data for shard in _computed(leaf).addressable_shards}
        shard_shape = sharding.shard_shape(leaf.shape)
        arrived = [
            jax.device_put(
                pieces[a] if a in pieces else _nothing_on(a, shard_shape, leaf.dtype),
                SingleDeviceSharding(b),
            )
            for a, b in zip(source, target)
            if crossing[source.index(a)] or a.process_index == self._process
        ]
        return jax.make_array_from_single_device_arrays(
            leaf.shape,
            sharding,
            [piece for piece in arrived if piece.is_fully_addressable],
            dtype=leaf.dtype,
        )


def _split(leaf) -> bool:
    """Whether `leaf` is split along the batch over its group (else it is whole on each device)."""
    return isinstance(leaf.sharding, NamedSharding) and leaf.sharding.spec != P()


def _place(leaves: list, sharding) -> list:
    """Copies of `leaves` placed by `sharding` (in one transfer within a process)."""
    if jax.process_count() == 1 or sharding.is_fully_addressable:
        if len(sharding.device_set) > 1:  # copied first: see `_own_copies`
            leaves = _own_copies(leaves)
        return jax.device_put(leaves, sharding, may_alias=False)
    hosts = [np.asarray(jax.device_get(leaf)) for leaf in leaves]
    return [
        jax.make_array_from_callback(host.shape, sharding, lambda i, h=host: h[i], dtype=host.dtype)
        for host in hosts
    ]


def _own_copies(leaves: list) -> list:
    """Copies of `leaves`' device arrays in place. Put onto several devices, JAX (0.10) keeps
    the source's own buffer as the copy on the source's device even with may_alias=False, and
    the first call that donates the placed array then deletes the source (a stage's initial
    weights, which the next `init` places again)."""
    return [
        jax.device_put(leaf, leaf.sharding, may_alias=False)
        if isinstance(leaf, jax.Array)
        else leaf
        for leaf in leaves
    ]


def _local_placeholder(shape, dtype, sharding):
    """An array of `sharding` with no data on this process (it holds none of its devices)."""
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def _computed(tree):
    """`tree` once its arrays on this process's devices are computed. A transfer to another
    process waits for this on the sending side: XLA's CPU runtime froze when it sent
    outputs of programs over several devices before they were done."""
    return jax.block_until_ready(tree)


def _nothing_on(device, shape, dtype):
    """An array on another process's `device`: what this process passes to a transfer it
    only watches."""
    return _local_placeholder(shape, dtype, SingleDeviceSharding(device))


def _process_mesh(source: jax.Device) -> Mesh:
    """One device per process, `source` for its own process."""
    devices = [
        source if p == source.process_index else jax.local_devices(process_index=p)[0]
        for p in range(jax.process_count())
    ]
    return Mesh(np.array(devices), ("hop",))


def share(tree):
    """`tree`'s arrays made readable on every process (the identity in one process).

    Replicated arrays, and arrays held by a single process, are gathered onto
    one device of each process; arrays that already span processes stay.

    >>> import jax.numpy as jnp
    >>> metrics = {"loss": jnp.ones(())}
    >>> share(metrics) is metrics  # one process: already readable
    True
    """
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(_share_leaf, tree)


def unshare(tree, target):
    """The inverse of `share` for restored values: each array placed as `target` says.

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.arange(3.0)
    >>> target = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    >>> unshare(share(x), target) is x  # one process: placed already
    True
    """
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(_unshare_leaf, tree, target)


def _share_leaf(leaf):
    if not isinstance(leaf, jax.Array):
        return leaf
    owners = {d.process_index for d in leaf.sharding.device_set}
    if len(owners) == jax.process_count():
        return leaf  # every process holds a part: readable by orbax as it is
    source = min(leaf.sharding.device_set, key=lambda d: d.id)
    if not (leaf.is_fully_replicated or len(owners) == 1):
        return _gathered(leaf, _process_mesh(source))
    if source.process_index == jax.process_index() and leaf.is_fully_replicated:
        whole = _computed(next(s.data for s in leaf.addressable_shards if s.device == source))
    elif source.process_index == jax.process_index():  # split over this process's devices
        whole = _computed(jax.device_put(leaf, SingleDeviceSharding(source)))
    else:
        whole = _nothing_on(source, leaf.shape, leaf.dtype)
    mesh = _process_mesh(source)
    copies = [
        whole if device == source else jax.device_put(whole, SingleDeviceSharding(device))
        for device in mesh.devices.flat
    ]
    return jax.make_array_from_single_device_arrays(
        leaf.shape,
        NamedSharding(mesh, P()),
        [copy for copy in copies if copy.is_fully_addressable],
        dtype=leaf.dtype,
    )


def _gathered(leaf, mesh: Mesh):
    """A copy of `leaf` (split over the devices of some processes) whole on one device of
    every process: each piece is sent to each process, which joins them."""
    mine = {shard.device: shard.data for shard in _computed(leaf).addressable_shards}
    index = leaf.sharding.devices_indices_map(leaf.shape)
    devices = sorted(leaf.sharding.device_set, key=lambda d: [(i.start or 0) for i in index[d]])
    wholes = []
    for target in mesh.devices.flat:
        pieces = [
            jax.device_put(
                mine[d]
                if d in mine
                else _nothing_on(d, leaf.sharding.shard_shape(leaf.shape), leaf.dtype),
                SingleDeviceSharding(target),
            )
            for d in devices
        ]
        if target.process_index == jax.process_index():
            wholes.append(jnp.concatenate(pieces, axis=0))
    return jax.make_array_from_single_device_arrays(
        leaf.shape, NamedSharding(mesh, P()), wholes, dtype=leaf.dtype
    )


def _unshare_leaf(leaf, target: jax.ShapeDtypeStruct):
    sharding = target.sharding
    if leaf.sharding == sharding:
        return leaf
    if not any(d.process_index == jax.process_index() for d in sharding.device_set):
        return _local_placeholder(leaf.shape, leaf.dtype, sharding)
    if sharding.is_fully_addressable:
        return jax.device_put(leaf.addressable_data(0), sharding)
    whole = np.asarray(leaf.addressable_data(0))  # restoring only: through the host is fine
    return jax.make_array_from_callback(
        leaf.shape, sharding, lambda index: whole[index], dtype=leaf.dtype
    )


def shared_target(target: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """Where `share` puts an array placed as `target`: how a checkpoint holds it.

    >>> import jax, jax.numpy as jnp
    >>> target = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=Placement(1).replicated(0))
    >>> shared_target(target) is target  # one process: a checkpoint holds it as placed
    True
    """
    owners = {d.process_index for d in target.sharding.device_set}
    if len(owners) == jax.process_count():
        return target
    source = min(target.sharding.device_set, key=lambda d: d.id)
    return jax.ShapeDtypeStruct(
        target.shape, target.dtype, sharding=NamedSharding(_process_mesh(source), P())
    )
