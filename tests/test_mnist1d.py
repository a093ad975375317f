"""MNIST-1D, generated offline and cached, and the 1-D ResNet that cuts into up to 8 stages."""

import functools
import random

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import chained

import dgrad
from dgrad import data, models
from dgrad.data import mnist1d

SAMPLES = 200  # 160 train + 40 test signals: generated in a fraction of a second


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DGRAD_CACHE", str(tmp_path))
    return tmp_path


def _assert_same(a, b):
    for split_a, split_b in zip(a, b):
        np.testing.assert_array_equal(split_a.images, split_b.images)
        np.testing.assert_array_equal(split_a.labels, split_b.labels)


def test_the_second_load_reads_the_cache(cache, monkeypatch):
    first = mnist1d.load_mnist1d(SAMPLES)
    assert [p.name.startswith("mnist1d-") for p in cache.iterdir()] == [True]

    def generate(args):
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(mnist1d, "_generate", generate)
    _assert_same(mnist1d.load_mnist1d(SAMPLES), first)


def test_generation_is_deterministic_and_keyed_by_its_arguments(tmp_path):
    first = mnist1d.load_mnist1d(SAMPLES, cache_dir=str(tmp_path / "a"))
    _assert_same(mnist1d.load_mnist1d(SAMPLES, cache_dir=str(tmp_path / "b")), first)
    other_seed = mnist1d.load_mnist1d(SAMPLES, seed=0, cache_dir=str(tmp_path / "a"))
    assert not np.array_equal(other_seed[0].images, first[0].images)
    assert len(list((tmp_path / "a").iterdir())) == 2


def test_shapes_dtypes_and_classes(cache):
    train, test = mnist1d.load_mnist1d(SAMPLES)
    assert train.images.shape == (160, 40, 1) and test.images.shape == (40, 40, 1)
    assert train.images.dtype == np.float32 and train.labels.dtype == np.int32
    assert sorted(set(train.labels.tolist())) == list(range(10))
    assert set(test.labels.tolist()) <= set(range(10))
    # The generator standardises train and test together.
    signals = np.concatenate([train.images, test.images])
    assert abs(signals.mean()) < 1e-4 and abs(signals.std() - 1) < 1e-4


def test_train_and_test_share_no_signal(cache):
    train, test = mnist1d.load_mnist1d(SAMPLES)
    train_signals = {x.tobytes() for x in train.images}
    assert not any(x.tobytes() in train_signals for x in test.images)


def test_generating_leaves_the_global_random_state_alone(cache):
    np.random.seed(7)
    random.seed(7)
    expected = np.random.rand(), random.random()
    np.random.seed(7)
    random.seed(7)
    mnist1d.load_mnist1d(SAMPLES)
    assert (np.random.rand(), random.random()) == expected


def test_the_defaults_are_the_packages():
    from mnist1d.data import get_dataset_args

    defaults = get_dataset_args(as_dict=True)
    defaults.pop("url")
    assert mnist1d.GENERATOR_ARGS == defaults


def test_bad_num_samples():
    with pytest.raises(ValueError, match="at least 10"):
        mnist1d.load_mnist1d(5)


def test_load_gives_the_dataset(cache, monkeypatch):
    monkeypatch.setattr(data, "load_mnist1d", functools.partial(mnist1d.load_mnist1d, SAMPLES))
    assert "mnist1d" in data.DATASETS
    ds = data.load("mnist1d")
    assert (ds.num_classes, ds.input_shape, len(ds.train), len(ds.test)) == (10, (40, 1), 160, 40)
    x, y = data.Stream(ds.train, 16, transform=ds.train_transform, seed=0).batch(0)
    assert x.shape == (16, 40, 1) and x.dtype == np.float32 and y.dtype == np.int32


def test_cnn1d_is_eight_equal_blocks():
    blocks = models.cnn1d_blocks()
    assert len(blocks.modules) == 8
    assert max(blocks.costs) / min(blocks.costs) < 1.1
    for k in (1, 2, 4, 8):
        assert [len(s.layers) for s in blocks.stages(k)] == [8 // k] * k
    params = nnx.state(models.cnn1d(), nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == 13_082
    with pytest.raises(ValueError, match="8 splittable blocks.*at most 8"):
        models.cnn1d(num_stages=9)


def test_splitting_does_not_change_the_cnn1d():
    x = jax.random.normal(jax.random.key(0), (4, 40, 1))
    whole = chained(models.cnn1d(num_stages=1, rngs=3), x)
    assert whole.shape == (4, 10)
    for k in range(2, 9):
        np.testing.assert_allclose(chained(models.cnn1d(num_stages=k, rngs=3), x), whole, atol=1e-5)


@pytest.mark.slow
def test_fdg_trains_the_cnn1d_on_mnist1d_in_four_stages(cache):
    train, _ = mnist1d.load_mnist1d(SAMPLES)
    stages = models.cnn1d(num_stages=4, rngs=0)
    pipe = dgrad.Pipeline(stages, method="fdg", optimizer=optax.sgd(0.05, momentum=0.9))
    stream = data.Stream(train, 16, transform=data.augment.identity, seed=0)
    state = pipe.init(stream.batch(0))
    losses = []
    for batch in stream.iterate(0, 8):
        state, metrics = pipe.step(state, batch)
        if metrics:
            losses.append(float(metrics["loss"]))
    pipe.check_finite(state)
    assert len(losses) == 8 - 3 and np.all(np.isfinite(losses))
