"""Experiment configs, one job per module; this module only re-exports.

`fields` (every field: default, meaning, rule; `base`, `check`, `describe`),
`overrides` (`--config.<field>=<value>`), `files` (reading `experiments/configs/*.py`),
`recipes` (the papers' recipes and the smoke variant), `runs` (the runs a config asks
for) and `saved` (a config as a workdir saves it, and what a new config changes in it).
"""

from __future__ import annotations

from dgrad.train.config import files, recipes
from dgrad.train.config.fields import (
    FIELD_NAMES,
    FIELDS,
    MODELS,
    OPTIMIZERS,
    RESUMABLE_FIELDS,
    SCHEDULES,
    SPLITS,
    Field,
    Rule,
    base,
    check,
    describe,
    flatten,
    nearest_field,
    unknown_field,
)
from dgrad.train.config.overrides import apply_overrides, parse_value, set_field
from dgrad.train.config.runs import BASELINE_LABEL, Run, runs_of
from dgrad.train.config.saved import differences, extension, from_json, to_json

__all__ = [
    "BASELINE_LABEL",
    "FIELDS",
    "FIELD_NAMES",
    "MODELS",
    "OPTIMIZERS",
    "RESUMABLE_FIELDS",
    "SCHEDULES",
    "SPLITS",
    "Field",
    "Rule",
    "Run",
    "apply_overrides",
    "base",
    "check",
    "describe",
    "differences",
    "extension",
    "files",
    "flatten",
    "from_json",
    "nearest_field",
    "parse_value",
    "recipes",
    "runs_of",
    "set_field",
    "to_json",
    "unknown_field",
]
