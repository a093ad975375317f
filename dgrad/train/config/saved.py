"""A config as a workdir saves it (`dgrad.train.workdir`), and what a new config changes in it.

A field added since a config was saved reads as its default there. A resumed run may
change only the fields that are `resumable` (how it is watched or fed), and, extending,
`num_epochs` upwards.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections

from dgrad.train.config.fields import RESUMABLE_FIELDS, base, flatten


def to_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as plain JSON values (tuples become lists).

    >>> config = base()
    >>> type(config.model.hidden), to_json(config)["model"]["hidden"]
    (<class 'tuple'>, [128, 128])
    """
    return json.loads(config.to_json())


def from_json(saved: dict[str, Any]) -> ml_collections.ConfigDict:
    """The config that `to_json` wrote as `saved` (a field added since reads as its default).

    >>> config = base()
    >>> config.model.hidden = (64, 32)
    >>> from_json(to_json(config)).model.hidden == config.model.hidden
    True
    """
    config = base()
    config.unlock()  # a field since removed: inspect has refused a run it changes
    config.update_from_flattened_dict(
        {k: tuple(v) if isinstance(v, list) else v for k, v in flatten(saved).items()}
    )
    return config


def differences(
    saved: dict[str, Any], config: ml_collections.ConfigDict, *, extending: bool = False
) -> list[str]:
    """The fields (dotted names) where `config` changes the numbers of a run saved with
    `saved`; when `extending`, more epochs than were saved is an extension, not a change.

    >>> saved = to_json(base())
    >>> config = base()
    >>> config.num_stages, config.log_every_steps = 4, 10
    >>> differences(saved, config)  # log_every_steps only changes how the run is watched
    ['num_stages']
    """
    old, new = _with_defaults(saved), flatten(to_json(config))
    changed = sorted(
        name
        for name in old.keys() | new.keys()
        if old.get(name) != new.get(name) and name not in RESUMABLE_FIELDS
    )
    if extending and "num_epochs" in changed and extension(saved, config) is not None:
        changed.remove("num_epochs")
    return changed


def extension(saved: dict[str, Any], config: ml_collections.ConfigDict) -> int | None:
    """The epochs a run saved with `saved` was trained for, if `config` trains it for more
    (what `--extend` continues from); None for as many epochs or fewer.

    >>> saved, config = to_json(base()), base()
    >>> config.num_epochs = 400
    >>> extension(saved, config)
    300
    """
    trained = _with_defaults(saved)["num_epochs"]
    return trained if config.num_epochs > trained else None


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` by dotted name, a field added after it was saved read as its default."""
    return {**flatten(to_json(base())), **flatten(saved)}
