"""Model builders, the papers' split points and the balanced splitter."""

import itertools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import chained

from dgrad import models
from dgrad.models.split import balanced_cuts


def count_params(stages):
    return sum(x.size for s in stages for x in jax.tree.leaves(nnx.state(s, nnx.Param)))


@pytest.mark.slow
@pytest.mark.parametrize("depth,params", [(20, 269_722), (56, 853_018)])
def test_cifar_resnet_has_the_papers_size(depth, params):
    stages = models.cifar_resnet(depth, num_stages=2)
    assert count_params(stages) == params
    assert chained(stages, jnp.zeros((2, 32, 32, 3))).shape == (2, 10)


def test_splitting_does_not_change_the_model():
    x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    whole = chained(models.cifar_resnet(20, num_stages=1, rngs=3), x)
    for k in (2, 3, 4, 11):
        split = chained(models.cifar_resnet(20, num_stages=k, rngs=3), x)
        assert jnp.allclose(split, whole, atol=1e-5)


def _sizes(stages):
    return [len(s.layers) for s in stages]


@pytest.mark.slow
def test_the_papers_resnet_splits():
    n = 9  # ResNet-56: [stem, 9 x L1, 9 x L2, 9 x L3, head]
    assert _sizes(models.cifar_resnet(56, num_stages=2)) == [1 + n + 4, (n - 4) + n + 1]
    assert _sizes(models.cifar_resnet(56, num_stages=3)) == [1 + n, n, n + 1]
    assert _sizes(models.cifar_resnet(56, num_stages=4)) == [1 + 6, 3 + 4, 5 + 2, 7 + 1]
    n = 18
    assert _sizes(models.cifar_resnet(110, num_stages=2)) == [1 + n + 9, 9 + n + 1]
    assert _sizes(models.cifar_resnet(110, num_stages=4)) == [1 + 13, 5 + 9, 9 + 5, 13 + 1]
    with pytest.raises(ValueError, match="papers give no split of ResNet-110 into 3 stages"):
        models.cifar_resnet(110, num_stages=3, split="authors")


def test_the_papers_wide_resnet_splits():
    abstract = nnx.eval_shape(lambda: models.wide_resnet(28, 10, num_stages=4))
    assert _sizes(abstract) == [1 + 3, 1 + 2, 2 + 1, 3 + 1]
    abstract = nnx.eval_shape(lambda: models.wide_resnet(28, 10, num_stages=2))
    assert _sizes(abstract) == [1 + 4 + 2, 2 + 4 + 1]
    assert count_params(abstract) == pytest.approx(36.5e6, rel=0.01)


def test_too_many_stages_is_a_clear_error():
    with pytest.raises(ValueError, match="ResNet-20 has 11 splittable blocks.*at most 11"):
        models.cifar_resnet(20, num_stages=12)
    with pytest.raises(ValueError, match="MLP.*has 2 splittable blocks"):
        models.mlp([4, 8, 2], num_stages=3)


@pytest.mark.parametrize("bad", [dict(depth=21), dict(depth=4)])
def test_bad_depth(bad):
    with pytest.raises(ValueError, match="6n\\+2"):
        models.cifar_resnet(**bad)


def test_explicit_cuts():
    assert _sizes(models.mlp([4, 8, 8, 8, 2], num_stages=2, split=[3])) == [3, 1]
    with pytest.raises(ValueError, match="strictly increasing"):
        models.mlp([4, 8, 8, 8, 2], num_stages=3, split=[3, 2])
    with pytest.raises(ValueError, match="3 stages need 2 cuts"):
        models.mlp([4, 8, 8, 8, 2], num_stages=3, split=[2])


def _brute_force(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_cuts_are_optimal(seed):
    rng = jax.random.key(seed)
    n = 3 + seed % 7
    costs = [int(c) for c in jax.random.randint(rng, (n,), 1, 20)]
    for k in range(1, n + 1):
        cuts = balanced_cuts(costs, k)
        bounds = [0, *cuts, n]
        assert len(cuts) == k - 1 and all(a < b for a, b in zip(bounds, bounds[1:]))
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert worst == _brute_force(costs, k)
