"""Cutting a chain of blocks into pipeline stages.

A model is built as a list of blocks (each an NNX module whose output feeds the
next) and cut at K-1 positions into K stages. `cuts` are the indices of the
blocks that start stages 1..K-1.

>>> balanced_cuts([1, 1, 1, 1, 4], num_stages=2)
[4]
>>> balanced_cuts([3, 1, 1, 1, 1, 1], num_stages=3)
[1, 3]
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from flax import nnx


def balanced_cuts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Cuts `costs` into `num_stages` contiguous runs minimising the largest run's sum.

    Exact (dynamic programming over prefix sums). Among optimal splits it returns
    the one whose cuts come first.

    >>> balanced_cuts([2, 2, 1, 1, 1, 1], num_stages=2)  # stages of cost 4 and 4
    [2]
    >>> balanced_cuts([1, 1, 1], num_stages=3)
    [1, 2]
    """
    n = len(costs)
    check_num_stages(num_stages, n)
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"block costs must be non-negative, got {c}.")
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[j][i]: smallest possible largest stage cost for blocks[:i] in j stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut_at = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        for i in range(j, n - (num_stages - j) + 1):
            for s in range(j - 1, i):
                value = max(best[j - 1][s], prefix[i] - prefix[s])
                if value < best[j][i]:
                    best[j][i], cut_at[j][i] = value, s
    cuts, i = [], n
    for j in range(num_stages, 1, -1):
        i = cut_at[j][i]
        cuts.append(i)
    return cuts[::-1]


def check_num_stages(num_stages: int, num_blocks: int, model: str = "This model") -> None:
    """Raises ValueError unless `num_stages` is a positive integer of at most `num_blocks`.

    >>> check_num_stages(3, 3)  # fits: returns None
    >>> check_num_stages(4, 3, "The MLP")
    Traceback (most recent call last):
        ...
    ValueError: The MLP has 3 splittable blocks, so it cannot be cut into num_stages=4 stages; ...
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if num_stages > num_blocks:
        raise ValueError(
            f"{model} has {num_blocks} splittable blocks, so it cannot be cut into "
            f"num_stages={num_stages} stages; use at most {num_blocks} stages or a deeper model."
        )


def check_cuts(cuts: Sequence[int], num_blocks: int) -> list[int]:
    """`cuts` as a list if they are strictly increasing block indices in 1..num_blocks-1.

    >>> check_cuts((1, 2), 4)
    [1, 2]
    >>> check_cuts([2, 1], 4)
    Traceback (most recent call last):
        ...
    ValueError: cuts must be strictly increasing block indices in 1..3, got [2, 1].
    """
    cuts = list(cuts)
    if (
        any(not isinstance(c, int) for c in cuts)
        or cuts != sorted(set(cuts))
        or (cuts and not (0 < cuts[0] and cuts[-1] < num_blocks))
    ):
        raise ValueError(
            f"cuts must be strictly increasing block indices in 1..{num_blocks - 1}, got {cuts}."
        )
    return cuts


def choose_cuts(
    split: str | Sequence[int],
    num_stages: int,
    costs: Sequence[float],
    authors: Mapping[int, Sequence[int]] | None = None,
    model: str = "This model",
) -> list[int]:
    """Resolves a `split` argument into cut positions.

    Args:
      split: `"auto"` (the papers' split for this model and K where they give
        one, else balanced), `"authors"` (the papers' split, or an error),
        `"balanced"` (`balanced_cuts` on `costs`), or explicit cut positions.
      num_stages: K.
      costs: one cost per block, for balancing.
      authors: the papers' cuts for this model, by K.

    >>> costs, authors = [1, 1, 1, 3], {2: [2]}
    >>> choose_cuts("auto", 2, costs, authors), choose_cuts("balanced", 2, costs, authors)
    ([2], [3])
    >>> choose_cuts("auto", 3, costs, authors), choose_cuts([2, 3], 3, costs)  # no authors' K=3
    ([1, 3], [2, 3])
    >>> choose_cuts("authors", 3, costs, authors, model="Net")
    Traceback (most recent call last):
        ...
    ValueError: The papers give no split of Net into 3 stages (they give K in [2]); ...
    """
    check_num_stages(num_stages, len(costs), model)
    authors = authors or {}
    if isinstance(split, str):
        if split == "authors" and num_stages not in authors and num_stages > 1:
            raise ValueError(
                f"The papers give no split of {model} into {num_stages} stages (they give "
                f"K in {sorted(authors) or 'none'}); use split='balanced' or explicit cuts."
            )
        if split in ("auto", "authors") and num_stages in authors:
            return list(authors[num_stages])
        if split in ("auto", "authors", "balanced"):
            return balanced_cuts(costs, num_stages)
        raise ValueError(
            f"Unknown split {split!r}; use 'auto', 'authors', 'balanced' or a list of cut indices."
        )
    cuts = check_cuts(split, len(costs))
    if len(cuts) != num_stages - 1:
        raise ValueError(
            f"{num_stages} stages need {num_stages - 1} cuts, got {len(cuts)}: {cuts}."
        )
    return cuts


def stages_from_blocks(blocks: Sequence[nnx.Module], cuts: Sequence[int]) -> list[nnx.Sequential]:
    """Groups `blocks` into `nnx.Sequential` stages that start at `cuts`.

    >>> from dgrad.models import mlp_blocks
    >>> stages = stages_from_blocks(mlp_blocks([4, 8, 8, 3]).modules, cuts=[1])
    >>> [len(s.layers) for s in stages]
    [1, 2]
    """
    bounds = [0, *check_cuts(cuts, len(blocks)), len(blocks)]
    return [nnx.Sequential(*blocks[a:b]) for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass
class Blocks:
    """A model as a chain of blocks, ready to be cut into stages.

    Attributes:
      modules: the blocks, each an NNX module whose output feeds the next.
      costs: an estimate of each block's work (multiply-adds), for balancing;
        `dgrad.measure.balance.profile_blocks` measures real times instead.
      authors: the papers' cut positions by number of stages.
      name: the model's name, for error messages.

    >>> from dgrad.models import mlp_blocks
    >>> blocks = Blocks(mlp_blocks([4, 8, 8, 3]).modules, costs=[1, 1, 2], authors={2: [1]})
    >>> [len(s.layers) for s in blocks.stages(2, "authors")], len(blocks.stages(2, [2])[0].layers)
    ([1, 2], 2)
    """

    modules: list
    costs: list[float]
    authors: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    name: str = "This model"

    def stages(self, num_stages: int, split: str | Sequence[int] = "auto") -> list[nnx.Sequential]:
        """Cuts the chain into `num_stages` stages, see `choose_cuts` for `split`.

        >>> from dgrad.models import mlp_blocks
        >>> blocks = Blocks(mlp_blocks([4, 8, 8, 3]).modules, costs=[1, 1, 2], authors={2: [1]})
        >>> [len(s.layers) for s in blocks.stages(2)]  # the authors' cut
        [1, 2]
        >>> [len(s.layers) for s in blocks.stages(2, "balanced")]  # costs 2 and 2
        [2, 1]
        """
        cuts = choose_cuts(split, num_stages, self.costs, self.authors, model=self.name)
        return stages_from_blocks(self.modules, cuts)
