"""dgrad.optim.async_nesterov against optax, against torch's NAdamW by hand, and in the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close, batches, params_of

import dgrad
from dgrad import models, optim
from dgrad.reference import reference_run


def _gradients(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "w": rng.normal(size=(2, 3)).astype(np.float32),
            "b": rng.normal(size=3).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _train(tx, grads, params):
    """Applies `tx` (jitted) to each gradient in turn; returns the params after every step."""
    update = jax.jit(tx.update)
    state = tx.init(params)
    history = []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history, state


def _nadamw_by_hand(grads, params, learning_rates, b1, b2, eps, weight_decay, momentum_decay):
    """torch.optim.NAdam(decoupled_weight_decay=True), step by step, in float64 numpy."""
    params = {name: np.asarray(p, np.float64) for name, p in params.items()}
    m = {name: np.zeros_like(p) for name, p in params.items()}
    v = {name: np.zeros_like(p) for name, p in params.items()}
    mu_product = 1.0
    history = []
    for t, (g, lr) in enumerate(zip(grads, learning_rates), start=1):
        if momentum_decay is None:
            mu, mu_next = b1, b1
        else:
            mu = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
            mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
        mu_product *= mu
        for name in params:
            grad = np.asarray(g[name], np.float64)
            params[name] = params[name] * (1 - lr * weight_decay)
            m[name] = b1 * m[name] + (1 - b1) * grad
            v[name] = b2 * v[name] + (1 - b2) * grad**2
            denom = np.sqrt(v[name] / (1 - b2**t)) + eps
            params[name] = (
                params[name]
                - lr * (1 - mu) / (1 - mu_product) * grad / denom
                - lr * mu_next / (1 - mu_product * mu_next) * m[name] / denom
            )
        history.append({name: p.copy() for name, p in params.items()})
    return history


def _assert_close(actual, expected, rtol):
    for name in expected:
        np.testing.assert_allclose(np.asarray(actual[name]), expected[name], rtol=rtol, atol=1e-7)


PARAMS = {"w": jnp.full((2, 3), 0.5), "b": jnp.array([1.0, -1.0, 2.0])}


@pytest.mark.parametrize("learning_rate", [1e-2, optax.linear_schedule(1e-2, 1e-3, 5)])
def test_delay_zero_is_optax_nadamw(learning_rate):
    """Without delay and with constant Nesterov momentum the rule is optax.nadamw."""
    grads = _gradients(6)
    ours, _ = _train(
        optim.async_nesterov(learning_rate, delay=0, num_stages=4, momentum_decay=None),
        grads,
        PARAMS,
    )
    theirs, _ = _train(
        optax.nadamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01), grads, PARAMS
    )
    for a, b in zip(ours, theirs):
        _assert_close(a, jax.device_get(b), rtol=1e-6)


@pytest.mark.parametrize(
    "delay,num_stages,b1,expected",
    [
        (0, 4, 0.9, 0.9),
        (1, 4, 0.9, 0.9225),  # 0.9 + 1 * 0.09 / 4
        (3, 4, 0.9, 0.9675),  # 0.9 + 3 * 0.09 / 4
        (2, 3, 0.8, 0.92666667),  # 0.8 + 2 * 0.19 / 3
        (5, 8, 0.95, 0.975),  # 0.95 + 5 * 0.04 / 8
        (3, 4, 0.99, 0.99),  # the run script's b1: no change with delay
    ],
)
def test_momentum_grows_with_the_delay_as_in_the_formula(delay, num_stages, b1, expected):
    assert optim.stage_momentum(delay, num_stages, b1=b1) == pytest.approx(expected, abs=1e-8)
    tx = optim.scale_by_async_nesterov(delay, num_stages, b1=b1)
    g = jnp.array([2.0, -4.0])
    _, state = jax.jit(tx.update)(g, tx.init(jnp.zeros(2)))
    np.testing.assert_allclose(1 - state.mu / g, expected, rtol=1e-6)  # mu = (1 - b1_k) * g


def test_several_steps_by_hand_with_decay_schedule_and_weight_decay():
    delay, num_stages, b1, weight_decay = 2, 4, 0.9, 0.1
    schedule = optax.linear_schedule(3e-2, 1e-2, 6)
    grads = _gradients(6, seed=1)
    tx = optim.async_nesterov(schedule, delay, num_stages, b1=b1, weight_decay=weight_decay)
    ours, state = _train(tx, grads, PARAMS)
    b1_k = 0.9 + 2 * (0.99 - 0.9) / 4
    learning_rates = [float(schedule(t)) for t in range(6)]
    options = dict(b2=0.999, eps=1e-8, weight_decay=weight_decay, momentum_decay=0.004)
    by_hand = _nadamw_by_hand(grads, PARAMS, learning_rates, b1_k, **options)
    for a, b in zip(ours, by_hand):
        _assert_close(a, b, rtol=1e-5)
    assert int(state[0].count) == 6
    # Controls: the same hand computation ignoring the delay (b1_k = b1), or with
    # constant Nesterov momentum, is far from what the transform did.
    no_delay = _nadamw_by_hand(grads, PARAMS, learning_rates, b1, **options)
    options["momentum_decay"] = None
    constant = _nadamw_by_hand(grads, PARAMS, learning_rates, b1_k, **options)
    for wrong in (no_delay, constant):
        error = max(np.max(np.abs(ours[-1][n] - wrong[-1][n])) for n in PARAMS)
        assert error > 1e-3, error


@pytest.mark.parametrize(
    "method,expected",
    [
        ("ddg", [0.9675, 0.945, 0.9225, 0.9]),  # delays 3, 2, 1, 0 over K = 4, as in the code
        ("fdg", [0.975, 0.945, 0.915, 0.9]),  # delays 5, 3, 1, 0 over 5 + 1
        ("bp", [0.9, 0.9, 0.9, 0.9]),
    ],
)
def test_per_stage_factory_gives_each_stage_its_momentum(method, expected):
    make = optim.async_nesterov_for(1e-3, method, num_stages=4)
    for k in range(4):
        tx = make(k)
        _, state = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)), jnp.zeros(1))
        np.testing.assert_allclose(1 - state[0].mu, [expected[k]], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(delay=-1), "delay must be a non-negative integer"),
        (dict(delay=1.5), "delay must be a non-negative integer"),
        (dict(delay=True), "delay must be a non-negative integer"),
        (dict(delay=4), r"delay \(4\) must be smaller than num_stages \(4\)"),
        (dict(num_stages=0), "num_stages must be an integer >= 1"),
        (dict(b1=1.0), r"b1 must be a number in \[0, 1\)"),
        (dict(b1=-0.1), r"b1 must be a number in \[0, 1\)"),
        (dict(b1_target=1.0), r"b1_target must be a number in \[0, 1\)"),
        (dict(b2=1.0), r"b2 must be a number in \[0, 1\)"),
        (dict(eps=-1e-8), "eps must be a non-negative number"),
        (dict(weight_decay=-0.1), "weight_decay must be a non-negative number"),
        (dict(momentum_decay=-1.0), "momentum_decay must be a non-negative number"),
        (dict(learning_rate=-1e-3), "learning_rate must be a non-negative number"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    arguments = {"learning_rate": 1e-3, "delay": 1, "num_stages": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        optim.async_nesterov(**arguments)


def test_factory_rejects_a_bad_method():
    with pytest.raises(ValueError, match="Unknown method"):
        optim.async_nesterov_for(1e-3, "hogwild", 4)


def test_plugs_into_an_fdg_pipeline_per_stage_and_matches_the_reference():
    num_stages = 2
    make = optim.async_nesterov_for(1e-2, "fdg", num_stages)
    data = batches("mlp", 5)

    def stages():
        return models.mlp([6, 16, 3], num_stages=num_stages, rngs=1)

    pipe = dgrad.Pipeline(stages(), method="fdg", optimizer=make, devices=jax.devices()[:2])
    state = pipe.init(data[0])
    losses = []
    for batch in data:
        state, metrics = pipe.step(state, batch)
        if "loss" in metrics:
            losses.append(float(metrics["loss"]))
    assert len(losses) == 4 and np.all(np.isfinite(losses))  # FDG K=2 fills for one step
    ref = reference_run(stages(), data, method="fdg", optimizer=make)
    assert_close(params_of(state), ref.params)
    # Control: the same reference with stage 0's delay ignored ends elsewhere.
    undelayed = reference_run(
        stages(), data, method="fdg", optimizer=lambda k: optim.async_nesterov(1e-2, 0, 1)
    )
    with pytest.raises(AssertionError):
        assert_close(params_of(state), undelayed.params)
