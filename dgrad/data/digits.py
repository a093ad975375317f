"""scikit-learn's handwritten digits: the offline dataset of the default run.

The 1797 8x8 grey images of 10 classes ship inside scikit-learn, so the
default run and the tests need no download.

>>> train, test = load_digits()
>>> train.images.shape, test.images.shape, train.labels.dtype
((1438, 8, 8, 1), (359, 8, 8, 1), dtype('int32'))
"""

from __future__ import annotations

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
