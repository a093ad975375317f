"""The timing model: the papers' ideal bubbles from unit costs, the engine's own calls
named as it dispatches them, and costs that reach the prediction."""

import jax
import pytest
from helpers import batches, build_pipeline

from dgrad import schedule as sched
from dgrad.measure.timeline import Event
from dgrad.measure.timing import UNIT_COSTS, costs_of, every_stage, simulate
from dgrad.schedule import Schedule


@pytest.mark.parametrize("K,M", [(2, 4), (4, 8), (3, 5), (8, 32)])
def test_gpipe_and_1f1b_have_the_papers_bubble(K, M):
    for method in ("gpipe", "1f1b"):
        prediction = simulate(Schedule(method, K, microbatches=M))
        assert prediction.idle == pytest.approx([(K - 1) / (M + K - 1)] * K)
        assert prediction.step_seconds == pytest.approx(3 * (M + K - 1))


@pytest.mark.parametrize("K,V,M", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (2, 3, 2)])
def test_interleaving_divides_the_bubble_by_the_virtual_stages(K, V, M):
    """Narayanan et al. 2021: chunks of 1/V the work, so a bubble of (K-1)/V chunk-steps
    against V*M of work: idle share (K-1)/(V*M + K-1)."""
    prediction = simulate(Schedule("1f1b", K * V, microbatches=M, virtual_stages=V))
    assert prediction.idle == pytest.approx([(K - 1) / (V * M + K - 1)] * K)


@pytest.mark.parametrize("K,M", [(2, 3), (2, 4), (3, 5), (4, 8), (8, 16)])
def test_zero_bubble_v_has_no_bubble_once_m_reaches_2k_minus_1(K, M):
    """ZB-V with F = B = W on chunks (Qi et al. 2024, section 6): every device busy for
    its 2 chunks' 3M units, so no idle time at all once M >= 2K-1; with fewer
    microbatches the V cannot fill (the control)."""
    zbv = simulate(Schedule("zb", 2 * K, microbatches=M, virtual_stages=2))
    assert zbv.idle == pytest.approx([0.0] * K)
    assert zbv.step_seconds == pytest.approx(2 * 3 * M)
    short = simulate(Schedule("zb", 2 * K, microbatches=2 * K - 2, virtual_stages=2))
    assert min(short.idle) > 0


@pytest.mark.parametrize("K,M", [(2, 4), (4, 8), (4, 4)])
def test_zero_bubble_needs_less_than_1f1b_and_2bw_without_a_flush_none(K, M):
    """ZB-H1 with F = B = W (Qi et al. 2024): a bubble of (K-1)(F+B-W) = (K-1) against
    1F1B's 3(K-1); 2BW's steady state, with no flush, and FDG's have none."""
    zb = simulate(Schedule("zb", K, microbatches=M))
    assert zb.step_seconds == pytest.approx(3 * M + (K - 1))
    assert zb.step_seconds < simulate(Schedule("1f1b", K, microbatches=M)).step_seconds
    assert simulate(Schedule("2bw", K, microbatches=M)).idle == pytest.approx([0.0] * K)
    assert simulate(Schedule("fdg", K)).idle == pytest.approx([0.0] * K)


@pytest.mark.parametrize("K", [3, 4, 8])
def test_2bw_has_no_bubble_only_once_m_reaches_k_minus_1(K):
    """With two weight versions a stage runs at most M microbatches ahead of its own
    backwards: below M = K-1 it waits, at K = 8, M = 4 longer than GPipe's bubble."""
    for M in range(1, K + 1):
        idle = max(simulate(Schedule("2bw", K, microbatches=M)).idle)
        assert (idle == pytest.approx(0.0)) == (M >= K - 1), (M, idle)
    gpipe = max(simulate(Schedule("gpipe", 8, microbatches=4)).idle)
    assert max(simulate(Schedule("2bw", 8, microbatches=4)).idle) > gpipe


def test_the_model_sees_an_order_that_waits():
    """A GPipe whose stages back-propagate last microbatch first wait for the last loss
    before their first backward: the model gives it more than the ideal bubble."""

    class Reversed(Schedule):
        def stage_work(self, stage, t):
            work = super().stage_work(stage, t)
            if stage == self.last:
                return work
            M = self.microbatches
            return work[:M] + work[M : 2 * M][::-1] + work[2 * M :]

    K, M = 4, 8
    assert simulate(Reversed("gpipe", K, microbatches=M)).idle[0] > (K - 1) / (M + K - 1) + 0.1


def test_costs_reach_the_prediction():
    """A stage twice as slow sets the pace; dispatch on the host and moves add up."""
    s = Schedule("1f1b", 2, microbatches=4)
    free = {(None, "loss_sum"): 0.0, (None, "apply_sum"): 0.0}
    slow = simulate(
        s, {(0, "forward"): 2.0, (None, "forward"): 1.0, (None, "backward_sum"): 2.0, **free}
    )
    assert slow.busy_seconds == (4 * 2.0 + 4 * 2.0, 0.0)  # stage 1's loss_sum costs nothing
    assert simulate(s, dispatch=2.0).step_seconds == 2.0 * (4 + 4 + 1 + 4 + 1)  # host-bound
    assert simulate(s, move=1.0).step_seconds > simulate(s).step_seconds


def test_a_call_without_a_cost_is_named_not_taken_as_free():
    """Costs measured at K = 2 name no stage 2 or 3: a K = 4 prediction from them says
    so, and `every_stage` carries them over (a K = 4 stage does half a K = 2 stage's work)."""
    measured = {
        (0, "forward"): 1.0,
        (0, "backward_sum"): 2.0,
        (1, "loss_sum"): 3.0,
        (0, "apply_sum"): 0.0,
        (1, "apply_sum"): 0.0,
    }
    assert simulate(Schedule("gpipe", 2, microbatches=4), measured).step_seconds == 15.0
    four = Schedule("gpipe", 4, microbatches=4)
    with pytest.raises(ValueError, match=r"no cost for stage 1's forward: give costs\[\(1, "):
        simulate(four, measured)
    carried = simulate(four, every_stage(measured, scale=2 / 4))
    assert carried.step_seconds == pytest.approx(1.5 * (4 + 4 - 1))  # (M+K-1) x (F+B)/2
    with pytest.raises(ValueError, match="unit costs do not cover fused_step"):
        simulate(Schedule("bp", 2, fused=True))


def test_costs_of_takes_each_functions_median():
    events = [
        Event(0, k, name, 0, 0.0, d) for k, name, d in [(0, "f", 1), (0, "f", 3), (1, "f", 2)]
    ]
    assert costs_of(events) == {(0, "f"): 2.0, (1, "f"): 2.0}


@pytest.mark.parametrize(
    "method,K,options",
    [
        ("fdg", 3, {}),
        ("ddg", 2, {}),
        ("bp", 2, {}),
        ("gpipe", 2, dict(microbatches=2)),
        ("zb", 3, dict(microbatches=4)),
        ("2bw", 3, dict(microbatches=2)),
        ("1f1b", 4, dict(microbatches=2, virtual_stages=2)),
    ],
)
def test_each_call_declares_the_function_the_engine_runs(method, K, options):
    pipe = build_pipeline("mlp", K, method=method, devices=jax.devices()[:1], **options)
    seen = []

    def wrap(k, name, fn):
        def watched(*args):
            seen.append((k, name))
            return fn(*args)

        return watched

    view = pipe.observed(wrap)
    data = batches("mlp", 4)
    state = view.init(data[0])
    for t, batch in enumerate(data):
        seen.clear()
        state, _ = view.step(state, batch)
        expected = [(c.stage, c.function) for c in pipe.schedule.work(t)]
        assert seen == expected, (t, seen, expected)
    assert any(isinstance(c, sched.WeightGradient) for c in pipe.schedule.work(1)) == (
        method == "zb"
    )


def test_the_papers_unit_costs_are_those_the_call_kinds_declare():
    """A forward 1, a whole backward 2 (zero-bubble's B and W 1 each), read off the kinds."""
    assert UNIT_COSTS == {
        "forward": 1.0,
        "backward_update": 2.0,
        "backward_sum": 2.0,
        "backward_input": 1.0,
        "backward_weights": 1.0,
        "loss_input": 2.0,
        "step": 3.0,
        "loss_step": 3.0,
        "loss_sum": 3.0,
        "aux_step": 3.0,
        "apply_sum": 0.0,
    }


@pytest.mark.parametrize("K,M", [(2, 4), (4, 8), (4, 16)])
def test_dualpipe_v_bubble_is_within_its_papers(K, M):
    """DualPipe's table gives DualPipeV's bubble as (PP/2-1)(F&B+B-3W) on PP = 2K chunks;
    with the papers' unit costs (F 1, full B 2, W 1) and nothing overlapped (F&B = F+B) that
    is 2(K-1) units per step beside 6M of work per device. The engine runs the last chunk's
    F and B as one call and chunk 0's B and W as one, so it predicts less: K-1."""
    prediction = simulate(Schedule("dualpipev", 2 * K, microbatches=M, virtual_stages=2))
    work = 2 * M * (1 + 2)
    assert prediction.busy_seconds == pytest.approx((work,) * K)
    assert prediction.step_seconds - work == pytest.approx(K - 1)
    assert prediction.step_seconds - work <= 2 * (K - 1)
