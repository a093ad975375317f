"""Who forwards and who back-propagates which batch, at which iteration.

The training methods of dgrad differ in their timetable (and DGL in its
objective). This module states the timetable as plain integer arithmetic; the
engine's message passing, the single-device reference and the tests all answer
to it.

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
"""

from __future__ import annotations

import dataclasses

from dgrad.options import METHODS


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The timetable of `method` on a pipeline of `num_stages` stages.

    >>> s = Schedule("ddg", num_stages=4)
    >>> [s.weight_staleness(k) for k in range(4)]
    [3, 2, 1, 0]
    >>> [s.backward_batch(k, 2) for k in range(4)]  # iteration 2: stage 0 has no gradient yet
    [None, 0, 1, 2]
    """

    method: str
    num_stages: int

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"Unknown method {self.method!r}; choose one of {', '.join(METHODS)}.")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}.")

    @property
    def last(self) -> int:
        return self.num_stages - 1

    def gradient_delay(self, stage: int) -> int:
        """Iterations between stage's forward of a batch and its backward of it.

        >>> [Schedule("fdg", 3).gradient_delay(k) for k in range(3)]  # 2(K-1-k)
        [4, 2, 0]
        >>> [Schedule("ddg", 3).gradient_delay(k) for k in range(3)]  # K-1-k
        [2, 1, 0]
        """
        depth = self.last - stage
        return {"bp": 0, "ddg": depth, "fr": depth, "fdg": 2 * depth, "dgl": 0}[self.method]

    def forward_lag(self, stage: int) -> int:
        """How many iterations after it entered the pipeline `stage` forwards a batch.

        >>> [Schedule("fdg", 3).forward_lag(k) for k in range(3)], Schedule("ddg", 3).forward_lag(2)
        ([0, 1, 2], 0)
        """
        return stage if self.method in ("fdg", "dgl") else 0

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

    # What is in flight between iterations t-1 and t (a pipeline state's `step` is t).

    def kept_batches(self, stage: int, t: int) -> list[int]:
        """Batches whose forward `stage` has run but whose gradient it has not applied yet.

        >>> fdg = Schedule("fdg", 3)
        >>> [fdg.kept_batches(k, 4) for k in range(3)]  # after 4 iterations
        [[0, 1, 2, 3], [1, 2], []]
        >>> Schedule("ddg", 3).kept_batches(0, 4)
        [2, 3]
        """
        if self.method in ("bp", "dgl") or stage == self.last:
            return []
        first = max(0, t - self.forward_lag(stage) - self.gradient_delay(stage))
        return [b for b in range(first, t) if self.forward_iteration(stage, b) < t]

    def activation_batch(self, stage: int, t: int) -> int | None:
        """The batch whose activation waits for `stage` (FDG: one hop costs one iteration).

        >>> [Schedule("fdg", 3).activation_batch(k, 4) for k in range(3)]
        [None, 3, 2]
        >>> Schedule("ddg", 3).activation_batch(1, 4)  # DDG passes activations within an iteration
        """
        if self.method not in ("fdg", "dgl") or stage == 0 or t == 0:
            return None
        return self.forward_batch(stage - 1, t - 1)

    def cotangent_batch(self, stage: int, t: int) -> int | None:
        """The batch whose cotangent waits for `stage`, sent by stage + 1 in iteration t-1.

        >>> [Schedule("fdg", 3).cotangent_batch(k, 4) for k in range(3)]
        [0, 1, None]
        >>> [Schedule("ddg", 3).cotangent_batch(k, 4) for k in range(3)]
        [2, 3, None]
        """
        if self.method in ("bp", "dgl") or stage == self.last or t == 0:
            return None
        return self.backward_batch(stage, t)
