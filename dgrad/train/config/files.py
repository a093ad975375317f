"""Experiment config files: `experiments/configs/*.py`, each defining `get_config(variant)`.

A mistake in a file (a misspelled field, a wrong type, a syntax error, an exception) is
one ValueError line naming the file and its line; a missing file is FileNotFoundError.
"""

from __future__ import annotations

import importlib.util
import os
import re
import traceback

import ml_collections

from dgrad.train.config.fields import unknown_field


def load(spec: str) -> tuple[ml_collections.ConfigDict, str]:
    """`get_config(variant)` of the config file in `spec` (`FILE` or `FILE:variant`), and
    the file's name (what the command line's `--config` takes; for notebooks).

    >>> config, name = load("experiments/configs/default.py:smoke")
    >>> name, config.dataset, config.num_epochs
    ('default', 'digits', 3)
    """
    path, _, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (the configs are in experiments/configs/)")
    name = os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(f"dgrad_config_{name}", path)
    if module_spec is None or not path.endswith(".py"):
        raise ValueError(f"{path} is not a config file (a .py file that defines get_config)")
    module = importlib.util.module_from_spec(module_spec)

    def run(code):
        try:
            return code()
        except Exception as error:  # the file's own mistake: say where, in one line
            raise ValueError(_mistake_in(module_spec.origin, error, spec)) from None

    run(lambda: module_spec.loader.exec_module(module))
    if not hasattr(module, "get_config"):
        raise ValueError(f"{path} defines no get_config(variant)")
    config = run(lambda: module.get_config(variant) if variant else module.get_config())
    if not isinstance(config, ml_collections.ConfigDict):
        raise ValueError(
            f"{spec}: get_config returned a {type(config).__name__}; it returns the "
            "ml_collections.ConfigDict of dgrad.train.config.base() with its changes"
        )
    return config, name


def _mistake_in(path: str, error: Exception, spec: str | None = None) -> str:
    """`error`, raised while running the config file at `path` (given as `spec`), as one
    line naming its line (a misspelled field as `unknown_field` says it)."""
    full = os.path.abspath(path)
    frames = traceback.extract_tb(error.__traceback__)
    lines = [f.lineno for f in frames if os.path.abspath(f.filename) == full]
    if isinstance(error, SyntaxError) and os.path.abspath(error.filename or "") == full:
        lines.append(error.lineno)
    shown = spec.partition(":")[0] if spec else path
    where = f"{shown}, line {lines[-1]}" if lines else shown
    text = str(error)
    missing = re.search(r'Key "([^"]+)" does not exist', text)
    if missing:  # ml_collections' message carries a dump of the whole config
        return f"{where}: {unknown_field(missing.group(1))}"
    message = text.strip().splitlines()[0][:300] if text.strip() else ""
    kind = "" if isinstance(error, ValueError) else f"{type(error).__name__}: "
    return f"{where}: {kind}{message}".rstrip(": ")
