"""The pipelined engine against the plain reference, for every method and policy."""

import jax
import numpy as np
import pytest
from helpers import num_steps, reference, run_pipeline, stage_params, stage_rests

from dgrad.reference import max_relative_error

RTOL = 1e-5

# (method, weights, memory, beta); weights='current' always recomputes.
COMBOS = [
    ("bp", "stash", "residuals", 1.0),
    ("bp", "stash", "recompute", 1.0),
    ("ddg", "stash", "residuals", 1.0),
    ("ddg", "stash", "recompute", 1.0),
    ("ddg", "current", "recompute", 1.0),
    ("fdg", "stash", "residuals", 0.5),
    ("fdg", "stash", "recompute", 0.5),
    ("fdg", "current", "recompute", 0.5),
]
MLP_ONLY = [("fdg", "stash", "residuals", 1.0), ("fdg", "current", "recompute", 1.0)]


def _layouts(num_stages):
    one = [jax.devices()[0]]
    return {
        "one device": dict(devices=one),
        f"{num_stages} devices": dict(
            devices=jax.devices()[:num_stages], placement="one_per_device"
        ),
    }


def _check_against_reference(model, num_stages, method, weights, memory, beta):
    ref = reference(model, num_stages, method, weights, beta)
    for layout, placement in _layouts(num_stages).items():
        _, state, history = run_pipeline(
            model, num_stages, method=method, weights=weights, memory=memory, beta=beta, **placement
        )
        assert state.step == num_steps(num_stages)
        params_error = max_relative_error(stage_params(state), ref.params)
        rest_error = max_relative_error(stage_rests(state), ref.rests)
        assert params_error < RTOL, f"{layout}: parameters differ by {params_error:.2e}"
        assert rest_error < RTOL, f"{layout}: BatchNorm statistics differ by {rest_error:.2e}"
        for t, (metrics, ref_loss) in enumerate(zip(history, ref.losses)):
            assert (metrics == {}) == (ref_loss is None), f"{layout}: fill differs at step {t}"
            if ref_loss is not None:
                np.testing.assert_allclose(
                    metrics["loss"], ref_loss, rtol=RTOL, err_msg=f"{layout}: loss at step {t}"
                )


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("method,weights,memory,beta", COMBOS + MLP_ONLY)
def test_mlp_matches_reference(num_stages, method, weights, memory, beta):
    _check_against_reference("mlp", num_stages, method, weights, memory, beta)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("method,weights,memory,beta", COMBOS)
def test_batchnorm_cnn_matches_reference(num_stages, method, weights, memory, beta):
    _check_against_reference("cnn", num_stages, method, weights, memory, beta)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_comparison_can_fail(model):
    """The methods really differ by far more than the tolerance, so the checks above bite."""
    _, state, _ = run_pipeline(model, 3, method="fdg", beta=0.5)
    for method, weights, beta in [
        ("ddg", "stash", 1.0),
        ("fdg", "current", 0.5),
        ("fdg", "stash", 1.0),
        ("bp", "stash", 1.0),
    ]:
        ref = reference(model, 3, method, weights, beta)
        assert max_relative_error(stage_params(state), ref.params) > 100 * RTOL, (method, weights)
