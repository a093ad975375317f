"""Who forwards and who back-propagates which batch, at which iteration.

The three training methods of dgrad differ only in their timetable. This module
states that timetable as plain integer arithmetic so that the pipeline engine,
the single-device reference and the optax delay transforms can share one
source of truth, and so that tests can check it against the papers:

| method | stage k forwards | stage k backprops | iterations between |
|--------|------------------|-------------------|--------------------|
| bp     | b_t              | b_t               | 0                  |
| ddg    | b_t              | b_{t-(K-1-k)}     | K-1-k              |
| fdg    | b_{t-k}          | b_{t-2K+2+k}      | 2(K-1-k)           |

>>> s = Schedule("fdg", num_stages=3)
>>> [s.forward_batch(k, 4) for k in range(3)], [s.backward_batch(k, 4) for k in range(3)]
([4, 3, 2], [0, 1, 2])
>>> [s.weight_staleness(k) for k in range(3)]
[3, 1, 0]
"""

from __future__ import annotations

import dataclasses

METHODS = ("bp", "ddg", "fdg")


def check_method(method: str) -> str:
    """Returns `method` if it names a training method, else raises ValueError."""
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    return method


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The timetable of `method` on a pipeline of `num_stages` stages."""

    method: str
    num_stages: int

    def __post_init__(self):
        check_method(self.method)
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}.")

    @property
    def last(self) -> int:
        return self.num_stages - 1

    def gradient_delay(self, stage: int) -> int:
        """Iterations between stage's forward of a batch and its backward of it."""
        depth = self.last - stage
        return {"bp": 0, "ddg": depth, "fdg": 2 * depth}[self.method]

    def forward_lag(self, stage: int) -> int:
        """How many iterations after it entered the pipeline `stage` forwards a batch."""
        return stage if self.method == "fdg" else 0

    def forward_batch(self, stage: int, t: int) -> int | None:
        """Index of the batch `stage` forwards in iteration `t` (None during fill)."""
        b = t - self.forward_lag(stage)
        return b if b >= 0 else None

    def backward_batch(self, stage: int, t: int) -> int | None:
        """Index of the batch whose gradient `stage` applies in iteration `t`."""
        b = t - self.forward_lag(stage) - self.gradient_delay(stage)
        return b if b >= 0 else None

    def forward_iteration(self, stage: int, batch: int) -> int:
        return batch + self.forward_lag(stage)

    def backward_iteration(self, stage: int, batch: int) -> int:
        return batch + self.forward_lag(stage) + self.gradient_delay(stage)

    def updates_before_forward(self, stage: int) -> bool:
        """FDG stages (but the last) update first and forward with the new weights."""
        return self.method == "fdg" and stage < self.last

    def weight_staleness(self, stage: int) -> int:
        """Updates applied between a batch's forward and the update using its gradient."""
        delay = self.gradient_delay(stage)
        return delay - 1 if self.updates_before_forward(stage) else delay

    def shrink_depth(self, stage: int) -> int:
        """Power of beta that gradient shrinking applies to `stage`'s gradient."""
        return self.last - stage
