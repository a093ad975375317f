"""The checks of numeric arguments, in one place: the optax transforms' hyperparameters
and the pipeline's options. Imports nothing beyond the standard library, so that a
config's check loads neither JAX nor a model library.

A value `optax.inject_hyperparams` feeds (a JAX array) passes as it is: it is
known only when the update runs.

>>> non_negative("eps", 1e-8), unit_interval("b1", 0.9), integer("tau", 3)
(1e-08, 0.9, 3)
"""

from __future__ import annotations

import math
import numbers
import sys


def _is_array(value) -> bool:
    """Whether `value` is a JAX array (none can exist before JAX is imported)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, jax.Array)


def unit_interval(name: str, value) -> float:
    """`value` as a float if it lies in [0, 1); else ValueError naming `name`.

    >>> unit_interval("decay", 1.5)
    Traceback (most recent call last):
    ...
    ValueError: decay must be a number in [0, 1), got 1.5.
    """
    if _is_array(value):  # a hyperparameter optax.inject_hyperparams feeds
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}.")
    return float(value)


def non_negative(name: str, value) -> float:
    """`value` as a float if it is finite and >= 0; else ValueError naming `name`.

    >>> non_negative("weight_decay", float("inf"))
    Traceback (most recent call last):
    ...
    ValueError: weight_decay must be a non-negative number, got inf.
    """
    if _is_array(value):  # a hyperparameter optax.inject_hyperparams feeds
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}.")
    return float(value)


def integer(
    name: str,
    value,
    minimum: int = 0,
    what: str | None = None,
    fix: str = "",
    maximum: int | None = None,
) -> int:
    """`value` if it is an integer (not a bool) in [`minimum`, `maximum`]; else ValueError
    naming `name`, saying it must be `what` (default: a non-negative or positive integer)
    and how to `fix`.

    >>> integer("every", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: every must be a positive integer, got 0.
    >>> integer("tau", 2.0, what="a non-negative integer number of updates")
    Traceback (most recent call last):
    ...
    ValueError: tau must be a non-negative integer number of updates, got 2.0.
    >>> integer("stage", 3, maximum=2, what="a stage index in 0..2")
    Traceback (most recent call last):
    ...
    ValueError: stage must be a stage index in 0..2, got 3.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        if what is None:
            what = {0: "a non-negative integer", 1: "a positive integer"}.get(
                minimum, f"an integer >= {minimum}"
            )
        raise ValueError(f"{name} must be {what}, got {value!r}" + (f"; {fix}." if fix else "."))
    return value


def shrinking_factor(beta) -> float:
    """`beta` as a float if it is a gradient-shrinking factor, in (0, 1]; else ValueError.

    >>> shrinking_factor(1), shrinking_factor(0.5)
    (1.0, 0.5)
    >>> shrinking_factor(0)
    Traceback (most recent call last):
        ...
    ValueError: beta must lie in (0, 1] (1 means no shrinking; ...), got 0.0.
    """
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
        raise ValueError(f"beta must be a number in (0, 1], got {beta!r}.")
    beta = float(beta)
    if not (math.isfinite(beta) and 0.0 < beta <= 1.0):
        raise ValueError(
            f"beta must lie in (0, 1] (1 means no shrinking; the FDG paper used 0.2-0.8), "
            f"got {beta}."
        )
    return beta
