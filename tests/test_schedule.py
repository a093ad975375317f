"""The timetable against the papers' table, and its arithmetic statements (who forwards,
who applies which gradient, how stale) against the calls the engine carries out."""

import pytest

from dgrad import schedule as sched
from dgrad.options import METHODS
from dgrad.schedule import Schedule


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
def test_schedule_matches_the_design_table(K):
    t = 20
    for k in range(K):
        bp, ddg, fdg = (Schedule(m, K) for m in ("bp", "ddg", "fdg"))
        assert (bp.forward_batch(k, t), bp.backward_batch(k, t), bp.weight_staleness(k)) == (
            t,
            t,
            0,
        )
        assert (ddg.forward_batch(k, t), ddg.backward_batch(k, t)) == (t, t - (K - 1 - k))
        assert ddg.weight_staleness(k) == K - 1 - k
        assert (fdg.forward_batch(k, t), fdg.backward_batch(k, t)) == (t - k, t - 2 * K + 2 + k)
        assert fdg.gradient_delay(k) == 2 * (K - 1 - k)
        assert fdg.weight_staleness(k) == (2 * (K - 1 - k) - 1 if k < K - 1 else 0)
        assert fdg.shrink_depth(k) == K - 1 - k


def test_fdg_example_from_the_design_note():
    s, t = Schedule("fdg", 3), 10
    assert [(s.backward_batch(k, t), s.forward_batch(k, t)) for k in range(3)] == [
        (t - 4, t),
        (t - 3, t - 1),
        (t - 2, t - 2),
    ]


def test_fill_has_no_batches():
    s = Schedule("fdg", 3)
    assert [s.forward_batch(2, t) for t in range(3)] == [None, None, 0]
    assert [s.backward_batch(0, t) for t in range(5)] == [None] * 4 + [0]


def _replay(schedule, iterations):
    """Carries out `schedule.work` by the calls' own meaning, for each stage: which batch
    it forwards, whose gradient it applies, and how many updates that gradient's weights
    are behind (each forward's weight version against the update that applies it), for the
    batches that enter a full pipeline (the fill has had fewer updates)."""
    K = schedule.num_stages
    version = [0] * K
    forward_version = [{} for _ in range(K)]  # unit -> the weight version it was forwarded at
    summed = [[] for _ in range(K)]
    seen = {"forward": {}, "applied": {}, "staleness": [set() for _ in range(K)]}

    def forward(k, t, unit, previous=False):
        seen["forward"].setdefault((k, t), set()).add(unit if isinstance(unit, int) else unit[0])
        forward_version[k][unit] = version[k] - (1 if previous else 0)

    def update(k, t, units):
        for unit in units:
            batch = unit if isinstance(unit, int) else unit[0]
            seen["applied"].setdefault((k, t), set()).add(batch)
            behind = version[k] - forward_version[k].pop(unit)
            if batch >= schedule.longest_wait():
                seen["staleness"][k].add(behind)
        version[k] += 1

    def gradient(k, t, unit, apply):
        if apply:
            update(k, t, [unit])
        else:
            summed[k].append(unit)

    for t in range(iterations):
        for call in schedule.work(t):
            k = call.stage
            if isinstance(call, sched.Forward):
                forward(k, t, call.unit, call.previous)
            elif isinstance(call, sched.Backward):
                gradient(k, t, call.unit, call.apply)
            elif isinstance(call, sched.BackwardForward):
                if call.update_first:
                    update(k, t, [call.backward])
                    forward(k, t, call.forward)
                else:
                    forward(k, t, call.forward)
                    update(k, t, [call.backward])
            elif isinstance(call, (sched.Loss, sched.LocalLoss)):
                previous = getattr(call, "previous", False)
                forward(k, t, call.unit, previous)
                gradient(k, t, call.unit, getattr(call, "apply", True))
            elif isinstance(call, sched.Apply):
                assert len(summed[k]) == call.count
                update(k, t, summed[k])
                summed[k] = []
    return seen


# The papers' timetables, written out again (DESIGN.md): in iteration t, stage k of K
# forwards batch ... and applies the gradient of batch ...
PAPERS = {
    "bp": lambda t, k, K: (t, t),
    "gpipe": lambda t, k, K: (t, t),
    "1f1b": lambda t, k, K: (t, t),
    "2bw": lambda t, k, K: (t, t),
    "ddg": lambda t, k, K: (t, t - (K - 1 - k)),
    "fr": lambda t, k, K: (t, t - (K - 1 - k)),
    "pipedream": lambda t, k, K: (t, t - (K - 1 - k)),
    "fdg": lambda t, k, K: (t - k, t - k - 2 * (K - 1 - k)),
    "dgl": lambda t, k, K: (t - k, t - k),
}


def _check_replay(schedule, iterations=None):
    K = schedule.num_stages
    iterations = iterations or 4 * K + 2
    seen = _replay(schedule, iterations)
    for k in range(K):
        for t in range(iterations):
            forward, applied = (b if b >= 0 else None for b in PAPERS[schedule.method](t, k, K))
            assert seen["forward"].get((k, t)) == (None if forward is None else {forward})
            assert seen["applied"].get((k, t)) == (None if applied is None else {applied})
            assert schedule.forward_batch(k, t) == forward
            assert schedule.backward_batch(k, t) == applied
        if schedule.method != "fr":  # FR re-forwards on the current weights: 0 by definition
            assert seen["staleness"][k] == {schedule.weight_staleness(k)}, (k, seen)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_the_calls_and_the_arithmetic_say_what_the_papers_do(method, K):
    """The calls `work` makes (replayed), and forward_batch, backward_batch and
    weight_staleness (which the probe, the checkpoint structure and the reference read),
    against the papers' timetables, for every method."""
    assert set(PAPERS) == set(METHODS)
    microbatches = 3 if method in ("gpipe", "1f1b", "2bw") else 1
    _check_replay(Schedule(method, K, microbatches=microbatches))


def test_the_replay_can_fail():
    """A timetable that updated before DDG's forwards would be one update less stale, and
    one that forwarded DDG's batches as FDG does would forward the wrong batches."""

    class UpdateFirst(Schedule):
        def work(self, t):
            return tuple(
                sched.BackwardForward(w.stage, w.backward, w.forward, True)
                if isinstance(w, sched.BackwardForward)
                else w
                for w in super().work(t)
            )

    class Lagging(Schedule):
        def forward_lag(self, stage):
            return stage

    for wrong in (UpdateFirst("ddg", 3), Lagging("ddg", 3)):
        with pytest.raises(AssertionError):
            _check_replay(wrong)
