"""The timetable against the papers' table, and its arithmetic statements (who forwards,
who applies which gradient, how stale) against the calls the engine carries out."""

import pytest

from dgrad import schedule as sched
from dgrad.options import METHODS, MICROBATCHED
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
            elif isinstance(call, sched.WeightGradient):
                gradient(k, t, call.unit, False)
            elif isinstance(call, sched.LossInput):
                forward(k, t, call.unit)
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
    "zb": lambda t, k, K: (t, t),
    "dualpipev": lambda t, k, K: (t, t),
    "2bw": lambda t, k, K: (t, t - (k < K - 1)),  # no flush: b_t's backwards end in t + 1
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
    if method == "dualpipev":  # K groups of 2 chunks, at least 2K microbatches
        _check_replay(Schedule(method, 2 * K, microbatches=2 * K + 1, virtual_stages=2))
        return
    microbatches = 3 if method in MICROBATCHED else 1
    _check_replay(Schedule(method, K, microbatches=microbatches))


@pytest.mark.parametrize("K,V,M", [(2, 2, 2), (2, 2, 4), (2, 3, 4), (3, 2, 3), (4, 2, 8)])
def test_chunked_schedules_apply_each_batch_once_per_chunk_in_its_own_step(K, V, M):
    for schedule in [
        Schedule("1f1b", K * V, microbatches=M, virtual_stages=V),
        *([Schedule("zb", 2 * K, microbatches=M, virtual_stages=2)] if V == 2 else []),
        *(
            [Schedule("dualpipev", 2 * K, microbatches=M, virtual_stages=2)]
            if V == 2 and M >= 2 * K
            else []
        ),
    ]:
        seen = _replay(schedule, 3)
        assert all(seen["applied"][(j, t)] == {t} for j in range(K * V) for t in range(3))
        assert all(seen["staleness"][j] <= {0} for j in range(K * V))


def test_interleaved_1f1b_runs_megatrons_order():
    """Narayanan et al. 2021 (Megatron's interleaved schedule), K = 2 devices, V = 2 chunks
    (stages 0 and 2 on device 0), M = 4: 2(K-1-d) + (V-1)K = 4 warm-up forwards on
    device 0, forwards in rounds of K microbatches per chunk, backwards chunks reversed."""
    F, B = sched.Forward, sched.Backward
    expected = [
        F(0, (0, 0)), F(0, (0, 1)), F(2, (0, 0)), F(2, (0, 1)),
        F(0, (0, 2)), B(2, (0, 0), False), F(0, (0, 3)), B(2, (0, 1), False),
        F(2, (0, 2)), B(0, (0, 0), False), F(2, (0, 3)), B(0, (0, 1), False),
        B(2, (0, 2), False), B(2, (0, 3), False), B(0, (0, 2), False), B(0, (0, 3), False),
        sched.Apply(0, 4), sched.Apply(2, 4),
    ]  # fmt: skip
    assert Schedule("1f1b", 4, microbatches=4, virtual_stages=2).device_work(0, 0) == expected


def test_zero_bubble_runs_zb_h1():
    """Qi et al. 2024, ZB-H1 with K = 3, M = 4: stage k runs 1F1B's order with B in place
    of the backward and its W's k behind its B's (the last stage's B is in its loss call),
    so no stage holds more than K records."""
    F, B, W, L = sched.Forward, sched.InputGradient, sched.WeightGradient, sched.LossInput
    u = [(0, m) for m in range(4)]
    s = Schedule("zb", 3, microbatches=4)
    assert s.stage_work(0, 0) == [
        *(F(0, u[m]) for m in range(3)), sched.Backward(0, u[0], False), F(0, u[3]),
        *(sched.Backward(0, u[m], False) for m in (1, 2, 3)), sched.Apply(0, 4),
    ]  # fmt: skip
    assert s.stage_work(1, 0) == [
        F(1, u[0]), F(1, u[1]), B(1, u[0]), F(1, u[2]), B(1, u[1]), W(1, u[0]),
        F(1, u[3]), B(1, u[2]), W(1, u[1]), B(1, u[3]), W(1, u[2]), W(1, u[3]),
        sched.Apply(1, 4),
    ]  # fmt: skip
    assert s.stage_work(2, 0) == [
        L(2, u[0]), L(2, u[1]), L(2, u[2]), W(2, u[0]), L(2, u[3]), W(2, u[1]),
        W(2, u[2]), W(2, u[3]), sched.Apply(2, 4),
    ]  # fmt: skip
    assert [s.most_kept(k, 0) for k in range(3)] == [3, 3, 3]


def test_zero_bubble_v_runs_zb_v():
    """Qi et al. 2024, section 6, ZB-V with K = 2, M = 4: device 0 holds chunks 0 and 3
    (the loss), device 1 chunks 1 and 2. Device d: 2(K-d)-1 forwards of its first chunk;
    d times F of each chunk; K-d times F, B, W of its second; F, B, W of the first and of
    the second in turn while forwards are left; d times B of each; K-d times B and W of
    the first; the W's left. Chunk 3's F and B are its LossInput, chunk 0's B and W one
    Backward. Every device then holds at most 2K chunk records, 1F1B's memory."""
    F, B, W, L = sched.Forward, sched.InputGradient, sched.WeightGradient, sched.LossInput
    u = [(0, m) for m in range(4)]

    def back(m):
        return sched.Backward(0, u[m], False)

    s = Schedule("zb", 4, microbatches=4, virtual_stages=2)
    assert [s.device_of(j) for j in range(4)] == [0, 1, 1, 0]
    assert s.device_work(0, 0) == [
        F(0, u[0]), F(0, u[1]), F(0, u[2]),
        L(3, u[0]), W(3, u[0]), L(3, u[1]), W(3, u[1]),
        F(0, u[3]), back(0), L(3, u[2]), W(3, u[2]),
        back(1), L(3, u[3]), W(3, u[3]),
        back(2), back(3),
        sched.Apply(3, 4), sched.Apply(0, 4),
    ]  # fmt: skip
    assert s.device_work(1, 0) == [
        F(1, u[0]),
        F(2, u[0]), F(1, u[1]),
        F(2, u[1]), B(2, u[0]), W(2, u[0]),
        F(1, u[2]), B(1, u[0]), W(1, u[0]), F(2, u[2]), B(2, u[1]), W(2, u[1]),
        F(1, u[3]), B(1, u[1]), W(1, u[1]), F(2, u[3]), B(2, u[2]), W(2, u[2]),
        B(1, u[2]), B(2, u[3]),
        B(1, u[3]), W(1, u[2]),
        W(2, u[3]), W(1, u[3]),
        sched.Apply(2, 4), sched.Apply(1, 4),
    ]  # fmt: skip
    for K, M in [(2, 4), (3, 6), (4, 8), (4, 16)]:
        v = Schedule("zb", 2 * K, microbatches=M, virtual_stages=2)
        for d in range(K):
            held = most = 0
            for call in v.device_work(d, 0):
                held += isinstance(call, (F, L)) - isinstance(call, (W, sched.Backward))
                most = max(most, held)
            assert most <= 2 * K, (K, M, d, most)


def test_zero_bubble_v_takes_two_chunks_a_group_and_any_microbatches():
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        Schedule("zb", 6, microbatches=4, virtual_stages=3)
    for K in (1, 2, 3, 4):
        for M in (1, 2, 3, 5, 8):  # M < 2K-1 drops the schedule's extra microbatches
            work = Schedule("zb", 2 * K, microbatches=M, virtual_stages=2).work(0)
            for j in range(2 * K):
                applied = [w for w in work if isinstance(w, sched.Apply) and w.stage == j]
                assert applied == [sched.Apply(j, M)]
                if 0 < j < 2 * K - 1:
                    grads = [
                        w.unit for w in work if type(w) is sched.WeightGradient and w.stage == j
                    ]
                    assert grads == [(0, m) for m in range(M)]


def test_2bw_overlaps_the_steps_and_carries_one_gradient_sum():
    """No flush: stage k's forwards run min(K-1-k, M) microbatches ahead of its backwards
    across steps, b_t's microbatches all at W^{t-1} (the current weights before b_{t-1}'s
    update, the previous version after it)."""
    s = Schedule("2bw", 3, microbatches=2)
    F, B = sched.Forward, sched.Backward
    assert s.stage_work(0, 4) == [
        F(0, (4, 0), False), B(0, (3, 0), False), F(0, (4, 1), False), B(0, (3, 1), False),
        sched.Apply(0, 2, keep_previous=True),
    ]  # fmt: skip
    assert s.stage_work(1, 4) == [
        F(1, (4, 0), False), B(1, (3, 1), False), sched.Apply(1, 2, keep_previous=True),
        F(1, (4, 1), True), B(1, (4, 0), False),
    ]  # fmt: skip
    assert s.in_flight(5) == sched.InFlight(
        kept=([(4, 0), (4, 1)], [(4, 1)], []),
        activations=(None, None, None),
        cotangents=((4, 0), (4, 1), None),
        summing=(None, 4, None),
    )


@pytest.mark.parametrize(
    "method,K,M,V", [("1f1b", 4, 3, 1), ("1f1b", 4, 2, 2), ("zb", 4, 3, 1), ("zb", 4, 5, 2)]
)
def test_every_synchronous_order_is_free_of_deadlock(method, K, M, V):
    for k in range(1, K + 1):
        for m in range(1, 2 * M + 1):
            if V == 1 or method == "zb" or m % k == 0:
                Schedule(method, k * V, microbatches=m, virtual_stages=V).work(0)


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


def _every_timetable():
    yield Schedule("bp", 3, fused=True)
    for method in METHODS:
        if method == "dualpipev":
            continue  # only in a V: below
        for K in (1, 2, 3, 4):
            for M in (1, 2, 4) if method in MICROBATCHED else (1,):
                yield Schedule(method, K, microbatches=M)
    for K, V, M in [(2, 2, 2), (2, 2, 4), (3, 2, 3), (2, 3, 4)]:
        yield Schedule("1f1b", K * V, microbatches=M, virtual_stages=V)
    for K, M in [(1, 2), (2, 2), (2, 4), (3, 5)]:
        yield Schedule("zb", 2 * K, microbatches=M, virtual_stages=2)
    for K, M in [(1, 2), (2, 4), (3, 7)]:
        yield Schedule("dualpipev", 2 * K, microbatches=M, virtual_stages=2)


def test_the_work_of_a_full_pipeline_is_the_one_before_it_renamed():
    """`work` renames one iteration's calls from `steady_iteration` on: each method's
    iterations before it and well after it are the calls its rules build."""
    for schedule in _every_timetable():
        for t in range(schedule.steady_iteration + 7):
            assert schedule.work(t) == schedule.build_work(t), (schedule, t)


def test_renaming_from_the_fill_would_differ():
    """The control: an iteration of the fill, renamed, is not the later iteration's work,
    so the test above fails where `steady_iteration` comes too early."""
    fdg = Schedule("fdg", 3)  # stage 0 applies its first gradient in iteration 4
    assert sched._renamed(sched._plan(fdg.build_work(5)), 5) == fdg.build_work(10)
    assert sched._renamed(sched._plan(fdg.build_work(3)), 5) != fdg.build_work(8)
    two_bw = Schedule("2bw", 2, microbatches=2)  # iteration 0 has no step before to drain
    assert sched._renamed(sched._plan(two_bw.build_work(0)), 3) != two_bw.build_work(3)


def test_every_call_kind_names_stage_functions_and_a_carrier():
    from dgrad.pipeline import Pipeline
    from dgrad.stage import Calls

    for kind in sched.KINDS:
        assert set(kind.functions) <= set(Calls._fields) | {"fused_step"}, kind
        assert callable(getattr(Pipeline, f"_do_{kind.name}")), kind


def test_dualpipe_v_runs_its_eight_phases():
    """DualPipeV (DeepSeek-AI 2024) with K = 2, M = 4: device 0 holds chunks 0 and 3 (the
    loss), device 1 chunks 1 and 2. Device 1 (d = K-1): d+1 times F of each chunk, then
    M-2K+d+1 times F0 B1 F1 B0, then d+1 times B1 B0, the second half with its W left for
    the end. Chunk 3's F and B are one call (LossInput where its W is left), chunk 0's B
    and W one Backward; every batch is applied once per chunk in its own step."""
    F, B, In, W = sched.Forward, sched.Backward, sched.InputGradient, sched.WeightGradient
    u = [(0, m) for m in range(4)]
    s = Schedule("dualpipev", 4, microbatches=4, virtual_stages=2)
    assert s.device_work(1, 0) == [
        F(1, u[0]), F(2, u[0]), F(1, u[1]), F(2, u[1]),
        F(1, u[2]), B(2, u[0], False), F(2, u[2]), B(1, u[0], False),
        F(1, u[3]), B(2, u[1], False), F(2, u[3]), B(1, u[1], False),
        B(2, u[2], False), B(1, u[2], False), In(2, u[3]), In(1, u[3]),
        W(2, u[3]), W(1, u[3]),
        sched.Apply(2, 4), sched.Apply(1, 4),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least 2K microbatches"):
        Schedule("dualpipev", 4, microbatches=3, virtual_stages=2)
    with pytest.raises(ValueError, match="use virtual_stages=2"):
        Schedule("dualpipev", 4, microbatches=4)
