"""dgrad.balance: block profiling, the balanced cut and the speedup ceiling."""

import jax.numpy as jnp
import pytest

from dgrad import balance, models


def test_profile_blocks_times_every_block():
    chain = models.mlp_blocks([16, 64, 64, 64, 4])
    times = balance.profile_blocks(chain.modules, jnp.ones((4, 16)), repeats=2)
    assert len(times) == len(chain.modules) and all(t > 0 for t in times)
    cuts = balance.balanced_cuts(times, 2)
    assert 1.0 <= balance.speedup_ceiling(times, cuts) <= 2.0


def test_stage_costs_and_ceiling():
    assert balance.stage_costs([1, 2, 3, 4], [2, 3]) == [3.0, 3.0, 4.0]
    assert balance.speedup_ceiling([1, 2, 3, 4], [2, 3]) == pytest.approx(10 / 4)
    assert balance.speedup_ceiling([5, 5], []) == 1.0
