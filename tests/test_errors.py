"""Bad input is refused with a message that names the value and the fix."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import batches, build_pipeline, build_stages

import dgrad

SGD = optax.sgd(0.1)


def make(**kwargs):
    return build_pipeline("mlp", 2, **{"optimizer": SGD, **kwargs})


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(method="hogwild"), ValueError, "Unknown method 'hogwild'.*bp, ddg, fdg"),
        (dict(method="fdg", beta=0.0), ValueError, r"beta must lie in \(0, 1\]"),
        (dict(method="fdg", beta=1.5), ValueError, r"beta must lie in \(0, 1\]"),
        (dict(method="fdg", beta=float("nan")), ValueError, r"beta must lie in \(0, 1\]"),
        (dict(method="fdg", beta="0.5"), ValueError, r"beta must be a number in \(0, 1\]"),
        (dict(method="ddg", beta=0.5), ValueError, "only FDG has; use method=fdg"),
        (dict(weights="fresh"), ValueError, "Unknown weights policy 'fresh'"),
        (dict(memory="disk"), ValueError, "Unknown memory policy 'disk'"),
        (dict(weights="current", memory="residuals"), ValueError, "needs memory=recompute"),
        (dict(weights="current", memory="dots"), ValueError, "needs memory=recompute"),
        (dict(method="ddg", fused=True), ValueError, "needs method=bp"),
        (dict(predict_lr=-1.0), ValueError, "predict_lr must be a positive learning rate"),
        (
            dict(devices=jax.devices()[:1], placement="one_per_device"),
            ValueError,
            "2 stages x 1 replicas need 2 devices, got 1.*jax_num_cpu_devices",
        ),
        (dict(placement="everywhere"), ValueError, "Unknown placement 'everywhere'"),
        (dict(placement=[0]), ValueError, "1 entries for 2 stages"),
        (dict(placement=[0, 9]), ValueError, "index 9 is not a valid index into 4 devices"),
        (dict(devices=["gpu0"]), TypeError, "jax.Device"),
        (dict(optimizer="sgd"), TypeError, "optax.GradientTransformation"),
    ],
)
def test_bad_pipeline_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        make(**kwargs)


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
