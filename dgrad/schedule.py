"""Who forwards and who back-propagates which batch, at which iteration.

The training methods of dgrad differ in their timetable (and DGL in its
objective). This module states each timetable twice, as plain integer
arithmetic (which batch a stage forwards and back-propagates in iteration t)
and as the ordered list of work (`Schedule.work`) that the engine's one step
loop carries out; the single-device reference and the tests answer to both.

Stage k of K (0-indexed; stage K-1 takes the loss), iteration t, batch b_t:

| method | inside an iteration         | stage k forwards | backprops     | weight staleness |
|--------|-----------------------------|------------------|---------------|------------------|
| bp     | forward all, backward all   | b_t              | b_t           | 0                |
| ddg    | forward in order, then      | b_t              | b_{t-(K-1-k)} | K-1-k            |
|        | backward + update           |                  |               |                  |
| fdg    | backward + update, then     | b_{t-k}          | b_{t-2K+2+k}  | 2(K-1-k)-1, and  |
|        | forward (last stage: both)  |                  |               | 0 for the last   |
| fr     | as ddg, the backward        | b_t              | b_{t-(K-1-k)} | 0 (the weights); |
|        | replays on current weights  |                  |               | inputs K-1-k old |
| dgl    | forward, own head's loss,   | b_{t-k}          | b_{t-k}       | 0                |
|        | backward, update            |                  |               |                  |
| gpipe  | M microbatches forward, M   | b_t              | b_t           | 0                |
|        | backward, one update        |                  |               |                  |
| 1f1b   | as gpipe, one forward and   | b_t              | b_t           | 0                |
|        | one backward in turn        |                  |               |                  |
| zb     | as 1f1b, each backward cut  | b_t              | b_t           | 0                |
|        | into B and a deferred W     |                  |               |                  |
| pipedream | as ddg (weight stashing) | b_t              | b_{t-(K-1-k)} | K-1-k            |
| 2bw    | 1f1b across the steps (no   | b_t              | b_{t-1}; the  | 1                |
|        | flush), at the weights of   |                  | last: b_t     |                  |
|        | one version before          |                  |               |                  |

- DDG: the cotangent stage k uses at t was made by stage k+1 at t-1; the last
  stage back-propagates its own fresh loss.
- FDG: every hop between stages, forward or backward, costs one iteration, so
  all stage steps of an iteration are independent. Stage k back-propagates a
  batch 2(K-1-k) iterations after forwarding it; since it updates before it
  forwards, the weights that batch saw are one update younger than the gap.
  Gradient shrinking multiplies the received cotangent by beta at every stage,
  so stage k's gradient is scaled by beta^(K-1-k); weight decay is not shrunk.
- Fill: a stage with no gradient yet makes no update at all (no optimizer step,
  no momentum or weight decay). The pipeline is never drained between epochs.
- FR (Features Replay) is the DDG timetable whose delayed backward replays the
  stage's forward on its stored input with its current weights (`Options` makes
  it ddg with weights=current and memory=recompute); the weights of the
  gradient are fresh, the input and the received cotangent are not.
- DGL: every stage but the last trains on the loss of its own auxiliary head;
  nothing crosses a stage boundary backwards, so stage k takes batch t-k as in
  FDG and applies its gradient at once.
- ADL (`accumulate=M`, with fdg) keeps the FDG timetable; each stage sums M
  gradients and updates once every M iterations, so a gradient is still
  2(K-1-k) iterations old when applied but only about (2(K-1-k)-1)/M updates
  old (rounded up or down by where its batch falls in the window of M).
- GPipe and 1F1B-flush split b_t into M equal microbatches (rows m*B/M to
  (m+1)*B/M), sum each stage's gradients over them and update once, with their
  mean, when the last backward is done (the flush): the same numbers, in a
  different order. GPipe forwards all M, then back-propagates them in the order
  the last stage's loss calls send their cotangents (first to last: in reverse,
  the stage before would wait for the last loss before its first backward);
  1F1B does K-1-k forwards, then one forward and one backward in turn, so
  stage k keeps at most K-k microbatches' records at once instead of M.
- Interleaved 1F1B (`virtual_stages=V`): the model is cut into K*V chunks,
  chunk j on device group j mod K, each device running Megatron's order over
  its V chunks (`device_work`); GPipe's numbers, a bubble about V times shorter.
- Zero-bubble ZB-H1 (`zb`, Qi et al. 2024): 1F1B whose backwards are two calls,
  B (the input cotangent) and W (the weight gradient); stage k runs its W's k
  behind its B's, in what 1F1B leaves idle, holding at most K records. GPipe's
  numbers.
- ZB-V (`zb` with `virtual_stages=2`, Qi et al. 2024, section 6): 2 chunks on
  each device in a V (chunk j on device j for j < K, on device 2K-1-j after), so
  the first and the last chunk share device 0; each device runs the paper's
  order over its two chunks (`device_work`), with no bubble once M >= 2K-1 and
  F = B = W, holding at most 2K chunk records (1F1B's memory). GPipe's numbers.
- DualPipeV (`dualpipev`, `virtual_stages=2`, the cut-in-half V of DeepSeek-V3's
  DualPipe): ZB-V's placement in its own order (`dualpipe_v_order`: eight runs of
  forwards, backwards and deferred W's, M >= 2K). Where it overlaps one chunk's
  forward with the other's backward in one call, to hide their communication,
  the engine runs two calls in a row: one controller over XLA has nothing to
  overlap by hand. GPipe's numbers.
- PipeDream (asynchronous 1F1B with weight stashing) gives every forward and
  update the weight versions of DDG with weights=stash: the same timetable.
- PipeDream-2BW: W^{t+1} = U(W^t, g_t), g_t the gradient of b_t (over its M
  microbatches) at W^{t-1}, on every stage; a stage keeps two weight versions.
  There is no flush: stage k's forwards run min(K-1-k, M) microbatches ahead of
  its backwards across steps (`lag`), so it applies b_t's gradient in step t+1
  (the last stage in step t) and carries b_t's partial gradient sum over. With
  M < K-1 a stage cannot run the K-1-k ahead that fill its bubble (a third weight
  version would be needed), so the steady state is bubble-free only once M >= K-1.
- Weight staleness counts the updates between a batch's forward and the update
  that applies its gradient, which is what a single-device staleness
  simulation must use.

>>> s = Schedule("fdg", num_stages=3)
>>> [s.forward_batch(k, 4) for k in range(3)], [s.backward_batch(k, 4) for k in range(3)]
([4, 3, 2], [0, 1, 2])
>>> [s.weight_staleness(k) for k in range(3)]
[3, 1, 0]

Between iterations (after 4 of them) stage 0 holds the records of batches 0-3,
batch 3's activation waits for stage 1 and batch 0's cotangent for stage 0:

>>> s.kept_batches(0, 4), s.activation_batch(1, 4), s.cotangent_batch(0, 4)
([0, 1, 2, 3], 3, 0)

The work of iteration 4, in the order the engine dispatches it:

>>> for work in s.work(4):
...     print(work)
BackwardForward(stage=0, backward=0, forward=4, update_first=True)
BackwardForward(stage=1, backward=1, forward=3, update_first=True)
Loss(stage=2, unit=2, apply=True, previous=False)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Union

from dgrad.options import ALWAYS_CHUNKED, METHODS, MICROBATCHED, check_always_chunked

Unit = Union[int, tuple[int, int]]  # a batch of the stream, or (batch, microbatch)


class Call:
    """What every kind of timetable call declares, in one place: the stage function it
    runs (`function`, one of `dgrad.stage.Calls`; `functions` lists all it may run), its
    cost in the papers' units (`unit_cost`: a forward 1, a whole backward 2; None where
    it depends on the model), the messages it waits for (`needs`) and sends (`sends`),
    and the unit it shows in a timeline (`shown`, a field name). The engine carries a
    kind out with `Pipeline._do_<name>`; the timing model, the timeline and the checks
    of a timetable read the rest from here.

    >>> call = BackwardForward(stage=1, backward=0, forward=2, update_first=True)
    >>> call.function, call.unit_cost, call.shown_unit
    ('step', 3.0, 2)
    """

    name: ClassVar[str]
    functions: ClassVar[tuple[str, ...]]
    unit_cost: ClassVar[float | None]
    # (message kind, the field naming its unit): what arrives, and what leaves
    takes: ClassVar[tuple[tuple[str, str], ...]] = ()
    gives: ClassVar[tuple[tuple[str, str], ...]] = ()
    shown: ClassVar[str | None] = "unit"

    @property
    def function(self) -> str:
        return self.functions[0]

    @property
    def shown_unit(self) -> Unit | None:
        """The unit the call forwards (or, for a backward alone, back-propagates; None
        for a flush's update), as a timeline's `Event` records it."""
        return None if self.shown is None else getattr(self, self.shown)

    def needs(self) -> list[tuple]:
        """The messages the call waits for: ("activation" | "cotangent", its stage, the
        unit); the first stage reads its activations from the batch.

        >>> BackwardForward(stage=1, backward=0, forward=2, update_first=True).needs()
        [('activation', 1, 2), ('cotangent', 1, 0)]
        """
        return [
            (kind, self.stage, getattr(self, field))
            for kind, field in self.takes
            if kind == "cotangent" or self.stage > 0
        ]

    def sends(self, schedule: Schedule) -> list[tuple]:
        """The messages the call sends: its output on, its input's cotangent back, each as
        ("activation" | "cotangent", the stage it waits for, the unit).

        >>> InputGradient(stage=1, unit=(0, 1)).sends(Schedule("zb", 3, microbatches=2))
        [('cotangent', 0, (0, 1))]
        """
        k, sent = self.stage, []
        for kind, field in self.gives:
            if kind == "activation" and k < schedule.last:
                sent.append((kind, k + 1, getattr(self, field)))
            elif kind == "cotangent" and schedule.sends_cotangent(k):
                sent.append((kind, k - 1, getattr(self, field)))
        return sent


_FORWARD = (("activation", "unit"),)
_BACKWARD = (("cotangent", "unit"),)


@dataclasses.dataclass(frozen=True)
class Forward(Call):
    """Forward `unit` and keep what its backward needs (with the weights of one version
    before the current one if `previous`: PipeDream-2BW).

    >>> Schedule("ddg", 2).work(0)[0]  # stage 0 has no gradient due yet: forward only
    Forward(stage=0, unit=0, previous=False)
    """

    name: ClassVar[str] = "forward"
    functions: ClassVar[tuple[str, ...]] = ("forward",)
    unit_cost: ClassVar[float | None] = 1.0
    takes: ClassVar = _FORWARD
    gives: ClassVar = _FORWARD

    stage: int
    unit: Unit
    previous: bool = False


@dataclasses.dataclass(frozen=True)
class Backward(Call):
    """Back-propagate `unit` from its kept record and its received cotangent; update at
    once if `apply`, else add the gradient to the stage's sum for `Apply`.

    >>> Schedule("bp", 2).work(0)[-1]  # staged backprop: stage 0's backward comes last
    Backward(stage=0, unit=0, apply=True)
    """

    name: ClassVar[str] = "backward"
    functions: ClassVar[tuple[str, ...]] = ("backward_update", "backward_sum")
    unit_cost: ClassVar[float | None] = 2.0
    takes: ClassVar = _BACKWARD
    gives: ClassVar = _BACKWARD

    stage: int
    unit: Unit
    apply: bool = True

    @property
    def function(self) -> str:
        return self.functions[0] if self.apply else self.functions[1]


@dataclasses.dataclass(frozen=True)
class InputGradient(Call):
    """Zero-bubble's B: the cotangent of `unit`'s input alone, sent on at once; the record
    and the received cotangent wait for the unit's `WeightGradient`.

    >>> Schedule("zb", 3, microbatches=2).stage_work(1, 0)[2]
    InputGradient(stage=1, unit=(0, 0))
    """

    name: ClassVar[str] = "input_gradient"
    functions: ClassVar[tuple[str, ...]] = ("backward_input",)
    unit_cost: ClassVar[float | None] = 1.0
    takes: ClassVar = _BACKWARD
    gives: ClassVar = _BACKWARD

    stage: int
    unit: Unit


@dataclasses.dataclass(frozen=True)
class WeightGradient(Call):
    """Zero-bubble's W: `unit`'s parameter gradient from the record and cotangent its
    `InputGradient` (or `LossInput`) left, added to the stage's sum for `Apply`.

    >>> Schedule("zb", 2, microbatches=2).stage_work(1, 0)[-2]
    WeightGradient(stage=1, unit=(0, 1))
    """

    name: ClassVar[str] = "weight_gradient"
    functions: ClassVar[tuple[str, ...]] = ("backward_weights",)
    unit_cost: ClassVar[float | None] = 1.0

    stage: int
    unit: Unit


@dataclasses.dataclass(frozen=True)
class LossInput(Call):
    """Zero-bubble's last stage: forward `unit`, its loss and the input cotangent, keeping
    the loss's VJP for the unit's `WeightGradient`.

    >>> Schedule("zb", 2, microbatches=2).stage_work(1, 0)[0]
    LossInput(stage=1, unit=(0, 0))
    """

    name: ClassVar[str] = "loss_input"
    functions: ClassVar[tuple[str, ...]] = ("loss_input",)
    unit_cost: ClassVar[float | None] = 2.0
    takes: ClassVar = _FORWARD
    gives: ClassVar = _FORWARD + _BACKWARD

    stage: int
    unit: Unit


@dataclasses.dataclass(frozen=True)
class BackwardForward(Call):
    """Back-propagate `backward` and update, and forward `forward`, in one call; the
    forward uses the updated weights if `update_first` (FDG), else the old ones (DDG).

    >>> Schedule("fdg", 2).work(2)[0]
    BackwardForward(stage=0, backward=0, forward=2, update_first=True)
    """

    name: ClassVar[str] = "backward_forward"
    functions: ClassVar[tuple[str, ...]] = ("step",)
    unit_cost: ClassVar[float | None] = 3.0
    takes: ClassVar = (("activation", "forward"), ("cotangent", "backward"))
    gives: ClassVar = (("activation", "forward"), ("cotangent", "backward"))
    shown: ClassVar[str | None] = "forward"

    stage: int
    backward: Unit
    forward: Unit
    update_first: bool


@dataclasses.dataclass(frozen=True)
class Loss(Call):
    """The last stage: forward `unit`, its loss and backward; update at once if `apply`,
    else add the gradient to the stage's sum (at the previous weights if `previous`).

    >>> Schedule("2bw", 2, microbatches=2).work(0)[2]
    Loss(stage=1, unit=(0, 0), apply=False, previous=True)
    """

    name: ClassVar[str] = "loss"
    functions: ClassVar[tuple[str, ...]] = ("loss_step", "loss_sum")
    unit_cost: ClassVar[float | None] = 3.0
    takes: ClassVar = _FORWARD
    gives: ClassVar = _FORWARD + _BACKWARD

    stage: int
    unit: Unit
    apply: bool = True
    previous: bool = False

    @property
    def function(self) -> str:
        return self.functions[0] if self.apply else self.functions[1]


@dataclasses.dataclass(frozen=True)
class LocalLoss(Call):
    """DGL: forward `unit`, the loss of the stage's own head, backward and update; the
    output goes on with no gradient path back.

    >>> Schedule("dgl", 2).work(3)
    (LocalLoss(stage=0, unit=3), Loss(stage=1, unit=2, apply=True, previous=False))
    """

    name: ClassVar[str] = "local_loss"
    functions: ClassVar[tuple[str, ...]] = ("aux_step",)
    unit_cost: ClassVar[float | None] = 3.0
    takes: ClassVar = _FORWARD
    gives: ClassVar = _FORWARD

    stage: int
    unit: Unit


@dataclasses.dataclass(frozen=True)
class Apply(Call):
    """Update once with the mean of the `count` gradients summed this iteration (the
    flush), keeping the weights before it as the previous version if `keep_previous`.

    >>> Schedule("2bw", 2, microbatches=4).stage_work(0, 1)[2]  # after b_0's last backward
    Apply(stage=0, count=4, keep_previous=True)
    """

    name: ClassVar[str] = "apply"
    functions: ClassVar[tuple[str, ...]] = ("apply_sum",)
    unit_cost: ClassVar[float | None] = 0.0
    shown: ClassVar[str | None] = None

    stage: int
    count: int
    keep_previous: bool = False


@dataclasses.dataclass(frozen=True)
class Fused(Call):
    """Fused backprop: the whole model's forward, backward and update as one call.

    >>> Schedule("bp", 3, fused=True).work(5)
    (Fused(unit=5),)
    """

    name: ClassVar[str] = "fused"
    functions: ClassVar[tuple[str, ...]] = ("fused_step",)
    unit_cost: ClassVar[float | None] = None

    unit: Unit
    stage: ClassVar[int] = 0  # it runs on the first stage's group


KINDS = (
    Forward,
    Backward,
    InputGradient,
    WeightGradient,
    LossInput,
    BackwardForward,
    Loss,
    LocalLoss,
    Apply,
    Fused,
)
Work = Union[KINDS]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """What a pipeline carries between two iterations: the units whose records each stage
    keeps (oldest first), the unit whose activation or cotangent waits for it, and the
    batch whose gradient sum it carries into the next iteration (PipeDream-2BW).

    >>> Schedule("ddg", 3).in_flight(4)
    InFlight(kept=([2, 3], [3], []), activations=(None, None, None), cotangents=(2, 3, None), \
summing=(None, None, None))
    """

    kept: tuple[list[Unit], ...]
    activations: tuple[Unit | None, ...]
    cotangents: tuple[Unit | None, ...]
    summing: tuple[int | None, ...]


def check_virtual_stages(
    num_stages: int, virtual_stages: int, microbatches: int, method: str = "1f1b"
) -> None:
    """The rules of V chunks per device group: K*V chunks on K groups; interleaved 1F1B
    runs M in rounds of K (a multiple of K), ZB-V puts exactly 2 chunks on each group.

    >>> check_virtual_stages(8, 2, 8)  # 4 groups of 2 chunks, 8 microbatches: fine
    >>> check_virtual_stages(8, 2, 6)
    Traceback (most recent call last):
        ...
    ValueError: virtual_stages=2 runs the microbatches in rounds of K=4 (one per device ...
    >>> check_virtual_stages(8, 2, 6, method="zb")  # ZB-V: any M
    >>> check_virtual_stages(8, 2, 6, method="dualpipev")
    Traceback (most recent call last):
        ...
    ValueError: method=dualpipev needs at least 2K microbatches (K=4 device groups: its ...
    """
    if num_stages % virtual_stages:
        raise ValueError(
            f"virtual_stages={virtual_stages} puts V chunks on each of K device groups, so "
            f"the model needs K*V stages, but it has {num_stages}; cut it into a multiple "
            f"of {virtual_stages} (e.g. models.mlp(..., num_stages=K*V))."
        )
    if method == "zb":
        if virtual_stages != 2:
            raise ValueError(
                f"method=zb with virtual_stages={virtual_stages}: zero-bubble's V schedule "
                "(ZB-V, Qi et al. 2024) puts exactly 2 chunks on each device group; use "
                "virtual_stages=2, or 1 for ZB-H1."
            )
        return
    check_always_chunked(method, virtual_stages)
    if method == "dualpipev":
        groups = num_stages // virtual_stages
        if microbatches < 2 * groups:
            raise ValueError(
                f"method=dualpipev needs at least 2K microbatches (K={groups} device groups: "
                f"its warm-up alone runs 2K forwards on the first), not {microbatches}; use "
                f"microbatches={2 * groups} or more."
            )
        return
    groups = num_stages // virtual_stages
    if microbatches % groups:
        raise ValueError(
            f"virtual_stages={virtual_stages} runs the microbatches in rounds of K={groups} "
            f"(one per device group, Narayanan et al. 2021), so microbatches must be a "
            f"multiple of {groups}, not {microbatches}."
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The timetable of `method` on a pipeline of `num_stages` stages (with
    `virtual_stages` V > 1, stage j is chunk j of the model, on device group
    `device_of(j)` of K = num_stages / V: j mod K for interleaved 1F1B, in a V for ZB-V).

    >>> s = Schedule("ddg", num_stages=4)
    >>> [s.weight_staleness(k) for k in range(4)]
    [3, 2, 1, 0]
    >>> [s.backward_batch(k, 2) for k in range(4)]  # iteration 2: stage 0 has no gradient yet
    [None, 0, 1, 2]
    >>> Schedule("1f1b", 4, microbatches=2, virtual_stages=2).device_of(3)  # chunk 3 of 4
    1
    """

    method: str
    num_stages: int
    microbatches: int = 1
    fused: bool = False
    virtual_stages: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"Unknown method {self.method!r}; choose one of {', '.join(METHODS)}.")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}.")
        if self.microbatches != 1 and self.method not in MICROBATCHED:
            raise ValueError(
                f"method={self.method} has no microbatches; microbatches is for "
                f"{', '.join(MICROBATCHED)}."
            )
        if self.virtual_stages != 1 or self.method in ALWAYS_CHUNKED:
            check_virtual_stages(
                self.num_stages, self.virtual_stages, self.microbatches, self.method
            )

    @property
    def num_devices(self) -> int:
        """K, the device groups the stages run on (num_stages / virtual_stages).

        >>> Schedule("1f1b", 6, microbatches=3, virtual_stages=2).num_devices
        3
        """
        return self.num_stages // self.virtual_stages

    def device_of(self, stage: int) -> int:
        """The device group `stage` runs on: its own; chunk j's j mod K when interleaved;
        in a V under ZB-V (chunk j on group j, then back up: 2K-1-j).

        >>> [Schedule("1f1b", 4, microbatches=2, virtual_stages=2).device_of(j) for j in range(4)]
        [0, 1, 0, 1]
        >>> [Schedule("zb", 4, microbatches=2, virtual_stages=2).device_of(j) for j in range(4)]
        [0, 1, 1, 0]
        """
        K = self.num_devices
        if self.method in ("zb", "dualpipev") and self.virtual_stages == 2:
            return stage if stage < K else 2 * K - 1 - stage
        return stage % K

    def lag(self, stage: int) -> int:
        """PipeDream-2BW without a flush: how many microbatches `stage`'s forwards run ahead
        of its backwards across steps, min(K-1-k, M) (1F1B's warm-up, at most one step).

        >>> [Schedule("2bw", 4, microbatches=2).lag(k) for k in range(4)]
        [2, 2, 1, 0]
        """
        return min(self.last - stage, self.microbatches)

    @property
    def _timetable(self) -> str:
        """The timetable the method runs (PipeDream's is DDG's, FR's is DDG's)."""
        return {
            "fr": "ddg",
            "pipedream": "ddg",
            "1f1b": "gpipe",
            "2bw": "gpipe",
            "zb": "gpipe",
            "dualpipev": "gpipe",
        }.get(self.method, self.method)

    @property
    def last(self) -> int:
        return self.num_stages - 1

    def gradient_delay(self, stage: int) -> int:
        """Iterations between stage's forward of a batch and its backward of it.

        >>> [Schedule("fdg", 3).gradient_delay(k) for k in range(3)]  # 2(K-1-k)
        [4, 2, 0]
        >>> [Schedule("ddg", 3).gradient_delay(k) for k in range(3)]  # K-1-k
        [2, 1, 0]
        >>> [Schedule("2bw", 3, microbatches=2).gradient_delay(k) for k in range(3)]  # no flush
        [1, 1, 0]
        """
        depth = self.last - stage
        if self.method == "2bw":
            return int(self.lag(stage) > 0)
        return {"ddg": depth, "fdg": 2 * depth}.get(self._timetable, 0)

    def forward_lag(self, stage: int) -> int:
        """How many iterations after it entered the pipeline `stage` forwards a batch.

        >>> [Schedule("fdg", 3).forward_lag(k) for k in range(3)], Schedule("ddg", 3).forward_lag(2)
        ([0, 1, 2], 0)
        """
        return stage if self._timetable in ("fdg", "dgl") else 0

    def forward_batch(self, stage: int, t: int) -> int | None:
        """Index of the batch `stage` forwards in iteration `t` (None during fill).

        >>> [Schedule("fdg", 3).forward_batch(k, 1) for k in range(3)]  # stage 2 has none yet
        [1, 0, None]
        """
        b = t - self.forward_lag(stage)
        return b if b >= 0 else None

    def backward_batch(self, stage: int, t: int) -> int | None:
        """Index of the batch whose gradient `stage` applies in iteration `t`.

        >>> fdg = Schedule("fdg", 3)
        >>> [fdg.backward_batch(k, 3) for k in range(3)]  # stage 0 has no gradient yet
        [None, 0, 1]
        >>> [fdg.backward_batch(k, 4) for k in range(3)]
        [0, 1, 2]
        """
        b = t - self.forward_lag(stage) - self.gradient_delay(stage)
        return b if b >= 0 else None

    def forward_iteration(self, stage: int, batch: int) -> int:
        """The iteration in which `stage` forwards `batch`.

        >>> [Schedule("fdg", 3).forward_iteration(k, batch=5) for k in range(3)]
        [5, 6, 7]
        """
        return batch + self.forward_lag(stage)

    def backward_iteration(self, stage: int, batch: int) -> int:
        """The iteration in which `stage` applies `batch`'s gradient.

        >>> [Schedule("fdg", 3).backward_iteration(k, batch=5) for k in range(3)]
        [9, 8, 7]
        """
        return batch + self.forward_lag(stage) + self.gradient_delay(stage)

    def updates_before_forward(self, stage: int) -> bool:
        """FDG stages (but the last) update first and forward with the new weights.

        >>> [Schedule("fdg", 3).updates_before_forward(k) for k in range(3)]
        [True, True, False]
        >>> Schedule("ddg", 3).updates_before_forward(0)
        False
        """
        return self.method == "fdg" and stage < self.last

    def trains_locally(self, stage: int) -> bool:
        """DGL stages but the last train on their own head's loss and send no cotangent.

        >>> [Schedule("dgl", 3).trains_locally(k) for k in range(3)]
        [True, True, False]
        """
        return self.method == "dgl" and stage < self.last

    def sends_cotangent(self, stage: int) -> bool:
        """Whether `stage` sends the cotangent of its input back (all but the first; none
        under DGL).

        >>> [Schedule("ddg", 3).sends_cotangent(k) for k in range(3)]
        [False, True, True]
        """
        return stage > 0 and self.method != "dgl"

    @property
    def keeps_previous_weights(self) -> bool:
        """PipeDream-2BW: every stage keeps the weights of one version before the current.

        >>> Schedule("2bw", 2).keeps_previous_weights, Schedule("gpipe", 2).keeps_previous_weights
        (True, False)
        """
        return self.method == "2bw"

    def weight_staleness(self, stage: int) -> int:
        """Updates applied between the forward whose weights a gradient is taken at and the
        update that applies it (FR takes it at the current weights: 0).

        >>> [Schedule("fdg", 3).weight_staleness(k) for k in range(3)]  # one less than the delay
        [3, 1, 0]
        >>> [Schedule("fr", 3).weight_staleness(k) for k in range(3)]
        [0, 0, 0]
        """
        if self.method == "fr":
            return 0
        if self.method == "2bw":
            return 1
        delay = self.gradient_delay(stage)
        return delay - 1 if self.updates_before_forward(stage) else delay

    def input_staleness(self, stage: int) -> int:
        """Iterations between a batch's forward through `stage` and its backward there (how
        old the kept input and the received cotangent are).

        >>> [Schedule("fr", 3).input_staleness(k) for k in range(3)]  # fresh weights, old inputs
        [2, 1, 0]
        """
        return self.gradient_delay(stage)

    def longest_wait(self) -> int:
        """The most iterations a batch spends in the pipeline, from entering it to its last
        gradient (how far back the staleness probe needs batches).

        >>> Schedule("fdg", 3).longest_wait(), Schedule("ddg", 3).longest_wait()
        (4, 2)
        """
        return max(self.forward_lag(k) + self.gradient_delay(k) for k in range(self.num_stages))

    def shrink_depth(self, stage: int) -> int:
        """Power of beta that gradient shrinking applies to `stage`'s gradient.

        >>> [Schedule("fdg", 3).shrink_depth(k) for k in range(3)]  # scaled by beta**depth
        [2, 1, 0]
        """
        return self.last - stage

    # The work of an iteration, in the order the engine dispatches it.

    def units(self, t: int) -> list[Unit]:
        """What batch t is cut into: itself, or its microbatches (batch, m).

        >>> Schedule("ddg", 2).units(3), Schedule("1f1b", 2, microbatches=2).units(3)
        ([3], [(3, 0), (3, 1)])
        """
        if self._timetable == "gpipe":
            return [(t, m) for m in range(self.microbatches)]
        return [t]

    def work(self, t: int) -> tuple[Work, ...]:
        """Every call of iteration `t`, in an order where each unit's activation is made
        before it is used and each stage's calls are in the order the stage runs them.

        >>> [type(w).__name__ for w in Schedule("bp", 2).work(0)]
        ['Forward', 'Loss', 'Backward']
        >>> Schedule("ddg", 2).work(1)[0]  # stage 0: forward b_1, then b_0's delayed update
        BackwardForward(stage=0, backward=0, forward=1, update_first=False)
        >>> Schedule("gpipe", 2, microbatches=2).work(0)[-2:]  # both stages' flush comes last
        (Apply(stage=1, count=2, keep_previous=False), Apply(stage=0, count=2, keep_previous=False))

        Once the pipeline is full (from `steady_iteration` on) each iteration's work is
        the one before it with every unit one batch later, so it is built once and renamed
        (merging a K = 8, M = 32 timetable clock tick by clock tick costs the host
        milliseconds a step):

        >>> s = Schedule("fdg", 3)
        >>> s.work(9) == s.build_work(9), s.work(2) == s.build_work(2)
        (True, True)
        """
        first = self.steady_iteration
        if t < first:
            return self.build_work(t)
        return _renamed(self._steady_work, t - first)

    @functools.cached_property
    def steady_iteration(self) -> int:
        """The first iteration whose work every later one repeats with its units shifted by
        as many batches: the pipeline is full (no stage still waits for its first batch or
        gradient) and no call depends on being in the first iteration.

        >>> Schedule("fdg", 3).steady_iteration, Schedule("gpipe", 4, 8).steady_iteration
        (5, 1)
        """
        return self.longest_wait() + 1

    @functools.cached_property
    def _steady_work(self) -> tuple:
        return _plan(self.build_work(self.steady_iteration))

    def build_work(self, t: int) -> tuple[Work, ...]:
        """Iteration `t`'s work built from the timetable's rules, the slow way `work` avoids
        once the pipeline is full (the same calls).

        >>> Schedule("ddg", 2).build_work(1) == Schedule("ddg", 2).work(1)
        True
        """
        if self.fused:
            return (Fused(t),)
        timetable = self._timetable
        if timetable == "gpipe":
            return self._microbatch_work(t)
        if timetable == "bp":
            return (
                *(Forward(k, t) for k in range(self.last)),
                Loss(self.last, t),
                *(Backward(k, t) for k in reversed(range(self.last))),
            )
        work = []
        for k in range(self.num_stages):
            forward = self.forward_batch(k, t)
            if forward is None:  # the pipeline is still filling up to stage k
                break
            backward = self.backward_batch(k, t)
            if k == self.last:
                work.append(Loss(k, forward))
            elif self.trains_locally(k):
                work.append(LocalLoss(k, forward))
            elif backward is None:
                work.append(Forward(k, forward))
            else:
                work.append(BackwardForward(k, backward, forward, self.updates_before_forward(k)))
        return tuple(work)

    def stage_work(self, stage: int, t: int) -> list[Work]:
        """`stage`'s calls of iteration `t` under a microbatched method (one chunk per
        device), in its order.

        >>> [(type(w).__name__, w.unit[1]) for w in Schedule("1f1b", 3, 4).stage_work(0, 0)[:5]]
        [('Forward', 0), ('Forward', 1), ('Forward', 2), ('Backward', 0), ('Forward', 3)]
        """
        M = self.microbatches
        units = [(t, m) for m in range(M)]
        if self.method == "2bw":
            return self._overlapping_work(stage, t)
        if self.method == "zb" and self.num_stages > 1:
            return [*self._zero_bubble_work(stage, units), Apply(stage, M)]
        if stage == self.last:
            work = [Loss(stage, u, apply=False) for u in units]
        else:
            forwards = [Forward(stage, u) for u in units]
            backwards = [Backward(stage, u, apply=False) for u in units]
            if self.method == "gpipe":
                work = [*forwards, *backwards]
            else:  # 1F1B: K-1-k forwards to fill, then one forward and one backward in turn
                work = _one_forward_one_backward(forwards, backwards, self.last - stage)
        return [*work, Apply(stage, M)]

    def _zero_bubble_work(self, stage: int, units: list[Unit]) -> list[Work]:
        """ZB-H1 (Qi et al. 2024): 1F1B's order with each backward cut into B (the input
        cotangent, which the stage before waits for) and W (the weight gradient, which
        nobody waits for); stage k defers its W's by k, into what 1F1B leaves idle, so it
        holds at most K records, as 1F1B's first stage does."""
        if stage == 0:  # no input cotangent to send: the whole backward at B's place
            forwards = [Forward(stage, u) for u in units]
            backwards = [Backward(stage, u, apply=False) for u in units]
            return _one_forward_one_backward(forwards, backwards, self.last)
        if stage == self.last:
            firsts = [LossInput(stage, u) for u in units]
        else:
            forwards = [Forward(stage, u) for u in units]
            inputs = [InputGradient(stage, u) for u in units]
            firsts = _one_forward_one_backward(forwards, inputs, self.last - stage)
        work, waiting = [], []
        for call in firsts:
            work.append(call)
            if isinstance(call, (InputGradient, LossInput)):
                waiting.append(WeightGradient(stage, call.unit))
                if len(waiting) > stage:
                    work.append(waiting.pop(0))
        return work + waiting

    def _overlapping_work(self, stage: int, t: int) -> list[Work]:
        """PipeDream-2BW without a flush: stage k runs 1F1B across the steps, its forwards
        `lag(k)` microbatches ahead of its backwards, so step t's forwards fill the time in
        which step t-1's backwards drain. Every microbatch of b_t uses W^{t-1}: the current
        weights before the stage applies b_{t-1}'s gradient (right after b_{t-1}'s last
        backward), the previous version after it."""
        M, lag = self.microbatches, self.lag(stage)
        if stage == self.last:
            work = [Loss(stage, (t, m), apply=False, previous=True) for m in range(M)]
            return [*work, Apply(stage, M, keep_previous=True)]
        work = []
        for m in range(M):
            work.append(Forward(stage, (t, m), previous=t > 0 and m >= lag))
            if m >= lag:
                work.append(Backward(stage, (t, m - lag), apply=False))
            elif t > 0:
                work.append(Backward(stage, (t - 1, M - lag + m), apply=False))
                if m == lag - 1:
                    work.append(Apply(stage, M, keep_previous=True))
        return work

    def device_work(self, device: int, t: int) -> list[Work]:
        """Device group `device`'s calls of iteration `t` under a microbatched method, in
        its order: its stage's, or, interleaved, Megatron's order over its V chunks
        (Narayanan et al. 2021): forwards in rounds of K microbatches per chunk, a warm-up
        of 2(K-1-d) + (V-1)K forwards, one forward and one backward in turn, the rest of
        the backwards (chunks in reverse), then each chunk's update.

        >>> s = Schedule("1f1b", 4, microbatches=2, virtual_stages=2)
        >>> [(type(w).__name__[0], w.stage, w.unit[1]) for w in s.device_work(1, 0)[:6]]
        [('F', 1, 0), ('F', 1, 1), ('L', 3, 0), ('L', 3, 1), ('B', 1, 0), ('B', 1, 1)]
        """
        if self.virtual_stages == 1:
            return self.stage_work(device, t)
        if self.method == "zb":
            return self._zero_bubble_v_work(device, t)
        if self.method == "dualpipev":
            return self._dualpipe_v_work(device, t)
        K, V, M = self.num_devices, self.virtual_stages, self.microbatches
        total = M * V

        def stage_and_unit(i: int, forward: bool):
            chunk = (i % (K * V)) // K
            chunk = chunk if forward else V - 1 - chunk
            return chunk * K + device, (t, (i // (K * V)) * K + i % K)

        def forward(i: int) -> Work:
            stage, unit = stage_and_unit(i, True)
            return Loss(stage, unit, apply=False) if stage == self.last else Forward(stage, unit)

        def backward(i: int) -> list[Work]:
            stage, unit = stage_and_unit(i, False)  # the last chunk's is in its Loss
            return [] if stage == self.last else [Backward(stage, unit, apply=False)]

        warmup = total if M == K else min(2 * (K - 1 - device) + (V - 1) * K, total)
        work = [forward(i) for i in range(warmup)]
        for i in range(total - warmup):
            work += [forward(warmup + i), *backward(i)]
        for i in range(total - warmup, total):
            work += backward(i)
        return work + [Apply(chunk * K + device, M) for chunk in range(V)]

    def _zero_bubble_v_work(self, device: int, t: int) -> list[Work]:
        """ZB-V (Qi et al. 2024, section 6): device d holds chunk d (going down) and chunk
        2K-1-d (coming back up); with n = max(2K-1, M) it runs 2(K-d)-1 forwards of its
        first chunk; d times a forward of each; K-d times its second chunk's F, B and W;
        then F, B and W of the first chunk and of the second in turn until every forward
        is done; d times a B of each; K-d times B and W of the first; the W's left, the
        second chunk's first. Microbatches past M are left out (M < 2K-1). The last chunk's
        F and B are one `LossInput`, chunk 0's B and W one `Backward`.
        """
        K, M = self.num_devices, self.microbatches
        n = max(2 * K - 1, M)
        first, second = device, 2 * K - 1 - device
        done = {(chunk, kind): 0 for chunk in (first, second) for kind in "FBW"}
        order = []

        def do(chunk: int, kinds: str) -> None:  # the chunk's next F, B or W, in turn
            for kind in kinds:
                order.append((chunk, kind, done[(chunk, kind)]))
                done[(chunk, kind)] += 1

        do(first, "F" * (2 * (K - device) - 1))
        for _ in range(device):
            do(second, "F")
            do(first, "F")
        for _ in range(K - device):
            do(second, "FBW")
        while done[(second, "F")] < done[(first, "F")] or done[(first, "F")] < n:
            do(first, "FBW" if done[(first, "F")] < n else "BW")
            do(second, "FBW")
        for _ in range(device):
            do(first, "B")
            do(second, "B")
        for _ in range(K - device):
            do(first, "BW")
        for chunk in (second, first):
            do(chunk, "W" * (done[(chunk, "B")] - done[(chunk, "W")]))
        order = [(chunk, kind, m, True) for chunk, kind, m in order if m < M]  # every B cut
        return self._v_calls(order, t, first, second)

    def _dualpipe_v_work(self, device: int, t: int) -> list[Work]:
        """DualPipeV (the V half of DualPipe, DeepSeek-AI 2024): ZB-V's placement in the
        order of `dualpipe_v_order`. Where DualPipeV overlaps one chunk's forward with the
        other's backward in one call, the engine runs them as two calls in a row (one
        controller dispatching to XLA has nothing to overlap by hand). The last chunk's F
        and B are one call (`LossInput` where its B is cut, else `Loss`), chunk 0's B and
        W one `Backward`, a B that is not cut one `Backward`.

        >>> s = Schedule("dualpipev", 4, microbatches=4, virtual_stages=2)
        >>> [(type(w).__name__, w.stage, w.unit[1]) for w in s.device_work(1, 0)[:4]]
        [('Forward', 1, 0), ('Forward', 2, 0), ('Forward', 1, 1), ('Forward', 2, 1)]
        """
        K, M = self.num_devices, self.microbatches
        chunk_of = (device, 2 * K - 1 - device)
        order = [
            (chunk_of[phase], kind, m, split)
            for phase, kind, m, split in dualpipe_v_order(K, device, M)
        ]
        return self._v_calls(order, t, *chunk_of)

    def _v_calls(self, order, t: int, first: int, second: int) -> list[Work]:
        """The calls of a device's `order` over its two chunks of a V, each entry (chunk,
        "F" | "B" | "W", microbatch, whether a B is cut into B and a later W), then both
        chunks' updates. The last chunk's F and B are one call (`LossInput` where its B is
        cut, else `Loss`); chunk 0's B, which sends no cotangent, is one `Backward` with its
        W, as is a B that is not cut."""
        cut = {(chunk, m) for chunk, kind, m, split in order if kind == "B" and split}
        work = []
        for chunk, kind, m, split in order:
            unit = (t, m)
            if kind == "F" and chunk == self.last:
                work.append(
                    LossInput(chunk, unit) if (chunk, m) in cut else Loss(chunk, unit, False)
                )
            elif kind == "F":
                work.append(Forward(chunk, unit))
            elif kind == "B" and chunk != self.last:
                cut_here = split and chunk != 0
                work.append(
                    InputGradient(chunk, unit) if cut_here else Backward(chunk, unit, False)
                )
            elif kind == "W" and chunk != 0:
                work.append(WeightGradient(chunk, unit))
        return work + [Apply(second, self.microbatches), Apply(first, self.microbatches)]

    def _microbatch_work(self, t: int) -> tuple[Work, ...]:
        """Every device's `device_work`, merged clock tick by clock tick: in each tick every
        device does its next call if what it needs is ready (made in an earlier tick, or
        carried in from an earlier iteration)."""
        queues = [self.device_work(d, t) for d in range(self.num_devices)]
        made = set()  # ("activation" | "cotangent", stage it waits for, unit)
        made_here = {message for queue in queues for work in queue for message in work.sends(self)}
        order = []
        while any(queues):
            tick = []
            for queue in queues:
                if not queue:
                    continue
                if all(m in made or m not in made_here for m in queue[0].needs()):
                    tick.append(queue.pop(0))
            if not tick:
                raise AssertionError(f"the {self.method} timetable of iteration {t} deadlocks")
            for work in tick:
                made.update(work.sends(self))
            order += tick
        return tuple(order)

    # What is in flight between iterations t-1 and t (a pipeline state's `step` is t).

    def in_flight(self, t: int) -> InFlight:
        """What the work of the iterations before `t` left in flight, found by carrying it
        out on unit names alone (from far enough back that nothing older survives).

        >>> Schedule("fdg", 2).in_flight(3)
        InFlight(kept=([1, 2], []), activations=(None, 2), cotangents=(1, None), \
summing=(None, None))
        >>> Schedule("gpipe", 2, microbatches=4).in_flight(3)  # the flush leaves nothing
        InFlight(kept=([], []), activations=(None, None), cotangents=(None, None), \
summing=(None, None))
        >>> Schedule("2bw", 2, microbatches=4).in_flight(3).summing  # b_2's 3 of 4 so far
        (2, None)
        """
        kept = [[] for _ in range(self.num_stages)]
        summing: list[int | None] = [None] * self.num_stages
        messages = {}  # (kind, stage it waits for, unit) -> True, in the order they were sent

        def drop(stage, unit):
            if unit in kept[stage]:
                kept[stage].remove(unit)

        for i in range(max(0, t - self.longest_wait() - 1), t):
            for work in self.work(i):
                if isinstance(work, Fused):
                    continue
                k = work.stage
                for needed in work.needs():
                    messages.pop(needed, None)  # (one made before the window: not in flight)
                messages.update(dict.fromkeys(work.sends(self), True))
                if isinstance(work, (Forward, LossInput, BackwardForward)):
                    kept[k].append(work.forward if isinstance(work, BackwardForward) else work.unit)
                if isinstance(work, (Backward, BackwardForward, WeightGradient)):
                    drop(k, work.backward if isinstance(work, BackwardForward) else work.unit)
                if isinstance(work, (Backward, Loss, WeightGradient)) and not _applies(work):
                    summing[k] = work.unit[0]
                if isinstance(work, Apply):
                    summing[k] = None

        def waiting(kind):
            by_stage = [None] * self.num_stages
            for key in messages:
                if key[0] != kind:
                    continue
                _, k, unit = key
                if by_stage[k] is not None:
                    raise AssertionError(f"two messages wait for stage {k} after iteration {t}")
                by_stage[k] = unit
            return tuple(by_stage)

        return InFlight(tuple(kept), waiting("activation"), waiting("cotangent"), tuple(summing))

    def most_kept(self, stage: int, t: int) -> int:
        """The most records `stage` holds at once during iteration `t` (a call that
        back-propagates one unit and forwards another holds both).

        >>> [Schedule("gpipe", 3, microbatches=8).most_kept(k, 0) for k in range(3)]
        [8, 8, 0]
        >>> [Schedule("1f1b", 3, microbatches=8).most_kept(k, 0) for k in range(3)]
        [3, 2, 0]
        >>> [Schedule("fdg", 3).most_kept(k, 9) for k in range(3)]  # 2(K-1-k) in flight, + 1
        [5, 3, 0]
        """
        held = len(self.in_flight(t).kept[stage])
        most = held
        for work in self.work(t):
            if getattr(work, "stage", None) != stage:
                continue
            if isinstance(work, (Forward, LossInput, BackwardForward)):
                most = max(most, held + 1)
                held += not isinstance(work, BackwardForward)
            elif isinstance(work, (Backward, WeightGradient)):
                held -= 1
        return most

    def kept_batches(self, stage: int, t: int) -> list[Unit]:
        """Batches whose forward `stage` has run but whose gradient it has not applied yet.

        >>> fdg = Schedule("fdg", 3)
        >>> [fdg.kept_batches(k, 4) for k in range(3)]  # after 4 iterations
        [[0, 1, 2, 3], [1, 2], []]
        >>> Schedule("ddg", 3).kept_batches(0, 4)
        [2, 3]
        """
        return self.in_flight(t).kept[stage]

    def activation_batch(self, stage: int, t: int) -> Unit | None:
        """The batch whose activation waits for `stage` (FDG: one hop costs one iteration).

        >>> [Schedule("fdg", 3).activation_batch(k, 4) for k in range(3)]
        [None, 3, 2]
        >>> Schedule("ddg", 3).activation_batch(1, 4)  # DDG passes activations within an iteration
        """
        return self.in_flight(t).activations[stage]

    def cotangent_batch(self, stage: int, t: int) -> Unit | None:
        """The batch whose cotangent waits for `stage`, sent by stage + 1 in iteration t-1.

        >>> [Schedule("fdg", 3).cotangent_batch(k, 4) for k in range(3)]
        [0, 1, None]
        >>> [Schedule("ddg", 3).cotangent_batch(k, 4) for k in range(3)]
        [2, 3, None]
        """
        return self.in_flight(t).cotangents[stage]


_UNIT_FIELDS = ("unit", "forward", "backward")  # the fields of a call that name a unit


def _plan(calls: tuple[Work, ...]) -> tuple:
    """Each call with its fields' values and the positions of those that name a unit."""
    plan = []
    for call in calls:
        fields = dataclasses.fields(call)
        values = tuple(getattr(call, f.name) for f in fields)
        plan.append(
            (call, values, tuple(i for i, f in enumerate(fields) if f.name in _UNIT_FIELDS))
        )
    return tuple(plan)


def _renamed(plan: tuple, batches: int) -> tuple[Work, ...]:
    """The calls of `plan` (see `_plan`) with every unit `batches` batches later."""
    work = []
    for call, values, units in plan:
        if units:
            values = list(values)
            for i in units:
                unit = values[i]
                values[i] = unit + batches if type(unit) is int else (unit[0] + batches, unit[1])
            call = type(call)(*values)
        work.append(call)
    return tuple(work)


def dualpipe_v_order(K: int, d: int, M: int) -> list[tuple[int, str, int, bool]]:
    """Device d's order under DualPipeV with K devices and M >= 2K microbatches, as
    (phase, "F" | "B" | "W", microbatch, whether a B leaves its W for later): phase 0 is
    the device's chunk on the way down (chunk d), phase 1 its chunk on the way back up
    (2K-1-d). In eight runs: 2(K-1-d) F0; d+1 times F0 F1; K-1-d times B1 (W left) W F1;
    M-2K+d+1 times F0 B1 F1 B0; K-1-d times B1 F1 B0; d+1 times B1 B0 (the second half
    with their W's left); K-1-d times W B0 (W left); the W's left. A W runs the oldest
    one left.

    >>> [f"{k}{p}" for p, k, m, _ in dualpipe_v_order(2, 1, 4)][:8]  # the last device
    ['F0', 'F1', 'F0', 'F1', 'F0', 'B1', 'F1', 'B0']
    >>> sum(k == "F" for _, k, _, _ in dualpipe_v_order(4, 0, 8)) == 2 * 8  # both phases
    True
    """
    done = {(phase, kind): 0 for phase in (0, 1) for kind in "FB"}
    left, order = [], []

    def run(phase: int, kind: str, split: bool = False) -> None:
        if kind == "W":
            phase, m = left.pop(0)
            order.append((phase, "W", m, False))
            return
        m = done[(phase, kind)]
        done[(phase, kind)] += 1
        order.append((phase, kind, m, split))
        if split:
            left.append((phase, m))

    for _ in range(2 * (K - 1 - d)):
        run(0, "F")
    for _ in range(d + 1):
        run(0, "F")
        run(1, "F")
    for _ in range(K - 1 - d):
        run(1, "B", split=True)
        run(1, "W")
        run(1, "F")
    for _ in range(M - 2 * K + d + 1):
        run(0, "F")
        run(1, "B")
        run(1, "F")
        run(0, "B")
    for _ in range(K - 1 - d):
        run(1, "B")
        run(1, "F")
        run(0, "B")
    split = False
    for i in range(d + 1):
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        run(1, "B", split)
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        run(0, "B", split)
    for _ in range(K - 1 - d):
        run(0, "W") if left else None
        run(0, "B", split=True)
    while left:
        run(0, "W")
    return order


def _one_forward_one_backward(forwards: list, backwards: list, warmup: int) -> list:
    """`warmup` forwards, then one forward and one backward in turn, then the rest of the
    backwards (1F1B's order on one stage)."""
    warmup = min(warmup, len(forwards))
    work = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        work += [forwards[warmup + i], backwards[i]]
    return work + backwards[len(forwards) - warmup :]


def _applies(work: Work) -> bool:
    return getattr(work, "apply", False)
