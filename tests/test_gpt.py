"""The decoder-only transformer: causal, cut at block boundaries, and trained by every
method and memory policy to the reference's numbers on one device, on one device per stage
and with every stage replicated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ROOT,
    assert_close,
    assert_matches_reference,
    batches,
    check_on_layouts,
    layouts,
    optimizer,
    params_of,
    reference,
    run_pipeline,
)
from processes import rerun_with_cpu_devices

from dgrad import models

SLOW = pytest.mark.slow


def test_a_token_sees_only_the_tokens_before_it():
    stages = models.gpt(50, num_layers=2, num_heads=2, dim=16, context=8, num_stages=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 8)), jnp.int32)
    changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % 50)

    def logits(x):
        return stages[1](stages[0](x))

    before, after = logits(tokens), logits(changed)
    np.testing.assert_allclose(before[:, :5], after[:, :5], atol=1e-6)
    assert float(jnp.abs(before[:, 5:] - after[:, 5:]).max()) > 1e-4


def test_the_embedding_is_on_stage_0_and_the_head_on_the_last():
    stages = models.gpt(50, num_layers=4, num_heads=2, dim=16, context=8, num_stages=4)
    assert type(stages[0].layers[0]).__name__ == "Embedding"
    assert type(stages[-1].layers[-1]).__name__ == "Head"
    with pytest.raises(ValueError, match="cannot be cut into num_stages=7"):
        models.gpt(50, num_layers=4, num_heads=2, dim=16, context=8, num_stages=7)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        models.gpt(50, num_layers=1, num_heads=3, dim=16, context=8)


@pytest.mark.parametrize(
    "num_stages,method,options",
    [
        pytest.param(2, "fdg", dict(beta=0.5), marks=SLOW),  # fast: the comparison's control
        pytest.param(2, "ddg", {}, marks=SLOW),
        pytest.param(2, "gpipe", dict(microbatches=2), marks=SLOW),
        pytest.param(1, "bp", {}, marks=SLOW),
        pytest.param(3, "fdg", {}, marks=SLOW),
        pytest.param(4, "ddg", dict(weights="current", memory="recompute"), marks=SLOW),
        pytest.param(3, "2bw", dict(microbatches=2), marks=SLOW),
        pytest.param(2, "fdg", dict(memory="dots"), marks=SLOW),
        pytest.param(2, "pipedream", {}, marks=SLOW),
        pytest.param(2, "bp", {}, marks=SLOW),
        pytest.param(4, "bp", {}, marks=SLOW),
        pytest.param(3, "ddg", dict(memory="recompute"), marks=SLOW),
        pytest.param(2, "1f1b", dict(microbatches=2), marks=SLOW),
        pytest.param(2, "ddg", dict(memory="dots"), marks=SLOW),
    ],
)
def test_gpt_stages_match_the_reference(num_stages, method, options):
    check_on_layouts("gpt", num_stages, method, **options)


@SLOW
def test_gpt_with_every_stage_replicated_at_three_and_four_stages(request):
    """K x D beyond the 4 test devices: K = 3 and 4 with 2 replicas per stage, on 8 fake
    devices (the test reruns itself in a process of its own that has them)."""
    if rerun_with_cpu_devices(request, 8, ROOT):
        return
    for num_stages in (3, 4):
        for method, options in [("fdg", {}), ("ddg", {}), ("gpipe", dict(microbatches=2))]:
            check_on_layouts("gpt", num_stages, method, names=["2 replicas per stage"], **options)


@SLOW
def test_gpipe_and_1f1b_on_the_gpt_equal_fused_backprop():
    """No BatchNorm in a transformer: a synchronous pipeline's mean over M microbatches is
    the whole batch's gradient, so GPipe and 1F1B train fused BP's numbers."""
    data = batches("gpt", 5)
    _, fused, _ = run_pipeline(
        "gpt", 2, data=data, method="bp", fused=True, devices=jax.devices()[:1]
    )
    for layout in layouts(2).values():
        for method in ("gpipe", "1f1b"):
            _, state, _ = run_pipeline("gpt", 2, data=data, method=method, microbatches=2, **layout)
            assert_close(params_of(state), params_of(fused))


@pytest.mark.slow
def test_the_comparison_can_fail_on_the_gpt():
    _, state, history = run_pipeline("gpt", 2, method="fdg", devices=jax.devices()[:2])
    assert_matches_reference(state, history, reference("gpt", 2, method="fdg", optimizer=optimizer))
    for other in (dict(method="ddg"), dict(method="bp")):
        with pytest.raises(AssertionError):
            assert_matches_reference(
                state, history, reference("gpt", 2, optimizer=optimizer, **other)
            )
