"""scikit-learn's handwritten digits: the offline dataset of the default run.

The 1797 8x8 grey images of 10 classes ship inside scikit-learn, so the
default run and the tests need no download. They are read from scikit-learn's file
without importing scikit-learn, whose import costs each process of a run about 1.3 s.

>>> train, test = load_digits()
>>> train.images.shape, test.images.shape, train.labels.dtype
((1438, 8, 8, 1), (359, 8, 8, 1), dtype('int32'))
"""

from __future__ import annotations

import gzip
import importlib.util
import pathlib

import numpy as np

from dgrad.data.arrays import Split


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """The digits, split into train and test by a fixed permutation, normalised
    with the training set's mean and standard deviation.

    >>> train, test = load_digits(test_fraction=0.5)
    >>> len(train), len(test)
    (899, 898)
    >>> round(float(train.images.mean()), 6), round(float(train.images.std()), 6)  # normalised
    (0.0, 1.0)
    """
    images, labels = _sklearn_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    num_test = int(round(test_fraction * len(labels)))
    test, train = order[:num_test], order[num_test:]
    mean, std = images[train].mean(), images[train].std()
    normalise = lambda x: (x - mean) / std  # noqa: E731
    return Split(normalise(images[train]), labels[train]), Split(
        normalise(images[test]), labels[test]
    )


def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images (1797, 8, 8, 1) float32 and labels int32 of scikit-learn's
    `load_digits()`, from the file it reads them from (found, not imported)."""
    package = importlib.util.find_spec("sklearn")
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("the digits ship with scikit-learn: pip install scikit-learn")
    path = pathlib.Path(package.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as rows:
        data = np.loadtxt(rows, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8, 1).astype(np.float32), data[:, -1].astype(np.int32)
