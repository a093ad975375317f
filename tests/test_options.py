"""dgrad.Options: every setting of a pipeline is checked in one place, and a bad one is
refused with a line that names the value and the fix."""

import optax
import pytest
from helpers import (
    build_pipeline,
    build_stages,
)

import dgrad


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="hogwild"), "Unknown method 'hogwild'.*bp, ddg, fdg"),
        (dict(method="fdg", beta=0.0), r"beta must lie in \(0, 1\]"),
        (dict(method="fdg", beta=1.5), r"beta must lie in \(0, 1\]"),
        (dict(method="fdg", beta=float("nan")), r"beta must lie in \(0, 1\]"),
        (dict(method="fdg", beta="0.5"), r"beta must be a number in \(0, 1\]"),
        (dict(method="ddg", beta=0.5), "only FDG has; use method=fdg"),
        (dict(weights="fresh"), "Unknown weights policy 'fresh'"),
        (dict(memory="disk"), "Unknown memory policy 'disk'"),
        (dict(weights="current", memory="residuals"), "needs memory=recompute"),
        (dict(weights="current", memory="dots"), "needs memory=recompute"),
        (dict(method="ddg", fused=True), "needs method=bp"),
        (dict(predict_lr=-1.0), "predict_lr must be a positive learning rate"),
    ],
)
def test_bad_pipeline_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_pipeline("mlp", 2, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="fr", weights="stash"), "leave weights and memory unset"),
        (dict(method="dgl", memory="recompute"), "leave weights and memory unset"),
        (dict(method="fr", beta=0.5), "only FDG has"),
        (dict(probe_every=0), "probe_every must be an integer >= 1"),
        (dict(accumulate=0), "accumulate must be an integer >= 1"),
        (dict(accumulate=2, predict_lr=0.1), "use one or the other"),
        (dict(method="dgl"), "stage\\(s\\) \\[0\\] have none; add them with"),
    ],
)
def test_bad_family_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dgrad.Pipeline(build_stages("mlp", 2), optimizer=optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="ddg", microbatches=2), "method=ddg has no microbatches"),
        (dict(method="gpipe", microbatches=0), "microbatches must be an integer >= 1"),
        (dict(method="2bw", weights="current", memory="recompute"), "weight stashing"),
        (dict(method="pipedream", weights="current", memory="recompute"), "weight stashing"),
        (dict(method="2bw", predict_lr=0.1), "predict=momentum is not supported with method=2bw"),
    ],
)
def test_bad_options_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dgrad.Options(**kwargs)
