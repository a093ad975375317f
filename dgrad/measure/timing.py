"""A timing model of the timetables: predicted step time and bubble from each call's cost.

Each device group runs its calls in the order the engine dispatches them; a call
starts once its device is free, the host has dispatched it, and the messages it
needs (an activation from the stage before, a cotangent from the stage after)
exist, moved in `move` seconds where they cross devices. `simulate` plays a
`dgrad.schedule.Schedule` for some steps this way and reports the steady state:
seconds per step, and each device's idle share. With the papers' unit costs (a
forward 1, a backward 2, zero-bubble's B and W 1 each, nothing else) it gives a
timetable's ideal bubble; fed costs measured on a device (`costs_of`, from a
`dgrad.measure.timeline.Timeline`) it predicts the configuration they were measured on, beside
its measured step; fed a cost for each function on every stage (`every_stage` carries
measured costs over to other K, M and V), any configuration on that device.

>>> from dgrad.schedule import Schedule
>>> gpipe = simulate(Schedule("gpipe", 4, microbatches=8))
>>> round(gpipe.idle[0], 4), round(3 / (8 + 3), 4)  # (K-1)/(M+K-1)
(0.2727, 0.2727)
>>> zb = simulate(Schedule("zb", 4, microbatches=8))
>>> zb.step_seconds < simulate(Schedule("1f1b", 4, microbatches=8)).step_seconds
True
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Mapping

from dgrad.schedule import KINDS, Schedule

Costs = Mapping[tuple[int, str], float] | Callable[[int, str], float]

# The papers' unit costs (a forward 1, a whole backward 2, B and W 1 each) of each stage
# function, as the call kinds that run them declare them (`dgrad.schedule.Call`).
UNIT_COSTS = {
    function: kind.unit_cost
    for kind in KINDS
    if kind.unit_cost is not None
    for function in kind.functions
}


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What `simulate` predicts for the steady state.

    Attributes:
      step_seconds: seconds per step.
      idle: each device group's idle share of a step (the bubble, with the host's waits).
      busy_seconds: each device group's seconds of work per step.

    >>> from dgrad.schedule import Schedule
    >>> simulate(Schedule("gpipe", 2, microbatches=2)).busy_seconds  # 2 x (1 + 2) each
    (6.0, 6.0)
    """

    step_seconds: float
    idle: tuple[float, ...]
    busy_seconds: tuple[float, ...]


def _cost_of(costs: Costs) -> Callable[[int, str], float]:
    if callable(costs):
        return costs

    def cost(stage: int, name: str) -> float:
        for key in ((stage, name), (None, name)):
            if key in costs:
                return costs[key]
        raise ValueError(
            f"no cost for stage {stage}'s {name}: give costs[({stage}, {name!r})], or "
            f"costs[(None, {name!r})] for every stage (timing.every_stage carries costs "
            "measured on another K, M or V over)."
        )

    return cost


def every_stage(costs: Mapping[tuple[int, str], float], scale: float = 1.0) -> dict:
    """Each function's cost the same on every stage: the median over the stages of `costs`
    that ran it, times `scale`. Measured at K stages of a balanced split and carried to K'
    stages of the same model, a call does about K/K' the work: `scale=K / K'`. The share of
    a call that does not shrink with the stage (its dispatch, on a GPU its launch) is not
    separated out; `simulate`'s `dispatch` is the host's side of it.

    >>> measured = {(0, "forward"): 2.0, (1, "forward"): 4.0, (1, "loss_sum"): 6.0}
    >>> every_stage(measured, scale=0.5)  # from K = 2 to K = 4
    {(None, 'forward'): 1.5, (None, 'loss_sum'): 3.0}
    """
    by_name: dict[str, list[float]] = {}
    for (_, name), seconds in costs.items():
        by_name.setdefault(name, []).append(seconds)
    return {(None, name): scale * statistics.median(values) for name, values in by_name.items()}


def unit_costs(stage: int, name: str) -> float:
    """The papers' cost of `name` (any stage): forward 1, backward 2, B and W 1 each.
    A whole fused step has none that does not depend on the model (pass measured costs).

    >>> unit_costs(0, "forward"), unit_costs(3, "loss_sum"), unit_costs(1, "apply_sum")
    (1.0, 3.0, 0.0)
    """
    if name not in UNIT_COSTS:
        raise ValueError(
            f"the papers' unit costs do not cover {name}; pass measured costs for it "
            "(timing.costs_of)."
        )
    return UNIT_COSTS[name]


def simulate(
    schedule: Schedule,
    costs: Costs = unit_costs,
    *,
    dispatch: float = 0.0,
    move: float = 0.0,
    steps: int | None = None,
) -> Prediction:
    """Plays `steps` steps of `schedule` with each call costing `costs[(stage, name)]`
    seconds (a key `(None, name)` stands for every stage; a call with neither is a
    ValueError that names it), the host spending
    `dispatch` seconds on each call it dispatches and each message that crosses devices
    taking `move` seconds; returns the second half's `Prediction`. It starts where the
    pipeline is full (so fill-only calls need no cost) and plays `steps` (default 16, or
    four times as many as a batch spends in the pipeline), the first half to settle.

    >>> from dgrad.schedule import Schedule
    >>> one = simulate(Schedule("1f1b", 4, microbatches=8))
    >>> two = simulate(Schedule("1f1b", 8, microbatches=8, virtual_stages=2))
    >>> round(one.idle[0], 3), round(two.idle[0], 3)  # interleaving halves the bubble's time
    (0.273, 0.158)
    >>> host_bound = simulate(Schedule("gpipe", 2, microbatches=4), dispatch=5.0)
    >>> host_bound.step_seconds  # 14 calls a step, 5 s each on the host
    70.0
    """
    cost = _cost_of(costs)
    full = schedule.longest_wait()  # from here on every step runs the same functions
    steps = steps or max(16, 4 * (full + 1))
    devices = schedule.num_devices if not schedule.fused else 1
    free = [0.0] * devices
    busy = [0.0] * devices
    ready: dict[tuple, tuple[float, int]] = {}  # message -> (when it was sent, from device)
    host, ends = 0.0, []
    for t in range(full, full + steps):
        end = 0.0
        for call in schedule.work(t):
            stage = call.stage
            device = 0 if schedule.fused else schedule.device_of(stage)
            host += dispatch
            start = max(host, free[device])
            for message in call.needs():
                if message in ready:
                    sent, source = ready.pop(message)
                    start = max(start, sent + (move if source != device else 0.0))
            seconds = cost(stage, call.function)
            free[device] = start + seconds
            end = max(end, free[device])
            if t >= full + steps // 2:
                busy[device] += seconds
            for message in call.sends(schedule):
                ready[message] = (free[device], device)
        ends.append(max(end, host))
    half = steps // 2
    step = (ends[-1] - ends[half - 1]) / (steps - half)
    per_step = tuple(b / (steps - half) for b in busy)
    idle = tuple(1 - b / step if step else 0.0 for b in per_step)
    return Prediction(step, idle, per_step)


def costs_of(events) -> dict[tuple[int, str], float]:
    """The median seconds of each (stage, function) in `events` (a `Timeline`'s).

    >>> from dgrad.measure.timeline import Event
    >>> events = [Event(0, 1, "forward", s, 0.0, d) for s, d in enumerate([0.2, 0.1, 0.3])]
    >>> costs_of(events)
    {(1, 'forward'): 0.2}
    """
    seconds: dict[tuple[int, str], list[float]] = {}
    for event in events:
        seconds.setdefault((event.stage, event.name), []).append(event.seconds)
    return {key: statistics.median(values) for key, values in seconds.items()}
