"""Synchronous pipelines (GPipe, 1F1B-flush, interleaved 1F1B, zero-bubble) and the
PipeDream family (PipeDream, PipeDream-2BW) against the plain reference, fused backprop
and the optax delay transform, on one device, on one device per stage and with every
stage replicated."""

import jax
import numpy as np
import pytest
from helpers import (
    ROOT,
    SMOOTH_OPTIMIZER,
    assert_close,
    assert_matches_reference,
    batches,
    build_pipeline,
    check_on_layouts,
    layouts,
    layouts_and_optimizers,
    optimizer,
    params_of,
    reference,
    run_pipeline,
    summing,
)
from processes import rerun_with_cpu_devices

from dgrad import optim

SLOW = pytest.mark.slow


def check(model, num_stages, method, microbatches, memory="residuals", names=None):
    check_on_layouts(
        model, num_stages, method, names=names, memory=memory, microbatches=microbatches
    )


def fast_if(condition):
    return () if condition else (SLOW,)


@pytest.mark.parametrize(
    "num_stages,microbatches",
    [pytest.param(K, M, marks=fast_if((K, M) == (2, 2))) for K in (1, 2, 3, 4) for M in (1, 2, 4)],
)
@pytest.mark.parametrize("method", ["gpipe", "1f1b", "zb", "2bw"])
def test_mlp_matches_reference(method, num_stages, microbatches):
    check("mlp", num_stages, method, microbatches)


def interleaved_layouts():
    """Interleaved 1F1B's layouts of K = 2 device groups: one device, a device per group,
    2 replicas per group."""
    devices = jax.devices()
    return {
        "one device": dict(devices=devices[:1]),
        "a device per group": dict(devices=devices[:2], placement="one_per_device"),
        "2 replicas per group": dict(devices=devices[:4], data_parallel=2),
    }


@pytest.mark.parametrize(
    "model,virtual_stages,microbatches",
    [
        ("mlp", 2, 2),
        pytest.param("mlp", 2, 4, marks=SLOW),
        pytest.param("deep mlp", 3, 4, marks=SLOW),
        pytest.param("cnn", 2, 2, marks=SLOW),
    ],
)
def test_interleaved_1f1b_matches_gpipe_on_its_chunks(model, virtual_stages, microbatches):
    """K = 2 groups of V chunks: GPipe's numbers on the K*V chunks (BatchNorm per
    microbatch too), on every layout; with a control that the comparison can fail."""
    chunks = 2 * virtual_stages
    for name, layout in interleaved_layouts().items():
        # The CNN's 4 chunks at M = 2 under SMOOTH_OPTIMIZER reach a point where the
        # reference itself moves by 1.6e-3 between its jitted and its eager arithmetic
        # (measured); under the test optimizer every layout is within 5e-6 of both.
        smooth = "replicas" in name and model != "cnn"
        tx = SMOOTH_OPTIMIZER if smooth else optimizer
        options = dict(microbatches=microbatches, optimizer=tx)
        ref = reference(model, chunks, method="gpipe", **options)
        pipe, state, history = run_pipeline(
            model, chunks, method="1f1b", virtual_stages=virtual_stages, **options, **layout
        )
        assert [pipe.placement.groups[j] for j in range(chunks)] == [
            pipe.placement.groups[j % 2] for j in range(chunks)
        ]
        try:
            assert_matches_reference(state, history, ref)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
        with pytest.raises(AssertionError):
            assert_matches_reference(state, history, reference(model, chunks, "2bw", **options))


def check_in_a_v(method, model, microbatches, *, smooth_on_replicas):
    """`method` on K = 2 groups of 2 chunks in a V (chunks 0 and 3 on one group, 1 and 2 on
    the other) gives GPipe's numbers on the 4 chunks on every layout (the smooth optimizer
    on the replicated one where `smooth_on_replicas`), and the comparison with 2BW's
    reference fails."""
    for name, layout in interleaved_layouts().items():
        smooth = smooth_on_replicas and "replicas" in name
        tx = SMOOTH_OPTIMIZER if smooth else optimizer
        options = dict(microbatches=microbatches, optimizer=tx)
        ref = reference(model, 4, method="gpipe", **options)
        pipe, state, history = run_pipeline(
            model, 4, method=method, virtual_stages=2, **options, **layout
        )
        groups = pipe.placement.groups
        assert [groups[j] for j in range(4)] == [groups[0], groups[1], groups[1], groups[0]]
        try:
            assert_matches_reference(state, history, ref)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
        with pytest.raises(AssertionError):
            assert_matches_reference(state, history, reference(model, 4, "2bw", **options))


@pytest.mark.parametrize(
    "model,microbatches",
    [("mlp", 2), pytest.param("mlp", 4, marks=SLOW), pytest.param("cnn", 4, marks=SLOW)],
)
def test_zero_bubble_v_matches_gpipe_on_its_chunks(model, microbatches):
    """ZB-V: K = 2 groups of 2 chunks in a V (chunks 0 and 3 on one group, 1 and 2 on the
    other), GPipe's numbers on the 4 chunks, on every layout (M = 2, under the schedule's
    2K-1, leaves microbatches out of its order); a control that the comparison can fail."""
    check_in_a_v("zb", model, microbatches, smooth_on_replicas=True)


@pytest.mark.parametrize(
    "model,microbatches",
    [("mlp", 4), pytest.param("cnn", 4, marks=SLOW)],
)
def test_dualpipe_v_matches_gpipe_on_its_chunks(model, microbatches):
    """DualPipeV: ZB-V's V (chunks 0 and 3 on one group, 1 and 2 on the other) in its own
    order, GPipe's numbers on the 4 chunks, on every layout; a control that the comparison
    can fail."""
    check_in_a_v("dualpipev", model, microbatches, smooth_on_replicas=model != "cnn")


def accumulating(k: int):
    """The test optimizer stepping once per two gradients, their sum written out."""
    return summing(optimizer(k), 2)


@pytest.mark.parametrize(
    "method,virtual_stages",
    [
        ("gpipe", 1),
        pytest.param("1f1b", 1, marks=SLOW),
        ("zb", 1),
        ("2bw", 1),
        pytest.param("1f1b", 2, marks=SLOW),
        ("zb", 2),
    ],
)
def test_accumulate_sums_two_steps_and_updates_once(method, virtual_stages):
    """accumulate=2 on the synchronous pipelines and 2BW: each stage (chunk) adds up two
    steps' gradients and steps once, the reference's optimizer with the sum written out;
    interleaved 1F1B and ZB-V against GPipe on their chunks; on one device and a device
    per group, with a control that updates every step."""
    chunks = 2 * virtual_stages
    method_of_reference = "gpipe" if virtual_stages > 1 else method
    options = dict(microbatches=2)
    ref = reference("mlp", chunks, method_of_reference, optimizer=accumulating, **options)
    for devices in (jax.devices()[:1], jax.devices()[:2]):
        _, state, history = run_pipeline(
            "mlp",
            chunks,
            method=method,
            virtual_stages=virtual_stages,
            accumulate=2,
            devices=devices,
            **options,
        )
        assert_matches_reference(state, history, ref)
    with pytest.raises(AssertionError):
        assert_matches_reference(
            state, history, reference("mlp", chunks, method_of_reference, **options)
        )


@pytest.mark.parametrize(
    "method,memory",
    [
        ("gpipe", "recompute"),
        pytest.param("gpipe", "dots", marks=SLOW),
        pytest.param("1f1b", "recompute", marks=SLOW),
        ("2bw", "recompute"),
    ],
)
def test_memory_policies_keep_the_numbers(method, memory):
    check("mlp", 2, method, 2, memory=memory, names=["a device per stage"])


@pytest.mark.parametrize(
    "method,num_stages,microbatches",
    [
        pytest.param("gpipe", 2, 2, marks=SLOW),
        pytest.param("gpipe", 3, 4, marks=SLOW),
        pytest.param("1f1b", 2, 4, marks=SLOW),
        pytest.param("2bw", 2, 2, marks=SLOW),
        pytest.param("2bw", 3, 2, marks=SLOW),
        pytest.param("gpipe", 1, 2, marks=SLOW),
        pytest.param("1f1b", 4, 2, marks=SLOW),
        pytest.param("2bw", 2, 1, marks=SLOW),
    ],
)
def test_batchnorm_cnn_normalises_each_microbatch_as_the_reference(
    method, num_stages, microbatches
):
    """BatchNorm with each microbatch's own statistics, the running averages moved once per
    microbatch in order, whatever the layout (replicas split a microbatch further)."""
    check("cnn", num_stages, method, microbatches)


@SLOW
@pytest.mark.parametrize("method,memory", [("gpipe", "recompute"), ("1f1b", "dots")])
def test_batchnorm_cnn_keeps_its_numbers_under_the_memory_policies(method, memory):
    """A recomputed forward moves no running average a second time."""
    check("cnn", 2, method, 2, memory=memory, names=["a device per stage"])


@pytest.mark.parametrize(
    "num_stages,microbatches",
    [pytest.param(K, M, marks=fast_if((K, M) == (3, 4))) for K in (1, 2, 3, 4) for M in (1, 2, 4)],
)
def test_gpipe_and_1f1b_equal_fused_backprop_without_batchnorm(num_stages, microbatches):
    data = batches("mlp", 6)
    _, fused, _ = run_pipeline(
        "mlp", num_stages, data=data, method="bp", fused=True, devices=jax.devices()[:1]
    )
    for layout in layouts(num_stages, replicas=2).values():
        for method in ("gpipe", "1f1b"):
            _, state, history = run_pipeline(
                "mlp", num_stages, data=data, method=method, microbatches=microbatches, **layout
            )
            assert_close(params_of(state), params_of(fused))
            assert [m["batch"] for m in history] == list(range(len(data)))


@SLOW
@pytest.mark.parametrize("method", ["gpipe", "1f1b", "2bw", "pipedream"])
def test_every_stage_replicated_at_three_and_four_stages(request, method):
    """K x D beyond the 4 test devices: K = 3 and 4 with 2 replicas per stage, on 8 fake
    devices (the test reruns itself in a process of its own that has them), with a control."""
    if rerun_with_cpu_devices(request, 8, ROOT):
        return
    microbatches = 1 if method == "pipedream" else 2
    for num_stages in (3, 4):
        check("mlp", num_stages, method, microbatches, names=["2 replicas per stage"])
    other = dict(method="ddg", weights="current") if method == "pipedream" else dict(method="fdg")
    _, state, history = run_pipeline(
        "mlp",
        4,
        method=method,
        microbatches=microbatches,
        optimizer=SMOOTH_OPTIMIZER,
        **layouts(4, replicas=2)["2 replicas per stage"],
    )
    with pytest.raises(AssertionError):
        assert_matches_reference(
            state, history, reference("mlp", 4, optimizer=SMOOTH_OPTIMIZER, **other)
        )


@pytest.mark.parametrize("num_stages", [1, 2, pytest.param(3, marks=SLOW), 4])
def test_pipedream_matches_the_reference_of_ddg_with_stashed_weights(num_stages):
    check("mlp", num_stages, "pipedream", 1)


def test_one_microbatch_is_staged_backprop_bit_for_bit():
    data = batches("mlp", 5)
    runs = [
        run_pipeline("mlp", 3, data=data, method=method, devices=jax.devices()[:3])[1]
        for method in ("bp", "gpipe")
    ]
    assert_close(params_of(runs[1]), params_of(runs[0]), rtol=0, atol=0)


@pytest.mark.parametrize(
    "model, method, microbatches, other",
    [
        pytest.param("cnn", "gpipe", 2, dict(method="bp"), marks=SLOW),
        pytest.param("cnn", "gpipe", 2, dict(method="gpipe", microbatches=4), marks=SLOW),
        pytest.param("cnn", "1f1b", 4, dict(method="bp"), marks=SLOW),
        ("mlp", "2bw", 2, dict(method="gpipe", microbatches=2)),
        ("mlp", "zb", 2, dict(method="2bw", microbatches=2)),
        pytest.param("mlp", "gpipe", 2, dict(method="2bw", microbatches=2), marks=SLOW),
        pytest.param("mlp", "1f1b", 2, dict(method="2bw", microbatches=2), marks=SLOW),
        ("mlp", "pipedream", 1, dict(method="fdg")),
        pytest.param("mlp", "pipedream", 1, dict(method="ddg", weights="current"), marks=SLOW),
    ],
)
def test_the_comparison_can_fail(model, method, microbatches, other):
    """GPipe's and 1F1B's per-microbatch BatchNorm is not backprop's, 2BW is not GPipe or
    1F1B, and M matters with BatchNorm: the checks above would see each difference, on
    every layout they run on."""
    for _, layout, tx in layouts_and_optimizers(2, replicas=2):
        ref = reference(model, 2, method=method, optimizer=tx, microbatches=microbatches)
        wrong = reference(model, 2, optimizer=tx, **other)
        _, state, history = run_pipeline(
            model, 2, method=method, microbatches=microbatches, optimizer=tx, **layout
        )
        assert_matches_reference(state, history, ref)
        with pytest.raises(AssertionError):
            assert_matches_reference(state, history, wrong)


def _calls_per_stage(method, num_stages, microbatches):
    """The order of each stage's calls in one step, as the engine dispatched them."""
    order = []
    pipe = build_pipeline(
        "mlp", num_stages, method=method, microbatches=microbatches, devices=jax.devices()[:1]
    )

    def wrap(k, name, fn):
        def watched(*args):
            order.append((k, name))
            return fn(*args)

        return watched

    view = pipe.observed(wrap)
    data = batches("mlp", 1)
    state, _ = view.step(view.init(data[0]), data[0])
    return order


@pytest.mark.parametrize(
    "num_stages,microbatches",
    [(2, 4), pytest.param(3, 4, marks=SLOW), pytest.param(4, 8, marks=SLOW), (4, 2)],
)
def test_1f1b_keeps_at_most_K_minus_k_records_and_gpipe_M(num_stages, microbatches):
    for method, bound in [("1f1b", lambda k: num_stages - k), ("gpipe", lambda k: microbatches)]:
        held, most = [0] * num_stages, [0] * num_stages
        for k, name in _calls_per_stage(method, num_stages, microbatches):
            held[k] += {"forward": 1, "backward_sum": -1}.get(name, 0)
            most[k] = max(most[k], held[k])
        assert held == [0] * num_stages
        expected = [min(bound(k), microbatches) for k in range(num_stages - 1)]
        assert most[:-1] == expected, (method, most)


def test_zero_bubble_splits_each_backward_and_keeps_at_most_K_records():
    """B (backward_input) and W (backward_weights) are separate calls, every W after its
    B, and no stage holds more than K records (a record lives from its forward to its W)."""
    K, M = 3, 4
    calls = _calls_per_stage("zb", K, M)
    held, most = [0] * K, [0] * K
    for k, name in calls:
        held[k] += {"forward": 1, "loss_input": 1, "backward_sum": -1, "backward_weights": -1}.get(
            name, 0
        )
        most[k] = max(most[k], held[k])
    assert held == [0] * K and max(most) <= K
    for k in (1, 2):
        names = [name for j, name in calls if j == k]
        first = "backward_input" if k == 1 else "loss_input"
        assert names.count(first) == names.count("backward_weights") == M
        assert "backward_sum" not in names and "loss_sum" not in names


def test_1f1b_alternates_after_its_warm_up():
    stage0 = [name for k, name in _calls_per_stage("1f1b", 3, 4) if k == 0]
    assert stage0 == ["forward"] * 3 + ["backward_sum", "forward"] + ["backward_sum"] * 3 + [
        "apply_sum"
    ]


@pytest.mark.parametrize("num_stages", [2, pytest.param(3, marks=SLOW), 4])
def test_pipedream_forwards_and_updates_see_its_weight_versions(num_stages):
    """PipeDream (asynchronous 1F1B, weight stashing): stage k forwards b_i after
    max(0, i-(K-1-k)) of its updates, and applies b_i's gradient, taken at those weights,
    as its update number i; measured from the weights each call of the engine receives."""
    K, steps = num_stages, 3 * num_stages + 2
    pipe = build_pipeline("mlp", K, method="pipedream", devices=jax.devices()[:1])
    seen = []  # (stage, call, weights it received, weights it returned)

    def wrap(k, name, fn):
        def watched(state, given):
            changed, out = fn(state, given)
            received = given.params if state.params is None else state.params
            seen.append((k, name, jax.device_get(received), jax.device_get(changed.params)))
            return changed, out

        return watched

    view = pipe.observed(wrap)
    data = batches("mlp", steps)
    state = view.init(data[0])
    versions = [[jax.device_get(s.params)] for s in state.stages]
    for batch in data:
        state, _ = view.step(state, batch)
        for k, s in enumerate(state.stages):
            if not _same(jax.device_get(s.params), versions[k][-1]):
                versions[k].append(jax.device_get(s.params))

    def version(k, params):
        (index,) = [i for i, v in enumerate(versions[k]) if _same(v, params)]
        return index

    forwards = [[] for _ in range(K)]  # the version each forward of b_0, b_1, ... used
    updates = [[] for _ in range(K)]  # the version each update started from
    for k, name, received, returned in seen:
        if name in ("forward", "step"):  # the DDG step forwards before it updates
            forwards[k].append(version(k, received))
        if name in ("step", "loss_step"):
            updates[k].append(version(k, received))
            assert version(k, returned) == updates[k][-1] + 1
        if name == "loss_step":
            forwards[k].append(version(k, received))
    for k in range(K):
        lag = K - 1 - k
        assert forwards[k] == [max(0, i - lag) for i in range(steps)], k
        assert updates[k] == list(range(steps - lag)), k
    ddg = reference("mlp", K, method="ddg", optimizer=optimizer, weights="stash")
    assert_close(params_of(state), ddg.params)


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_2bw_is_the_one_step_delay_transform_shifted_by_one_batch():
    """W^{t+1} = U(W^t, g(b_t; W^{t-1})) is what `dgrad.optim.delay(U, 1)` does to
    gradients taken at the current weights, one step later: its weights after T+1 steps
    on b_0..b_T are 2BW's W^T. With no flush, after T steps the last stage holds W^T and
    every other stage, whose backwards of b_{T-1} are still to come, W^{T-1}."""
    data = batches("mlp", 7)
    _, state, _ = run_pipeline(
        "mlp", 3, data=data[:-1], method="2bw", microbatches=2, devices=jax.devices()[:3]
    )

    def delayed(steps):
        return run_pipeline(
            "mlp",
            3,
            data=data[:steps],
            method="bp",
            fused=True,
            devices=jax.devices()[:1],
            optimizer=lambda k: optim.delay(optimizer(k), 1),
        )[1]

    ahead, behind = params_of(delayed(7)), params_of(delayed(6))
    assert_close(params_of(state), [*behind[:2], ahead[2]])
    with pytest.raises(AssertionError):
        assert_close(params_of(state)[:2], ahead[:2])


def test_a_batch_that_does_not_cut_into_microbatches_is_refused():
    pipe = build_pipeline("mlp", 2, method="gpipe", microbatches=3)
    with pytest.raises(ValueError, match="cannot be cut into microbatches=3"):
        pipe.init(batches("mlp", 1)[0])
    # 8 rows: 8 microbatches of 1, which 2 replicas cannot share; the fix names M x D
    pipe = build_pipeline(
        "mlp", 2, method="gpipe", microbatches=8, devices=jax.devices()[:4], data_parallel=2
    )
    with pytest.raises(
        ValueError,
        match=r"microbatches=8 equal parts each split between "
        r"data_parallel=2 replicas; use a batch size that is a multiple of 16",
    ):
        pipe.init(batches("mlp", 1)[0])
