"""Shared builders for the tests: tiny models, data streams and optimizers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dgrad
from dgrad import models
from dgrad.reference import reference_run

NUM_CLASSES = 3
BATCH = 8


def optimizer(k: int) -> optax.GradientTransformation:
    """SGD with momentum and weight decay, a little different per stage."""
    return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05 + 0.01 * k, momentum=0.9))


def build_stages(model: str, num_stages: int):
    if model == "mlp":
        return models.mlp([6, 16, 16, 16, NUM_CLASSES], num_stages=num_stages, rngs=1)
    if model == "cnn":  # ResNet-8 with 4 channels: five blocks, BatchNorm everywhere
        return models.cifar_resnet(
            8, NUM_CLASSES, num_stages, width=4, in_channels=1, split="balanced", rngs=1
        )
    raise ValueError(model)


def input_shape(model: str):
    return (BATCH, 6) if model == "mlp" else (BATCH, 8, 8, 1)


def batches(model: str, count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (
            jnp.asarray(rng.normal(size=input_shape(model)), jnp.float32),
            jnp.asarray(rng.integers(0, NUM_CLASSES, BATCH), jnp.int32),
        )
        for _ in range(count)
    ]


def num_steps(num_stages: int) -> int:
    return 3 * num_stages + 2


def reference_of(model, num_stages, **kwargs):
    """The reference run of a test model on its standard data stream."""
    data = batches(model, num_steps(num_stages))
    return reference_run(build_stages(model, num_stages), data, **kwargs)


@functools.lru_cache(maxsize=None)
def reference(model, num_stages, method, weights, beta):
    return reference_of(
        model, num_stages, method=method, optimizer=optimizer, beta=beta, weights=weights
    )


def run_pipeline(model, num_stages, steps=None, data=None, **kwargs):
    """Trains a fresh pipeline; returns (pipeline, final state, metrics of every step)."""
    data = data if data is not None else batches(model, steps or num_steps(num_stages))
    pipe = dgrad.Pipeline(build_stages(model, num_stages), **{"optimizer": optimizer, **kwargs})
    state = pipe.init(data[0])
    history = []
    for batch in data:
        state, metrics = pipe.step(state, batch)
        history.append(metrics)
    return pipe, state, history


def stage_params(state):
    return [jax.device_get(s.params) for s in state.stages]


def stage_rests(state):
    return [jax.device_get(s.rest) for s in state.stages]
