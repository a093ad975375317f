"""Batch transforms: augmentation and normalisation on the host, in numpy.

A `Transform` turns examples into float32 NHWC inputs and int32 labels in two
parts: `draw(rng, n)` draws the randomness of a whole batch of n examples, one
row per example, and `apply(images, labels, rows)` transforms any examples
given their rows. A process that prepares only its own part of a global batch
draws for the whole batch and applies its rows, so it computes exactly the
numbers a single process would: augmentation does not depend on how the batch
is split.

>>> images = np.zeros((2, 32, 32, 3), np.uint8)
>>> transform = cifar_train(CIFAR10_MEAN, CIFAR10_STD)
>>> x, y = transform(images, np.array([1, 2]), np.random.default_rng(0))
>>> x.shape, x.dtype, y.dtype
((2, 32, 32, 3), dtype('float32'), dtype('int32'))
>>> rows = transform.draw(np.random.default_rng(0), 2)
>>> bool(np.array_equal(transform.apply(images[1:], np.array([2]), rows[1:])[0], x[1:]))
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Transform:
    """`apply(images, labels, rows)` -> `(inputs, labels)`; `draw(rng, n)` -> one row of
    randomness per example (absent for deterministic transforms, whose rows are None).

    >>> shift = Transform(lambda images, labels, rows: (images + rows, labels),
    ...                   draw=lambda rng, n: rng.integers(0, 10, n))
    >>> shift.draw(np.random.default_rng(0), 3)  # one row per example
    array([8, 6, 5])
    >>> shift(np.zeros(3), np.arange(3), np.random.default_rng(0))  # draw, then apply
    (array([8., 6., 5.]), array([0, 1, 2]))
    """

    apply: Callable
    draw: Callable | None = None

    def __call__(self, images, labels, rng: np.random.Generator | None = None):
        """Transforms a whole batch, drawing its randomness from `rng`."""
        rows = None if self.draw is None else self.draw(rng, len(labels))
        return self.apply(images, labels, rows)


CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def normalise(images: np.ndarray, mean, std) -> np.ndarray:
    """uint8 images to float32, scaled to [0, 1] and standardised per channel.

    >>> normalise(np.array([[0, 255]], np.uint8)[..., None], mean=(0.5,), std=(0.5,))
    array([[[-1.],
            [ 1.]]], dtype=float32)
    """
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    return ((np.asarray(images, np.float32) / 255.0 - mean) / std).astype(np.float32)


def _as_inputs(images, labels, rows=None):
    return np.asarray(images, np.float32), np.asarray(labels, np.int32)


identity = Transform(_as_inputs)
"""Images that are already model inputs (the digits): only fixes the dtypes."""


def crop_and_flip_rows(rng: np.random.Generator, n: int, padding: int = 4) -> np.ndarray:
    """Per example: crop offsets (top, left) in [0, 2 * padding] and a flip flag.

    >>> crop_and_flip_rows(np.random.default_rng(0), 3)  # top, left, flip
    array([[7, 5, 1],
           [4, 2, 0],
           [2, 0, 0]])
    """
    offsets = rng.integers(0, 2 * padding + 1, (n, 2))
    flips = rng.random(n) < 0.5
    return np.concatenate([offsets, flips[:, None]], axis=1)


def crop_and_flip(images: np.ndarray, rows: np.ndarray, padding: int = 4) -> np.ndarray:
    """Zero-pads by `padding`, crops back to the original size at each row's offset, and
    flips where the row says (the standard CIFAR augmentation).

    >>> images = np.arange(4, dtype=np.uint8).reshape(1, 2, 2, 1)
    >>> crop_and_flip(images, np.array([[1, 1, 0]]), padding=1)[0, ..., 0]  # the centre: as is
    array([[0, 1],
           [2, 3]], dtype=uint8)
    >>> crop_and_flip(images, np.array([[1, 1, 1]]), padding=1)[0, ..., 0]  # flipped
    array([[1, 0],
           [3, 2]], dtype=uint8)
    >>> crop_and_flip(images, np.array([[0, 1, 0]]), padding=1)[0, ..., 0]  # shifted down
    array([[0, 0],
           [0, 1]], dtype=uint8)
    """
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    out = np.empty_like(images)
    for i, (top, left, flip) in enumerate(rows):
        crop = padded[i, top : top + h, left : left + w]
        out[i] = crop[:, ::-1] if flip else crop
    return out


def cifar_train(mean, std, padding: int = 4) -> Transform:
    """`crop_and_flip` by `padding`, then `normalise`: the CIFAR training transform.

    >>> transform = cifar_train((0.5,) * 3, (0.25,) * 3, padding=1)
    >>> transform.draw(np.random.default_rng(0), 2)  # (top, left, flip) per example
    array([[2, 1, 1],
           [1, 0, 1]])
    >>> x, y = transform(np.full((2, 4, 4, 3), 255, np.uint8), [1, 2], np.random.default_rng(0))
    >>> x[0, :, :, 0]  # white is (1 - 0.5) / 0.25 = 2; cropped a row low, the last is padding
    array([[ 2.,  2.,  2.,  2.],
           [ 2.,  2.,  2.,  2.],
           [ 2.,  2.,  2.,  2.],
           [-2., -2., -2., -2.]], dtype=float32)
    """

    def apply(images, labels, rows):
        images = crop_and_flip(np.asarray(images), rows, padding)
        return normalise(images, mean, std), np.asarray(labels, np.int32)

    return Transform(apply, lambda rng, n: crop_and_flip_rows(rng, n, padding))


def cifar_eval(mean, std) -> Transform:
    """`normalise` only: the CIFAR evaluation transform.

    >>> x, y = cifar_eval((0.5,) * 3, (0.25,) * 3)(np.full((2, 4, 4, 3), 255, np.uint8), [1, 2])
    >>> x.shape, x[0, 0, 0], y
    ((2, 4, 4, 3), array([2., 2., 2.], dtype=float32), array([1, 2], dtype=int32))
    """

    def apply(images, labels, rows=None):
        return normalise(images, mean, std), np.asarray(labels, np.int32)

    return Transform(apply)


def _random_resized_box(height, width, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """The Inception crop box (left, top, right, bottom): random area and aspect ratio."""
    area = height * width
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    side = min(height, width)  # fall back to the central square
    top, left = (height - side) // 2, (width - side) // 2
    return left, top, left + side, top + side


def imagenet_train(size: int = 224, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> Transform:
    """Random-resized crop to `size` and a random horizontal flip (images of any size).

    Each example's row is the seed of its own generator (the crop box is found by
    rejection sampling, which draws a varying number of values).

    >>> images = [np.zeros((20, 30, 3), np.uint8), np.zeros((12, 10, 3), np.uint8)]
    >>> x, y = imagenet_train(8)(images, [0, 1], np.random.default_rng(0))
    >>> x.shape, y  # any sizes in, one size out
    ((2, 8, 8, 3), array([0, 1], dtype=int32))
    """
    from PIL import Image

    def draw(rng, n):
        return rng.integers(0, 2**63 - 1, n)

    def apply(images, labels, rows):
        out = np.empty((len(images), size, size, 3), np.uint8)
        for i, (image, seed) in enumerate(zip(images, rows)):
            rng = np.random.default_rng(seed)
            box = _random_resized_box(image.shape[0], image.shape[1], rng)
            crop = Image.fromarray(image).resize((size, size), Image.BILINEAR, box=box)
            out[i] = np.asarray(crop)[:, ::-1] if rng.random() < 0.5 else np.asarray(crop)
        return normalise(out, mean, std), np.asarray(labels, np.int32)

    return Transform(apply, draw)


def imagenet_eval(
    size: int = 224, resize: int = 256, mean=IMAGENET_MEAN, std=IMAGENET_STD
) -> Transform:
    """Resize the shorter side to `resize`, then the central `size` x `size` crop.

    >>> x, y = imagenet_eval(8, resize=10)([np.full((20, 30, 3), 255, np.uint8)], [3])
    >>> x.shape, x[0, 0, 0]  # white, standardised with the ImageNet mean and std
    ((1, 8, 8, 3), array([2.2489083, 2.4285715, 2.64     ], dtype=float32))
    """
    from PIL import Image

    def apply(images, labels, rows=None):
        out = np.empty((len(images), size, size, 3), np.uint8)
        for i, image in enumerate(images):
            height, width = image.shape[:2]
            scale = resize / min(height, width)
            h, w = max(size, round(height * scale)), max(size, round(width * scale))
            resized = np.asarray(Image.fromarray(image).resize((w, h), Image.BILINEAR))
            top, left = (h - size) // 2, (w - size) // 2
            out[i] = resized[top : top + size, left : left + size]
        return normalise(out, mean, std), np.asarray(labels, np.int32)

    return Transform(apply)
