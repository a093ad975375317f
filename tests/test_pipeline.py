"""dgrad.Pipeline: the pipelined engine against the plain reference, for every method and
policy, on one device, on one device per stage and with every stage replicated on several
devices; and what it refuses (stages, optimizer, batches, the order of calls)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import (
    SMOOTH_OPTIMIZER,
    assert_matches_reference,
    batches,
    build_pipeline,
    build_stages,
    check_on_layouts,
    layouts,
    optimizer,
    reference,
    run_pipeline,
)

import dgrad

# (method, weights, memory, beta); weights='current' always recomputes.
COMBOS = [
    ("bp", "stash", "residuals", 1.0),
    ("bp", "stash", "recompute", 1.0),
    ("ddg", "stash", "residuals", 1.0),
    ("ddg", "stash", "dots", 1.0),
    ("ddg", "stash", "recompute", 1.0),
    ("ddg", "current", "recompute", 1.0),
    ("fdg", "stash", "residuals", 0.5),
    ("fdg", "stash", "dots", 0.5),
    ("fdg", "stash", "recompute", 0.5),
    ("fdg", "current", "recompute", 0.5),
]
MLP_ONLY = [("fdg", "stash", "residuals", 1.0), ("fdg", "current", "recompute", 1.0)]
FAST_CNN = [("ddg", "stash", "residuals", 1.0)]


def check(model, num_stages, method, weights, memory, beta, names=None):
    """On one device, a device per stage and devices // K replicas per stage."""
    check_on_layouts(
        model, num_stages, method, names, memory, replicas=None, weights=weights, beta=beta
    )


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "num_stages",
    [pytest.param(1, marks=SLOW), 2, pytest.param(3, marks=SLOW), pytest.param(4, marks=SLOW)],
)
@pytest.mark.parametrize("method,weights,memory,beta", COMBOS + MLP_ONLY)
def test_mlp_matches_reference(num_stages, method, weights, memory, beta):
    check("mlp", num_stages, method, weights, memory, beta)


@pytest.mark.parametrize(
    "num_stages", [pytest.param(1, marks=SLOW), 2, pytest.param(3, marks=SLOW)]
)
@pytest.mark.parametrize(
    "method,weights,memory,beta",
    [c if c in FAST_CNN else pytest.param(*c, marks=SLOW) for c in COMBOS],
)
def test_batchnorm_cnn_matches_reference_replicated(num_stages, method, weights, memory, beta):
    """BatchNorm statistics of the whole batch, whatever the number of replicas."""
    names = [n for n in layouts(num_stages) if "replicas" in n] or ["a device per stage"]
    check("cnn", num_stages, method, weights, memory, beta, names)


@pytest.mark.slow
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("method,weights,memory,beta", COMBOS)
def test_batchnorm_cnn_matches_reference(num_stages, method, weights, memory, beta):
    check("cnn", num_stages, method, weights, memory, beta, ["one device", "a device per stage"])


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=SLOW)])
def test_comparison_can_fail(model):
    """The methods really differ by far more than the tolerance, so the checks above bite,
    also with replicated stages."""
    for tx, layout in [
        (optimizer, {}),
        (SMOOTH_OPTIMIZER, dict(devices=jax.devices(), data_parallel=2)),
    ]:
        _, state, history = run_pipeline(model, 2, method="fdg", beta=0.5, optimizer=tx, **layout)
        assert_matches_reference(state, history, reference(model, 2, "fdg", "stash", 0.5, tx))
        for method, weights, beta in [
            ("ddg", "stash", 1.0),
            ("fdg", "current", 0.5),
            ("fdg", "stash", 1.0),
            ("bp", "stash", 1.0),
        ]:
            other = reference(model, 2, method, weights, beta, tx)
            with pytest.raises(AssertionError):
                assert_matches_reference(state, history, other)


# What the pipeline itself refuses: stages, optimizer, batches, the order of calls.

SGD = optax.sgd(0.1)


def make(**kwargs):
    return build_pipeline("mlp", 2, **{"optimizer": SGD, **kwargs})


def test_the_optimizer_must_be_an_optax_transformation():
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        make(optimizer="sgd")


def test_stages_must_be_a_list_of_nnx_modules():
    with pytest.raises(TypeError, match="list of flax.nnx.Module stages"):
        dgrad.Pipeline(build_stages("mlp", 1)[0], optimizer=SGD)
    with pytest.raises(TypeError, match="must be a flax.nnx.Module"):
        dgrad.Pipeline([lambda x: x], optimizer=SGD)


def test_batch_must_match_the_one_init_saw():
    pipe = make(method="fdg")
    data = batches("mlp", 2)
    state = pipe.init(data[0])
    x, y = data[1]
    with pytest.raises(
        ValueError, match=r"float32\[5, 6\].*init saw.*float32\[8, 6\].*drop the last partial batch"
    ):
        pipe.step(state, (x[:5], y[:5]))
    with pytest.raises(ValueError, match=r"float16\[8, 6\].*init saw"):
        pipe.step(state, (x.astype(jnp.float16), y))
    with pytest.raises(TypeError, match=r"pair \(inputs, labels\)"):
        pipe.step(state, {"image": x, "label": y})


def test_step_before_init():
    with pytest.raises(RuntimeError, match="init"):
        make().step(None, batches("mlp", 1)[0])


def test_stages_that_do_not_fit_together():
    stages = [nnx.Linear(6, 4, rngs=nnx.Rngs(0)), nnx.Linear(5, 3, rngs=nnx.Rngs(0))]
    pipe = dgrad.Pipeline(stages, optimizer=SGD)
    with pytest.raises(ValueError, match=r"Stage 1 of 2 cannot take input of shape \(8, 4\)"):
        pipe.init(batches("mlp", 1)[0])


def test_model_flops_count_the_model_not_its_cut():
    """Three forwards' worth of the MLP's multiply-adds (2 FLOPs each), whatever the cut,
    and twice that for twice the batch."""
    from dgrad import models

    sizes = [16, 32, 32, 4]
    matmuls = sum(a * b for a, b in zip(sizes, sizes[1:]))

    def flops(num_stages, rows):
        pipe = dgrad.Pipeline(models.mlp(sizes, num_stages=num_stages), optimizer=optax.sgd(0.1))
        pipe.init((jnp.ones((rows, 16)), jnp.zeros((rows,), jnp.int32)))
        return pipe.model_flops()

    one = flops(1, 8)
    assert flops(3, 8) == one and flops(1, 16) == 2 * one
    assert 3 * 2 * 8 * matmuls <= one < 1.2 * 3 * 2 * 8 * matmuls
