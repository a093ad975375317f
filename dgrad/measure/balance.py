"""Measure blocks and cut a model into stages of equal time.

A pipeline runs at the pace of its slowest stage, so the useful split puts
equal *measured* time on each stage. `profile_blocks` times each block's
forward + backward on the target device; `balanced_cuts` (exact min-max over
contiguous blocks) turns the times into cut positions; `speedup_ceiling` says
what the split can give at best.

>>> from dgrad import models
>>> blocks = models.mlp_blocks([16, 64, 64, 64, 4])
>>> times = profile_blocks(blocks.modules, jnp.ones((8, 16)), repeats=2)
>>> len(times), all(t > 0 for t in times)
(4, True)
>>> speedup_ceiling([1.0, 1.0, 2.0], cuts=[2])
2.0
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dgrad.models.split import balanced_cuts, check_cuts
from dgrad.options import Options
from dgrad.stage import Given, StageFunctions, Vars


def profile_blocks(
    blocks: Sequence[nnx.Module],
    example_input,
    *,
    device: jax.Device | None = None,
    repeats: int = 5,
) -> list[float]:
    """Median seconds of each block's forward + backward, fed the previous block's output.

    >>> from dgrad import models
    >>> blocks = models.mlp_blocks([8, 32, 4])
    >>> times = profile_blocks(blocks.modules, jnp.ones((4, 8)), repeats=3)  # seconds, per block
    >>> len(times), all(t > 0 for t in times), balanced_cuts(times, num_stages=2)
    (2, True, [1])
    """
    device = device or jax.devices()[0]
    x = jax.device_put(example_input, device)
    times = []
    replay = Options(weights="current", memory="recompute")  # backward = forward + VJP
    for index, block in enumerate(blocks):
        fns = StageFunctions(block, optax.identity(), options=replay, first=index == 0)
        params, rest = jax.device_put((fns.params, fns.rest), device)
        opt_state = fns.optimizer.init(params)
        _, out = fns.compile().forward(Vars(), Given(params=params, rest=rest, x=x))
        y, record = out.y, out.record
        # timed again and again: a copy that donates nothing
        backward_update = fns.compile(donate=False).backward_update
        args = (
            Vars(params=params, opt_state=opt_state),
            Given(rest=rest, record=record, cotangent=jnp.ones_like(y)),
        )
        jax.block_until_ready(backward_update(*args))
        samples = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            jax.block_until_ready(backward_update(*args))
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
        x = y
    return times


def stage_costs(costs: Sequence[float], cuts: Sequence[int]) -> list[float]:
    """The summed cost of each stage that `cuts` makes.

    >>> stage_costs([1.0, 1.0, 2.0, 4.0], cuts=[2, 3])
    [2.0, 2.0, 4.0]
    """
    bounds = [0, *check_cuts(cuts, len(costs)), len(costs)]
    return [float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:])]


def speedup_ceiling(costs: Sequence[float], cuts: Sequence[int]) -> float:
    """Total cost over the slowest stage's: the most a pipeline of these stages can gain.

    >>> speedup_ceiling([1.0, 1.0, 2.0, 4.0], cuts=[2, 3])  # 8 / 4
    2.0
    >>> costs = [1.0, 2.0, 3.0, 2.0]
    >>> balanced_cuts(costs, 2), speedup_ceiling(costs, balanced_cuts(costs, 2))  # 8 / 5
    ([2], 1.6)
    """
    per_stage = stage_costs(costs, cuts)
    return sum(per_stage) / max(per_stage)


__all__ = ["profile_blocks", "stage_costs", "speedup_ceiling", "balanced_cuts"]
