"""The docstring examples run and say what they show."""

import doctest
import importlib

import pytest

MODULES = [
    "dgrad.schedule",
    "dgrad.optim",
    "dgrad.optim.shrink",
    "dgrad.optim.delay",
    "dgrad.optim.compensation",
    "dgrad.optim.prediction",
    "dgrad.optim.schedules",
    "dgrad.optim.per_stage",
    "dgrad.losses",
    "dgrad.stage",
    "dgrad.placement",
    "dgrad.pipeline",
    "dgrad.reference",
    "dgrad.models.split",
    "dgrad.models.mlp",
    "dgrad.models.resnet",
    "dgrad.models.cnn1d",
    "dgrad.balance",
    "dgrad.data",
    "dgrad.data.arrays",
    "dgrad.data.digits",
    "dgrad.data.mnist1d",
    "dgrad.data.augment",
    "dgrad.data.stream",
    "dgrad.checkpoint",
    "dgrad.export",
    "dgrad.metrics",
    "dgrad.progress",
    "dgrad.experiment",
    "dgrad.timeline",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
