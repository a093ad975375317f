"""Small offline datasets and batch iteration.

scikit-learn's handwritten digits (1797 8x8 grey images, 10 classes) ship inside
the package, so the default run and the tests need no download.

>>> train, test = load_digits()
>>> train.images.shape, test.images.shape, train.labels.dtype
((1438, 8, 8, 1), (359, 8, 8, 1), dtype('int32'))
>>> x, y = next(iter(batches(train, 32, seed=0)))
>>> x.shape, y.shape
((32, 8, 8, 1), (32,))
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np


class Split(NamedTuple):
    images: np.ndarray  # N x H x W x C, float32, normalised
    labels: np.ndarray  # N, int32


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """The digits, split into train and test by a fixed permutation, normalised
    with the training set's mean and standard deviation."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = digits.images.astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    num_test = int(round(test_fraction * len(labels)))
    test, train = order[:num_test], order[num_test:]
    mean, std = images[train].mean(), images[train].std()
    normalise = lambda x: (x - mean) / std  # noqa: E731
    return Split(normalise(images[train]), labels[train]), Split(
        normalise(images[test]), labels[test]
    )


def batches(
    split: Split, batch_size: int, *, seed: int | None = None, drop_remainder: bool = True
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One pass over `split` in batches, shuffled when `seed` is given."""
    n = len(split.labels)
    if batch_size > n and drop_remainder:
        raise ValueError(f"batch_size {batch_size} exceeds the {n} examples of this split.")
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    stop = n - n % batch_size if drop_remainder else n
    for start in range(0, stop, batch_size):
        index = order[start : start + batch_size]
        yield split.images[index], split.labels[index]
