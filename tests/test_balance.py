"""dgrad.measure.balance: block profiling, the balanced cut and the speedup ceiling."""

import jax.numpy as jnp
import pytest

from dgrad import models
from dgrad.measure import balance


def test_profile_blocks_finds_the_heavy_block_and_the_ceiling_it_leaves():
    """One block with 16 times any other's multiply-adds is the slowest by the profile, and
    a two-stage cut of the chain then gains little: the ceiling stays far below 2 (times
    that did not follow the work, all equal say, would read 2)."""
    chain = models.mlp_blocks([16, 64, 1024, 1024, 64, 4])
    times = balance.profile_blocks(chain.modules, jnp.ones((256, 16)), repeats=5)
    assert len(times) == len(chain.modules) and all(t > 0 for t in times)
    assert max(range(len(times)), key=times.__getitem__) == 2, times
    cuts = balance.balanced_cuts(times, 2)
    assert balance.speedup_ceiling(times, cuts) < 1.5, (times, cuts)


def test_stage_costs_and_ceiling():
    assert balance.stage_costs([1, 2, 3, 4], [2, 3]) == [3.0, 3.0, 4.0]
    assert balance.speedup_ceiling([1, 2, 3, 4], [2, 3]) == pytest.approx(10 / 4)
    assert balance.speedup_ceiling([5, 5], []) == 1.0
