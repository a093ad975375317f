"""Data: the fixed digits split, the seeded stream, augmentation, and tfds on mock data."""

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

import dgrad
from dgrad import data
from dgrad.data import augment


def test_digits_split_is_fixed_and_disjoint():
    train, test = data.load_digits()
    again, _ = data.load_digits()
    np.testing.assert_array_equal(train.images, again.images)
    assert len(train) + len(test) == 1797
    train_rows = {row.tobytes() for row in train.images}
    assert (
        sum(row.tobytes() in train_rows for row in test.images) < 20
    )  # the digits hold a few duplicates
    assert abs(float(train.images.mean())) < 1e-5


def test_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    images, labels = data.digits._sklearn_digits()
    theirs = load_digits()
    np.testing.assert_array_equal(images[..., 0], theirs.images.astype(np.float32))
    np.testing.assert_array_equal(labels, theirs.target)
    assert images.dtype == np.float32 and labels.dtype == np.int32
    imported = "from dgrad.data import digits; import sys; digits.load_digits(); "
    imported += "print('sklearn' in sys.modules)"
    status = subprocess.run([sys.executable, "-c", imported], capture_output=True, text=True)
    assert status.stdout.strip() == "False", status.stderr


def test_stream_is_a_pure_function_of_seed_and_step():
    source = data.synthetic(50, (4, 4, 3), seed=3)
    transform = augment.cifar_train((0.5,) * 3, (0.2,) * 3, padding=1)
    stream = data.Stream(source, 8, transform=transform, seed=7)
    other = data.Stream(source, 8, transform=transform, seed=7)
    from_start = list(stream.iterate(0, 14))
    resumed = list(other.iterate(9, 14))  # a fresh stream, as after a restart
    for (x, y), (x2, y2) in zip(from_start[9:], resumed):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    different = data.Stream(source, 8, transform=transform, seed=8).batch(0)
    assert not np.array_equal(different[0], from_start[0][0])


def test_each_epoch_visits_every_example_once_in_a_new_order():
    source = data.Split(
        np.arange(20, dtype=np.float32).reshape(20, 1), np.arange(20, dtype=np.int32)
    )
    stream = data.Stream(source, 5, transform=augment.identity, seed=0)
    assert stream.steps_per_epoch == 4
    epochs = [np.concatenate([stream.batch(4 * e + i)[1] for i in range(4)]) for e in range(2)]
    for labels in epochs:
        assert sorted(labels.tolist()) == list(range(20))
    assert epochs[0].tolist() != epochs[1].tolist()
    short = data.Stream(source, 5, transform=augment.identity, seed=0, steps_per_epoch=2)
    assert len(set(np.concatenate([short.batch(i)[1] for i in range(2)]).tolist())) == 10
    with pytest.raises(ValueError, match="steps_per_epoch"):
        data.Stream(source, 5, transform=augment.identity, seed=0, steps_per_epoch=5)
    with pytest.raises(ValueError, match="exceeds"):
        data.Stream(source, 21, transform=augment.identity, seed=0)


def test_eval_batches_pad_the_last_batch_and_mask_it():
    source = data.Split(np.zeros((10, 1), np.float32), np.arange(10, dtype=np.int32))
    seen = []
    for x, y, mask in data.eval_batches(source, 4, augment.identity):
        assert x.shape == (4, 1)
        seen += y[mask].tolist()
    assert seen == list(range(10))


def test_crop_and_flip_are_shifts_and_mirrors_of_the_image():
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, (64, 6, 6, 3), dtype=np.uint8)
    rows = augment.crop_and_flip_rows(np.random.default_rng(1), len(images), padding=2)
    out = augment.crop_and_flip(images, rows, padding=2)
    flips = 0
    for image, crop in zip(images, out):
        padded = np.pad(image, ((2, 2), (2, 2), (0, 0)))
        windows = [padded[i : i + 6, j : j + 6] for i in range(5) for j in range(5)]
        plain = any(np.array_equal(crop, w) for w in windows)
        mirrored = any(np.array_equal(crop[:, ::-1], w) for w in windows)
        assert plain or mirrored
        flips += mirrored and not plain
    assert 16 < flips < 48


def test_normalise_standardises_each_channel():
    images = np.stack([np.full((2, 2), 51), np.full((2, 2), 102), np.full((2, 2), 255)], -1)
    x = augment.normalise(images[None].astype(np.uint8), (0.2, 0.4, 0.5), (0.1, 0.2, 0.5))
    np.testing.assert_allclose(x[0, 0, 0], [0.0, 0.0, 1.0], atol=1e-6)


def test_imagenet_transforms_give_fixed_size_inputs_from_any_image():
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(40, 70, 3), (90, 33, 3)]]
    labels = np.array([3, 999])
    for transform in (augment.imagenet_train(32), augment.imagenet_eval(32, resize=36)):
        x, y = transform(images, labels, np.random.default_rng(0))
        assert x.shape == (2, 32, 32, 3) and x.dtype == np.float32
        assert y.tolist() == [3, 999]


@pytest.mark.parametrize(
    "name, classes, shape", [("cifar10", 10, (32, 32, 3)), ("cifar100", 100, (32, 32, 3))]
)
def test_cifar_through_tfds_mock_data(name, classes, shape):
    with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
        dataset = data.load(name)
        assert dataset.num_classes == classes and dataset.input_shape == shape
        stream = data.Stream(dataset.train, 8, transform=dataset.train_transform, seed=0)
        batches = list(stream.iterate(0, 4))
        again = data.Stream(dataset.train, 8, transform=dataset.train_transform, seed=0).batch(3)
        tests = list(data.eval_batches(dataset.test, 10, dataset.eval_transform))
    x, y = batches[0]
    assert x.shape == (8, *shape) and x.dtype == np.float32 and y.dtype == np.int32
    assert np.all((0 <= y) & (y < classes))
    np.testing.assert_array_equal(batches[3][0], again[0])
    assert [int(mask.sum()) for *_, mask in tests] == [10, 10, 4]


def test_imagenet_through_tfds_mock_data():
    with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
        dataset = data.load("imagenet2012", image_size=48)
        x, y = data.Stream(dataset.train, 3, transform=dataset.train_transform, seed=0).batch(1)
        (x_test, _, _), *_ = data.eval_batches(dataset.test, 6, dataset.eval_transform)
    assert dataset.num_classes == 1000
    assert x.shape == (3, 48, 48, 3) and x_test.shape == (6, 48, 48, 3)


def test_a_missing_dataset_says_how_to_prepare_it(tmp_path):
    with pytest.raises(data.DatasetNotFoundError) as error:
        data.load("cifar10", data_dir=str(tmp_path))
    message = str(error.value)
    assert "tfds build cifar10 --file_format=array_record" in message and str(tmp_path) in message
    with pytest.raises(data.DatasetNotFoundError, match="downloads/manual"):
        data.load("imagenet2012", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="Unknown dataset"):
        data.load("mnist")


def test_stream_can_place_batches_on_a_device_ahead_of_time():
    import jax

    source = data.synthetic(32, (4, 4, 3), seed=0)
    transform = augment.cifar_train((0.5,) * 3, (0.25,) * 3)
    device = jax.devices()[2]
    sharding = jax.sharding.SingleDeviceSharding(device)
    stream = data.Stream(source, 8, transform=transform, seed=0, sharding=sharding)
    for step, (x, y) in enumerate(stream.iterate(0, 3)):
        assert x.devices() == {device} and y.devices() == {device}
        expected = stream.batch(step)
        np.testing.assert_array_equal(np.asarray(x), expected[0])
        np.testing.assert_array_equal(np.asarray(y), expected[1])


def _cifar_like():
    return data.augment.cifar_train((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def test_each_process_prepares_only_its_rows():
    """The stream's batch, built from per-device rows, equals the whole batch; the
    augmentation draws for the whole batch, so it does not depend on the split."""
    dataset = data.load("synthetic", synthetic_shape=(8, 8, 3), synthetic_examples=64)
    dataset = dataset.__class__(**{**dataset.__dict__, "train_transform": _cifar_like()})
    whole = data.Stream(dataset.train, 16, transform=dataset.train_transform, seed=3)
    placement = dgrad.Placement(2, jax.devices(), data_parallel=4, fused=True)
    split = data.Stream(
        dataset.train, 16, transform=dataset.train_transform, seed=3, sharding=placement.sharded(0)
    )
    for (x, y), (sx, sy) in zip(whole.iterate(0, 3), split.iterate(0, 3)):
        assert len(sx.addressable_shards) == 4
        np.testing.assert_array_equal(np.asarray(sx), x)
        np.testing.assert_array_equal(np.asarray(sy), y)
