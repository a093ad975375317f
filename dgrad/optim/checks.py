"""The checks of the transforms' numeric hyperparameters, in one place.

A value `optax.inject_hyperparams` feeds (a JAX array) passes as it is: it is
known only when the update runs.

>>> non_negative("eps", 1e-8), unit_interval("b1", 0.9)
(1e-08, 0.9)
"""

from __future__ import annotations

import math
import numbers

import jax


def unit_interval(name: str, value) -> float:
    """`value` as a float if it lies in [0, 1); else ValueError naming `name`.

    >>> unit_interval("decay", 1.5)
    Traceback (most recent call last):
    ...
    ValueError: decay must be a number in [0, 1), got 1.5.
    """
    if isinstance(value, jax.Array):  # a hyperparameter optax.inject_hyperparams feeds
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
    if isinstance(value, jax.Array):  # a hyperparameter optax.inject_hyperparams feeds
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}.")
    return float(value)
