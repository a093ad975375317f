"""Test loss and accuracy over a whole split, through the pipeline's own loss, in
evaluation mode with the current weights. Every process calls `evaluate` and gets the
same record.

>>> import jax.numpy as jnp, optax, dgrad
>>> from dgrad import data, models
>>> ds = data.load("digits")
>>> pipe = dgrad.Pipeline(models.mlp([64, 32, 10], num_stages=2), method="fdg",
...                       optimizer=optax.sgd(0.1))
>>> state = pipe.init(data.Stream(ds.train, 32, transform=ds.train_transform, seed=0).batch(0))
>>> record = evaluate(pipe, state, ds.test, ds.eval_transform, batch_size=100)
>>> sorted(record), 0 <= record["test_accuracy"] <= 1
(['test_accuracy', 'test_loss'], True)
"""

from __future__ import annotations

from typing import Callable

import jax

from dgrad import data
from dgrad.pipeline import Pipeline
from dgrad.placement import share
from dgrad.state import PipelineState


class Limited:
    """The first `n` examples of a source (for smoke-sized evaluation), never more than
    it has.

    >>> from dgrad import data
    >>> few = Limited(data.synthetic(10, (2, 2, 1)), 4)
    >>> len(few), few.get([0, 1])[1].shape  # (images, labels) as the source's `get`
    (4, (2,))
    """

    def __init__(self, source: data.Source, n: int):
        self.source, self.n = source, min(n, len(source))

    def __len__(self):
        return self.n

    def get(self, indices):
        """The source's examples at `indices` (which `len` keeps below `n`)."""
        return self.source.get(indices)


def evaluate(
    pipe: Pipeline,
    state: PipelineState,
    source: data.Source,
    transform: data.augment.Transform,
    batch_size: int,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, float]:
    """`test_<metric>` means of `loss_fn`'s loss and metrics over all of `source`, in
    evaluation mode with the current weights. Batches are rounded up to a multiple of the
    replicas; the last one is padded, and the padding masked out. `on_batch` is called
    after each batch is dispatched (a watchdog's beat).

    >>> import optax, dgrad
    >>> from dgrad import data, models
    >>> ds = data.load("digits")
    >>> pipe = dgrad.Pipeline(models.mlp([64, 32, 10], num_stages=2), method="fdg",
    ...                       optimizer=optax.sgd(0.1))
    >>> state = pipe.init(data.Stream(ds.train, 32, transform=ds.train_transform, seed=0).batch(0))
    >>> evaluate(pipe, state, Limited(ds.test, 150), ds.eval_transform, batch_size=100)
    {'test_accuracy': ..., 'test_loss': ...}
    """
    replicas = pipe.placement.data_parallel
    batch_size = -(-batch_size // replicas) * replicas
    totals = None
    for inputs, labels, mask in data.eval_batches(source, batch_size, transform):
        sums = pipe.evaluation_sums(state, (inputs, labels), mask)
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
        if on_batch is not None:
            on_batch()
    totals = jax.device_get(share(totals))
    count = float(totals.pop("count"))
    return {f"test_{name}": float(value) / count for name, value in totals.items()}
