"""Record when each stage's work ran on each device, and draw it.

`Timeline.watch(pipe)` gives a view of a pipeline (`Pipeline.observed`) whose
every stage function call is recorded with its inputs and outputs; the engine
itself knows nothing of it. One watcher thread per device waits for the calls
in dispatch order, so the host never stalls: a call's end is when its outputs
became ready, its start the latest of its dispatch, the end of the previous
call on that device (a device runs its work in order) and the moment its
inputs became ready (they may come from another device). The watched
functions donate no buffers, so that every input and output can be waited on.

>>> import jax, jax.numpy as jnp, optax, dgrad
>>> from dgrad import models
>>> pipe = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), method="fdg",
...                       optimizer=optax.sgd(0.1))
>>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
>>> state, timeline = pipe.init(batch), Timeline()
>>> watched = timeline.watch(pipe)
>>> for _ in range(3):
...     state, _ = watched.step(state, batch)
>>> timeline.close()
>>> sorted({(e.stage, e.name, e.step) for e in timeline.events})
[(0, 'forward', 0), (0, 'forward', 1), (0, 'step', 2), (1, 'loss_step', 1), (1, 'loss_step', 2)]
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time

import jax

from dgrad.schedule import Unit


@dataclasses.dataclass(frozen=True)
class Event:
    """One stage function's run on a device; times in seconds from the timeline's start;
    `unit` the batch, or (batch, microbatch), that the timetable's call forwards (or, for a
    backward alone, back-propagates; None for a flush's update).

    >>> Event(device=0, stage=1, name="loss_step", step=3, start=0.25, end=0.75).seconds
    0.5
    """

    device: int
    stage: int
    name: str
    step: int
    start: float
    end: float
    unit: Unit | None = None

    @property
    def seconds(self) -> float:
        """How long the call ran."""
        return self.end - self.start


class Timeline:
    """Collects `Event`s from a traced pipeline; see the module docstring.

    >>> import json, os, tempfile
    >>> import jax, jax.numpy as jnp, optax, dgrad
    >>> from dgrad import models
    >>> pipe = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), method="fdg",
    ...                       optimizer=optax.sgd(0.1), devices=jax.devices()[:1])
    >>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
    >>> state, timeline = pipe.init(batch), Timeline()
    >>> watched = timeline.watch(pipe)
    >>> for _ in range(2):
    ...     state, _ = watched.step(state, batch)
    >>> timeline.close()
    >>> len(timeline.events), list(timeline.busy_fraction())  # both stages on device 0
    (3, [0])
    >>> path = os.path.join(tempfile.mkdtemp(), "trace.json")
    >>> timeline.chrome_trace(path)
    >>> with open(path) as f:
    ...     sorted(e["name"] for e in json.load(f)["traceEvents"] if e["ph"] == "X")
    ['forward', 'forward', 'loss_step']
    """

    def __init__(self):
        self.events: list[Event] = []
        self._origin = time.perf_counter()
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._step = 0
        self._units: list | None = None  # the current step's units, in dispatch order

    def watch(self, pipe):
        """A view of `pipe` (`Pipeline.observed`) whose stage function calls are recorded here.

        >>> import jax.numpy as jnp, optax, dgrad
        >>> from dgrad import models
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
        >>> timeline = Timeline()
        >>> watched = timeline.watch(pipe)
        >>> state, _ = watched.step(watched.init(batch), batch)
        >>> timeline.close()
        >>> [(e.stage, e.name, e.step) for e in timeline.events]
        [(0, 'loss_step', 0)]
        """

        def wrap(stage, name, function):
            device = pipe.placement.groups[stage][0]

            def recorded(*args):
                outputs = function(*args)
                self._record(device, stage, name, args, outputs)
                return outputs

            return recorded

        view = pipe.observed(wrap)
        step = view.step

        def counted_step(state, batch):
            self._step = state.step
            self._units = [call.shown_unit for call in pipe.schedule.work(state.step)]
            try:
                outputs = step(state, batch)
                left = len(self._units)
            finally:
                self._units = None
            if left:
                raise AssertionError(
                    f"step {state.step} made {left} fewer stage calls than its timetable has"
                )
            return outputs

        view.step = counted_step
        return view

    def _record(self, device: jax.Device, stage: int, name: str, inputs, outputs) -> None:
        dispatched = time.perf_counter()
        unit = None
        if self._units is not None:  # inside a step: the calls follow its timetable in order
            if not self._units:
                raise AssertionError(
                    f"step {self._step} made more stage calls than its timetable has entries"
                )
            unit = self._units.pop(0)
        if device.id not in self._queues:
            self._queues[device.id] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._watch, args=(device.id, self._queues[device.id]), daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self._queues[device.id].put((stage, name, self._step, unit, dispatched, inputs, outputs))

    def _watch(self, device: int, pending: queue.SimpleQueue) -> None:
        previous_end = 0.0
        while (item := pending.get()) is not None:
            stage, name, step, unit, dispatched, inputs, outputs = item
            jax.block_until_ready(inputs)
            inputs_ready = time.perf_counter() - self._origin
            jax.block_until_ready(outputs)
            end = time.perf_counter() - self._origin
            start = min(max(dispatched - self._origin, previous_end, inputs_ready), end)
            previous_end = end
            with self._lock:
                self.events.append(Event(device, stage, name, step, start, end, unit))

    def close(self) -> None:
        """Waits for every recorded call to finish; call before reading `events`.

        >>> import jax.numpy as jnp, optax, dgrad
        >>> from dgrad import models
        >>> pipe = dgrad.Pipeline(models.mlp([4, 3], num_stages=1), optimizer=optax.sgd(0.1))
        >>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
        >>> timeline = Timeline()
        >>> watched = timeline.watch(pipe)
        >>> state = watched.init(batch)
        >>> for _ in range(3):
        ...     state, _ = watched.step(state, batch)
        >>> timeline.close()  # now every call's event is in
        >>> [e.step for e in timeline.events]
        [0, 1, 2]
        """
        for pending in self._queues.values():
            pending.put(None)
        for thread in self._threads:
            thread.join()
        self._queues, self._threads = {}, []

    def busy_fraction(self) -> dict[int, float]:
        """Per device: time its work ran over the span from the first start to the last end.

        >>> timeline = Timeline()
        >>> timeline.events = [Event(0, 0, "forward", 0, 0.0, 1.0),
        ...                    Event(0, 1, "loss_step", 0, 1.0, 2.0),
        ...                    Event(1, 1, "loss_step", 1, 3.0, 4.0)]
        >>> timeline.busy_fraction()  # the span is 4 s: device 0 ran 2 s of it, device 1 one
        {0: 0.5, 1: 0.25}
        """
        if not self.events:
            return {}
        span = max(e.end for e in self.events) - min(e.start for e in self.events)
        busy = {}
        for e in self.events:
            busy[e.device] = busy.get(e.device, 0.0) + e.seconds
        return {d: b / span for d, b in sorted(busy.items())}

    def chrome_trace(self, path) -> None:
        """Writes the events as a Chrome / Perfetto trace (open in ui.perfetto.dev).

        >>> import json, os, tempfile
        >>> timeline = Timeline()
        >>> timeline.events = [Event(0, 0, "forward", 0, 0.0, 0.001)]
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     timeline.chrome_trace(os.path.join(directory, "trace.json"))
        ...     with open(os.path.join(directory, "trace.json")) as f:
        ...         trace = json.load(f)["traceEvents"]
        >>> [(e["name"], e["ph"]) for e in trace], trace[1]["dur"]  # a device's name, then a span
        ([('process_name', 'M'), ('forward', 'X')], 1000.0)
        """
        events = [
            {
                "name": e.name,
                "ph": "X",
                "ts": 1e6 * e.start,
                "dur": 1e6 * e.seconds,
                "pid": e.device,
                "tid": e.stage,
                "args": {"step": e.step, "unit": e.unit},
            }
            for e in self.events
        ]
        names = [
            {"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d}"}}
            for d in sorted({e.device for e in self.events})
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": names + events, "displayTimeUnit": "ms"}, f)

    def gantt(self, path, title: str = "") -> None:
        """Draws one row per device, a bar per stage function, colour by kind, a microbatch's
        index on its bar (PNG).

        >>> import os, tempfile
        >>> timeline = Timeline()
        >>> timeline.events = [Event(0, 0, "forward", 0, 0.0, 0.001),
        ...                    Event(0, 1, "step", 1, 0.001, 0.003)]
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     timeline.gantt(os.path.join(directory, "gantt.png"), title="two calls")
        ...     print(os.listdir(directory))
        ['gantt.png']
        """
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle

        colours = {  # the first name a call's name starts with gives its colour
            "forward": "tab:blue",
            "step": "tab:green",
            "backward_input": "tab:cyan",  # zero-bubble's B
            "backward_weights": "tab:olive",  # and its W
            "backward": "tab:orange",
            "loss_input": "tab:pink",
            "loss": "tab:red",
            "aux": "tab:brown",
            "apply": "tab:gray",
            "fused": "tab:purple",
        }
        devices = sorted({e.device for e in self.events})
        fig = Figure(figsize=(12, 1.2 + 0.8 * len(devices)))
        ax = fig.subplots()
        for row, device in enumerate(devices):
            for e in (e for e in self.events if e.device == device):
                kind = next((k for k in colours if e.name.startswith(k)), "fused")
                ax.broken_barh(
                    [(1e3 * e.start, 1e3 * e.seconds)],
                    (row - 0.4, 0.8),
                    facecolors=colours[kind],
                    edgecolor="white",
                    linewidth=0.3,
                )
                if isinstance(e.unit, tuple):  # a microbatch: its index on its bar
                    middle = 1e3 * (e.start + e.end) / 2
                    ax.text(middle, row, str(e.unit[1]), ha="center", va="center", fontsize=6)
        busy = self.busy_fraction()
        ax.set_yticks(
            range(len(devices)), [f"device {d}\n{100 * busy[d]:.0f}% busy" for d in devices]
        )
        ax.set_xlabel("milliseconds")
        ax.set_title(title)
        handles = [Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
        ax.legend(handles, list(colours), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
