"""Every module's docstring examples run and say what they show."""

import doctest
import importlib
import pkgutil

import pytest

import dgrad

MODULES = sorted(
    module.name
    for module in pkgutil.walk_packages(dgrad.__path__, prefix="dgrad.")
    if module.name not in ("dgrad.train.cli",)  # its examples are shell commands
)
WITHOUT_EXAMPLES = {
    "dgrad.models",
    "dgrad.train.loop",  # the loop of dgrad.train's example
}


def test_every_module_is_listed():
    assert "dgrad.pipeline" in MODULES and "dgrad.train.checkpoint" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    if name not in WITHOUT_EXAMPLES:
        assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
