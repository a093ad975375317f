"""dgrad.train.build: the config's optimizer as each stage runs it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from training import small_config

from dgrad.train import build
from dgrad.train import config as fields


def first_updates(config, fused):
    """Each stage's update (weights after minus before) in the first step of BP, staged
    or fused, on the config's first batch."""
    config.method, config.baseline = "bp", "bp" if fused else ""
    run = fields.runs_of(config)[-1]
    dataset = build.load_dataset(config)
    pipe = build.build_pipeline(config, run, dataset, 8, jax.devices()[: run.num_stages])
    images, labels = dataset.train.get(np.arange(config.batch_size))
    batch = dataset.eval_transform.apply(images, labels, None)
    state = pipe.init(batch)
    before = jax.device_get(state)  # the step donates `state`
    after = jax.device_get(pipe.step(state, batch)[0])
    return [
        jax.tree.map(np.subtract, new.params, old.params)
        for new, old in zip(after.stages, before.stages)
    ]


@pytest.mark.parametrize("fused", [pytest.param(False, marks=pytest.mark.slow), True])
def test_each_stage_clips_its_gradient_by_its_own_norm(fused):
    """With plain SGD at rate 1 an update is minus the clipped gradient: clipped at 0.05,
    every stage's update has norm 0.05 and the direction of its unclipped gradient; one
    clip over the whole model (the control) would give the stages norms summing to it.
    The fused baseline is cut as the run is when it clips, so it clips the same way."""
    config = small_config(num_stages=3)
    config.optimizer.learning_rate, config.optimizer.momentum = 1.0, 0.0
    config.optimizer.weight_decay, config.optimizer.nesterov = 0.0, False
    config.optimizer.schedule, config.optimizer.clip_norm = "constant", 1e9  # never reached
    gradients = [jax.tree.map(jnp.negative, u) for u in first_updates(config, fused)]
    norms = [float(optax.tree.norm(g)) for g in gradients]
    assert min(norms) > 0.05  # every stage is clipped
    config.optimizer.clip_norm = 0.05
    updates = first_updates(config, fused)
    assert len(updates) == len(gradients) == 3
    for update, gradient, norm in zip(updates, gradients, norms):
        assert float(optax.tree.norm(update)) == pytest.approx(0.05, rel=1e-5)
        expected = jax.tree.map(lambda g, scale=-0.05 / norm: scale * g, gradient)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), update, expected
        )
    whole = np.sqrt(sum(n**2 for n in norms))
    one_clip = [0.05 * n / whole for n in norms]  # the norms one clip of the model would give
    assert all(abs(norm - 0.05) > 1e-3 for norm in one_clip), (norms, one_clip)


def test_synthetic_examples_sets_how_many_batches_an_epoch_can_have():
    """Timing runs need epochs longer than the 64 batches of 64 of the default synthetic set."""
    config = fields.base()
    config.dataset, config.batch_size, config.steps_per_epoch = "synthetic", 64, 100
    with pytest.raises(ValueError, match="more than the 64 batches"):
        build.steps_per_epoch(config, build.load_dataset(config))
    config.synthetic_examples = 6400
    dataset = build.load_dataset(config)
    assert len(dataset.train) == 6400
    assert build.steps_per_epoch(config, dataset) == 100


def test_a_baseline_that_cannot_be_placed_says_how_to_leave_it_out():
    config = small_config(baseline="bp", data_parallel=4)
    method, baseline = fields.runs_of(config)
    dataset = build.load_dataset(config)
    with pytest.raises(ValueError, match=r"needs 4 devices, got 2\..* add --config.baseline= "):
        build.build_pipeline(config, baseline, dataset, 8, jax.devices()[:2])
    with pytest.raises(ValueError, match="need 8 devices, got 2") as refused:
        build.build_pipeline(config, method, dataset, 8, jax.devices()[:2])
    assert "baseline" not in str(refused.value)
