"""TensorFlow Datasets splits read by random access, without TensorFlow.

`tfds.data_source` reads datasets prepared in the `array_record` format
example by example, with no TensorFlow at run time. Preparing them (download
and conversion) needs TensorFlow once:

    python3 -m venv .tfds && .tfds/bin/pip install tensorflow-cpu tensorflow-datasets
    .tfds/bin/tfds build cifar10 --file_format=array_record --data_dir ~/tensorflow_datasets

ImageNet (`imagenet2012`) must be downloaded by hand first, as tfds requires:
put `ILSVRC2012_img_train.tar` and `ILSVRC2012_img_val.tar` into
`<data_dir>/downloads/manual/`, then run the same `tfds build imagenet2012 ...`.
"""

from __future__ import annotations

import logging
import os

import numpy as np


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is not prepared where it was looked for; the message says how to prepare it.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as empty:
    ...     TfdsSource("cifar10", "train", data_dir=empty)
    Traceback (most recent call last):
        ...
    dgrad.data.tfds_source.DatasetNotFoundError: Dataset cifar10 is not prepared in ...
    """


def default_data_dir() -> str:
    """Where tfds datasets are looked for: `$TFDS_DATA_DIR`, else `~/tensorflow_datasets`.

    >>> import os
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {"TFDS_DATA_DIR": "/data/tfds"}):
    ...     default_data_dir()
    '/data/tfds'
    >>> with mock.patch.dict(os.environ, clear=True):
    ...     default_data_dir() == os.path.expanduser("~/tensorflow_datasets")
    True
    """
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


def how_to_prepare(name: str, data_dir: str) -> str:
    """The commands that prepare `name` in `data_dir`, on one line.

    >>> how_to_prepare("cifar10", "/data").split(" && ")[-1]
    '.tfds/bin/tfds build cifar10 --file_format=array_record --data_dir /data'
    >>> how_to_prepare("imagenet2012", "/data")[:60]
    'download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar'
    """
    manual = ""
    if name.startswith("imagenet"):
        manual = (
            "download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from "
            f"https://image-net.org into {data_dir}/downloads/manual/, then "
        )
    return (
        f"{manual}prepare it once (preparing needs TensorFlow, best in an environment of its "
        "own): python3 -m venv .tfds && .tfds/bin/pip install tensorflow-cpu "
        f"tensorflow-datasets && .tfds/bin/tfds build {name} --file_format=array_record "
        f"--data_dir {data_dir}"
    )


def _prepared(name: str, data_dir: str) -> bool:
    """Whether `data_dir` holds array_record files of `name` (looked up without tfds, so a
    missing dataset prints no tfds warnings)."""
    root = os.path.join(data_dir, name)
    if not os.path.isdir(root):
        return False
    return any(".array_record" in file for _, _, files in os.walk(root) for file in files)


def open_split(name: str, split: str, data_dir: str | None = None):
    """`tfds.data_source` of one prepared split, or `DatasetNotFoundError` saying how to
    prepare it (tfds's own error when it is prepared but unreadable).

    >>> import tensorflow_datasets as tfds
    >>> with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    ...     len(open_split("tiny_shakespeare", "train"))
    3
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as error:
        raise DatasetNotFoundError(
            f"Reading {name!r} needs tensorflow-datasets: pip install 'dgrad[data]'."
        ) from error
    data_dir = data_dir or default_data_dir()
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # tfds warns about every folder it did not find
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as error:  # noqa: BLE001 -- tfds raises many kinds here
        if not _prepared(name, data_dir):
            raise DatasetNotFoundError(
                f"Dataset {name} is not prepared in {data_dir}; {how_to_prepare(name, data_dir)}."
            ) from None
        said = " ".join(str(error).split())
        raise DatasetNotFoundError(
            f"Dataset {name} (split {split}) in {data_dir} could not be read "
            f"({type(error).__name__}: {said}); {how_to_prepare(name, data_dir)}."
        ) from None
    finally:
        absl_logger.setLevel(level)


class TfdsSource:
    """One split of a tfds dataset: `len`, and `get(indices)` -> `(images, labels)`.

    Images come back as one uint8 array when they all have the same shape
    (CIFAR), otherwise as a list of arrays (ImageNet).

    >>> import tensorflow_datasets as tfds  # here on tfds's mock data: nothing is read from disk
    >>> with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
    ...     test = TfdsSource("cifar10", "test")
    ...     images, labels = test.get(np.arange(4))
    >>> len(test), test.num_classes, images.shape
    (4, 10, (4, 32, 32, 3))
    """

    def __init__(self, name: str, split: str, data_dir: str | None = None):
        self._source = open_split(name, split, data_dir)
        self.name, self.split = name, split
        self.num_classes = int(self._source.dataset_info.features["label"].num_classes)

    def __len__(self) -> int:
        return len(self._source)

    def get(self, indices: np.ndarray):
        """The examples at `indices`: `(images, labels)`, the images uint8.

        >>> import tensorflow_datasets as tfds
        >>> with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
        ...     images, labels = TfdsSource("cifar10", "test").get(np.array([3, 0]))
        >>> images.shape, images.dtype, labels.shape, labels.dtype
        ((2, 32, 32, 3), dtype('uint8'), (2,), dtype('int32'))
        """
        records = [self._source[int(i)] for i in indices]
        images = [np.asarray(r["image"]) for r in records]
        labels = np.array([r["label"] for r in records], np.int32)
        if len({image.shape for image in images}) == 1:
            images = np.stack(images)
        return images, labels
