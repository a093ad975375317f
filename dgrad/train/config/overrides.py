"""`--config.<field>=<value>` overrides: how the command line and a sweep's flags set fields.

A value is read as its field's type: a tuple as numbers separated by commas, a bool as
true/false, yes/no or 1/0, and `none` (or nothing) unsets a field whose default is
unset. A mistake is one ValueError line naming the flag and what the field takes.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from dgrad.train.config.fields import FIELD_NAMES, FIELDS, unknown_field


def parse_value(name: str, text: str) -> Any:
    """Field `name`'s value written as `text` on a command line (ValueError saying what
    the field takes, or the nearest field's name).

    >>> parse_value("num_stages", "4"), parse_value("model.hidden", "64,64")
    (4, (64, 64))
    """
    by_name = {f.name: f for f in FIELDS}
    if name not in by_name:
        raise ValueError(unknown_field(name))
    field = by_name[name]
    expected = field.type
    try:
        if field.default is None and text.lower() in ("none", ""):
            return None
        if expected is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if expected is tuple:
            items = [t.strip() for t in text.strip("()[]").split(",") if t.strip()]
            return tuple(int(t) if t.lstrip("-").isdigit() else float(t) for t in items)
        return expected(text)
    except ValueError:
        raise ValueError(
            f"{name}={text}: expected {expected.__name__}"
            + (" values separated by commas" if expected is tuple else "")
        ) from None


def set_field(config: ml_collections.ConfigDict, name: str, value) -> None:
    """Sets the field of dotted `name` (`optimizer.learning_rate`) to `value`.

    >>> from dgrad.train.config import base
    >>> config = base()
    >>> set_field(config, "optimizer.learning_rate", 0.05)
    >>> config.optimizer.learning_rate
    0.05
    """
    *parents, leaf = name.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    node[leaf] = value


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> None:
    """Sets `--config.<field>=<value>` overrides on `config` (what the command line and
    a sweep's `--config.` flags both do; ValueError names the flag and the fix).

    >>> from dgrad.train.config import base
    >>> config = base()
    >>> apply_overrides(config, ["--config.num_stages=4", "--config.model.name=mlp"])
    >>> config.num_stages, config.model.name
    (4, 'mlp')
    """
    for override in overrides:
        name, equals, text = override.removeprefix("--config.").partition("=")
        if not equals:
            raise ValueError(f"{override}: give a value, as in --config.{name}=VALUE")
        if name not in FIELD_NAMES:
            raise ValueError(unknown_field(name, "--config."))
        try:
            set_field(config, name, parse_value(name, text))
        except ValueError as error:
            raise ValueError(f"--config.{error}") from None
