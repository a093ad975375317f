"""In-memory datasets: a pair of arrays, random access by index, and batching.

>>> split = Split(np.zeros((10, 2, 2, 1), np.float32), np.arange(10, dtype=np.int32))
>>> len(split), split.get(np.array([3, 1]))[1]
(10, array([3, 1], dtype=int32))
>>> [y.tolist() for _, y in batches(split, 4)]
[[0, 1, 2, 3], [4, 5, 6, 7]]
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np


class Split(NamedTuple):
    """One split of a dataset held in memory.

    >>> split = Split(np.zeros((4, 2, 2, 1), np.float32), np.array([0, 1, 1, 0], np.int32))
    >>> len(split), split.images.shape
    (4, (4, 2, 2, 1))
    """

    images: np.ndarray  # N x H x W x C
    labels: np.ndarray  # N, int32

    def __len__(self) -> int:
        return len(self.labels)

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The examples at `indices`, as `(images, labels)` arrays.

        >>> images = np.arange(8, dtype=np.float32).reshape(4, 2)
        >>> split = Split(images, np.array([0, 1, 1, 0], np.int32))
        >>> split.get(np.array([2, 0]))
        (array([[4., 5.],
               [0., 1.]], dtype=float32), array([1, 0], dtype=int32))
        """
        return self.images[indices], self.labels[indices]


def batches(
    split: Split, batch_size: int, *, seed: int | None = None, drop_remainder: bool = True
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One pass over `split` in batches, shuffled when `seed` is given.

    >>> split = Split(np.zeros((10, 1), np.float32), np.arange(10, dtype=np.int32))
    >>> [y.tolist() for _, y in batches(split, 4, drop_remainder=False)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> shuffled = [y.tolist() for _, y in batches(split, 5, seed=0)]
    >>> shuffled != [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], sorted(sum(shuffled, [])) == list(range(10))
    (True, True)
    """
    n = len(split.labels)
    if batch_size > n and drop_remainder:
        raise ValueError(f"batch_size {batch_size} exceeds the {n} examples of this split.")
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    stop = n - n % batch_size if drop_remainder else n
    for start in range(0, stop, batch_size):
        index = order[start : start + batch_size]
        yield split.images[index], split.labels[index]


def synthetic(
    num_examples: int,
    image_shape: tuple[int, ...] = (32, 32, 3),
    num_classes: int = 10,
    *,
    seed: int = 0,
) -> Split:
    """Random uint8 images with random labels, for speed runs (nothing to learn).

    >>> synthetic(8, (4, 4, 3)).images.shape
    (8, 4, 4, 3)
    """
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (num_examples, *image_shape), dtype=np.uint8)
    labels = rng.integers(0, num_classes, num_examples).astype(np.int32)
    return Split(images, labels)
