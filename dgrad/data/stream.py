"""The training stream: batch t is a pure function of (seed, t), prefetched on threads.

Batch t belongs to epoch `t // steps_per_epoch`; each epoch visits the
examples in its own seeded permutation (dropping the last partial batch) and
each batch draws its augmentation from its own seeded generator. So the
position in the stream is just the step count: a resumed run asks for
`stream.iterate(start=step)` and sees exactly the batches it would have seen.

Given the sharding of the first stage's batches, the stream builds each batch
as one global `jax.Array` from this process's rows only: a process reads and
augments just the examples its devices hold, and the numbers do not depend on
how many processes or devices share the batch.

>>> from dgrad.data.arrays import synthetic
>>> from dgrad.data.augment import identity
>>> stream = Stream(synthetic(10, (2, 2, 1)), batch_size=4, transform=identity, seed=0)
>>> stream.steps_per_epoch
2
>>> streamed = [y.tolist() for _, y in stream.iterate(0, 3)]
>>> streamed == [stream.batch(t)[1].tolist() for t in range(3)]
True
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
from typing import Iterator, Protocol

import numpy as np

from dgrad.data.augment import Transform


class Source(Protocol):
    """What a `Stream` reads from: `len(source)` examples, `source.get(indices)` by index.

    `dgrad.data.Split` and `dgrad.data.TfdsSource` are sources; so is any class with
    these two methods.

    >>> class Squares:
    ...     def __len__(self):
    ...         return 6
    ...     def get(self, indices):
    ...         return (indices**2)[:, None].astype(np.float32), indices % 2
    >>> from dgrad.data.augment import identity
    >>> Stream(Squares(), batch_size=3, transform=identity, seed=0).batch(0)
    (array([[ 9.],
           [ 4.],
           [25.]], dtype=float32), array([1, 0, 1], dtype=int32))
    """

    def __len__(self) -> int: ...

    def get(self, indices: np.ndarray):
        """The examples at `indices` (an integer array), as `(images, labels)`.

        >>> from dgrad.data import Split
        >>> Split(np.zeros((3, 2)), np.array([5, 6, 7])).get(np.array([2, 0]))[1]
        array([7, 5])
        """
        ...


class Stream:
    """Shuffled, augmented training batches addressed by step.

    Args:
      source: random access to the examples (`len` and `get(indices)`).
      batch_size: examples per batch.
      transform: `(images, labels, rng) -> (inputs, labels)`, see `dgrad.data.augment`.
      seed: fixes every permutation and every augmentation.
      steps_per_epoch: batches per epoch (default: all full batches of the source);
        fewer makes shorter epochs, each still a fresh permutation.
      prefetch: batches prepared ahead of the consumer.
      workers: threads preparing them (decoding and augmentation release the GIL).
      sharding: if given (the first stage's `Placement.sharded(0)`), `iterate`
        yields global `jax.Array`s placed so, built ahead of time from this
        process's rows, so the copy overlaps the training.

    >>> import numpy as np
    >>> from dgrad.data import load
    >>> ds = load("digits")
    >>> stream = Stream(ds.train, 32, transform=ds.train_transform, seed=0)
    >>> stream.steps_per_epoch  # the full batches of 1438 examples
    44
    >>> x, y = stream.batch(50)  # batch 6 of epoch 1
    >>> x.shape, y.shape
    ((32, 8, 8, 1), (32,))
    >>> again = Stream(ds.train, 32, transform=ds.train_transform, seed=0)
    >>> bool(np.array_equal(again.batch(50)[0], x))  # a pure function of (seed, step)
    True
    """

    def __init__(
        self,
        source: Source,
        batch_size: int,
        *,
        transform: Transform,
        seed: int,
        steps_per_epoch: int | None = None,
        prefetch: int = 4,
        workers: int = 2,
        sharding=None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        if batch_size > len(source):
            raise ValueError(
                f"batch_size {batch_size} exceeds the {len(source)} training examples; "
                "use a smaller batch."
            )
        self.source, self.batch_size, self.transform, self.seed = (
            source,
            batch_size,
            transform,
            seed,
        )
        full = len(source) // batch_size
        if steps_per_epoch is not None and not 1 <= steps_per_epoch <= full:
            raise ValueError(
                f"steps_per_epoch must be between 1 and {full} (the full batches of "
                f"{len(source)} examples), got {steps_per_epoch}."
            )
        self.steps_per_epoch = steps_per_epoch or full
        self.prefetch, self.workers = max(1, prefetch), max(1, workers)
        self.sharding = sharding

    def indices(self, step: int) -> np.ndarray:
        """The example indices of batch `step`.

        >>> from dgrad.data.arrays import synthetic
        >>> from dgrad.data.augment import identity
        >>> stream = Stream(synthetic(10, (2, 2, 1)), batch_size=4, transform=identity, seed=0)
        >>> stream.indices(0), stream.indices(1)  # epoch 0's permutation, in two batches
        (array([4, 6, 2, 7]), array([3, 5, 9, 0]))
        >>> stream.indices(2)  # epoch 1: a fresh permutation
        array([9, 1, 3, 8])
        """
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.batch_size
        return _permutation(self.seed, len(self.source), epoch)[start : start + self.batch_size]

    def batch(self, step: int, rows: slice = slice(None)):
        """Rows `rows` of batch `step` (default all): `(inputs, labels)` numpy arrays.

        >>> from dgrad.data.arrays import synthetic
        >>> from dgrad.data.augment import identity
        >>> stream = Stream(synthetic(10, (2, 2, 1)), batch_size=4, transform=identity, seed=0)
        >>> x, y = stream.batch(0)
        >>> x.shape, y, stream.source.labels[stream.indices(0)]
        ((4, 2, 2, 1), array([9, 6, 5, 5], dtype=int32), array([9, 6, 5, 5], dtype=int32))
        >>> stream.batch(0, rows=slice(1, 3))[1]  # a process's share of the batch
        array([6, 5], dtype=int32)
        """
        indices = self.indices(step)
        randomness = None
        if self.transform.draw is not None:
            rng = np.random.default_rng([self.seed, step, 1])
            randomness = self.transform.draw(rng, self.batch_size)[rows]
        images, labels = self.source.get(indices[rows])
        return self.transform.apply(images, labels, randomness)

    def _prepare(self, step: int):
        if self.sharding is None:
            return self.batch(step)
        import jax

        shape = (self.batch_size,)
        local = self.sharding.addressable_devices_indices_map(shape)
        pieces = [(device, self.batch(step, index[0])) for device, index in local.items()]
        example = pieces[0][1] if pieces else self.batch(0, slice(0, 1))
        return tuple(
            jax.make_array_from_single_device_arrays(
                (self.batch_size, *part.shape[1:]),
                self.sharding,
                [jax.device_put(rows[i], device) for device, rows in pieces],
                dtype=part.dtype,
            )
            for i, part in enumerate(example)
        )

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator:
        """Batches `start, start+1, ...` (up to `stop`), `prefetch` of them prepared ahead.

        >>> from dgrad.data.arrays import synthetic
        >>> from dgrad.data.augment import identity
        >>> stream = Stream(synthetic(10, (2, 2, 1)), batch_size=4, transform=identity, seed=0)
        >>> [y.tolist() for _, y in stream.iterate(start=1, stop=3)]  # batches 1 and 2
        [[6, 7, 9, 6], [9, 9, 6, 5]]
        """
        steps = iter(range(start, stop) if stop is not None else _count(start))
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            ahead = collections.deque()

            def submit():
                step = next(steps, None)
                if step is not None:
                    ahead.append(pool.submit(self._prepare, step))

            for _ in range(self.prefetch):
                submit()
            while ahead:
                batch = ahead.popleft().result()
                submit()
                yield batch


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, size: int, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the examples (cached: threads share it)."""
    return np.random.default_rng([seed, epoch]).permutation(size)


def _count(start: int):
    while True:
        yield start
        start += 1


def eval_batches(source: Source, batch_size: int, transform: Transform) -> Iterator:
    """One ordered pass over `source` in full batches: `(inputs, labels, mask)`.

    The last batch is padded by repeating its final example, with `mask` False on
    the padding, so every batch has one shape and each example counts once.

    >>> from dgrad.data.arrays import synthetic
    >>> from dgrad.data.augment import identity
    >>> batches = list(eval_batches(synthetic(10, (2, 2, 1)), 4, identity))
    >>> [inputs.shape[0] for inputs, _, _ in batches], [int(m.sum()) for _, _, m in batches]
    ([4, 4, 4], [4, 4, 2])
    >>> batches[-1][2]
    array([ True,  True, False, False])
    """
    n = len(source)
    for start in range(0, n, batch_size):
        indices = np.arange(start, min(start + batch_size, n))
        mask = np.ones(batch_size, bool)
        if len(indices) < batch_size:
            mask[len(indices) :] = False
            indices = np.concatenate([indices, np.full(batch_size - len(indices), indices[-1])])
        inputs, labels = transform.apply(*source.get(indices), None)
        yield inputs, labels, mask
