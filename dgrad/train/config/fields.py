"""The fields of an experiment config: defaults, meanings and rules, in one place.

`FIELDS` lists every field once: its default, its meaning (the pipeline's options take
theirs from `dgrad.options.Options`), whether a resumed run may change it, and the rule
its value keeps. `base()` is the locked config the files in `experiments/configs/`
start from (a misspelled field fails), `check` refuses a value that cannot work with
one line naming the field and the fix, and `describe` is what `--help` lists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from typing import Any, Callable, NamedTuple

import ml_collections
from ml_collections import config_dict

from dgrad.data import DATASETS, is_text
from dgrad.options import PLACEMENTS, Options
from dgrad.schedule import check_virtual_stages

MODELS = ("cifar_resnet", "wide_resnet", "mlp", "cnn1d", "gpt")
OPTIMIZERS = ("sgd", "adamw", "muon", "async_nesterov")
SCHEDULES = ("piecewise", "cosine", "constant")
SPLITS = ("authors", "balanced", "auto")


class Rule(NamedTuple):
    """What a field's value must satisfy on its own, and the fix a refused value is told.

    >>> POSITIVE.holds(0), POSITIVE.fix
    (False, 'use a positive integer')
    """

    holds: Callable[[Any], bool]
    fix: str


def one_of(*allowed: str) -> Rule:
    """A field that takes one of `allowed`.

    >>> one_of("bytes", "bpe").fix
    'choose one of: bytes, bpe'
    """
    return Rule(
        lambda value: value in allowed, "choose one of: " + ", ".join(a or "''" for a in allowed)
    )


def finite(holds: Callable[[float], bool], fix: str) -> Rule:
    """A number that also must not be infinite (nor NaN: `holds` must be true of it).

    >>> rate = finite(lambda value: value > 0, "use a positive rate")
    >>> rate.holds(0.1), rate.holds(float("inf")), rate.holds(float("nan"))
    (True, False, False)
    """
    return Rule(lambda value: holds(value) and not math.isinf(value), fix)


POSITIVE = Rule(lambda value: value >= 1, "use a positive integer")
NONNEGATIVE = Rule(lambda value: value >= 0, "use 0 or more")
ALL_OR_POSITIVE = Rule(
    lambda value: value == -1 or value > 0, "use a positive integer, or -1 for the whole split"
)


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field: `name` (dotted when nested), default, meaning, whether a resumed
    run may change it (it changes how the run is watched or fed, not its numbers), and the
    `rule` its value must satisfy on its own (rules between fields are `check`'s).

    >>> nesterov = next(field for field in FIELDS if field.name == "optimizer.nesterov")
    >>> nesterov.default, nesterov.type, nesterov.resumable  # unset: the authors' choice
    (None, <class 'bool'>, False)
    """

    name: str
    default: Any
    help: str
    kind: type | None = None  # the type of a field whose default is None
    resumable: bool = False
    rule: Rule | None = dataclasses.field(default=None, repr=False)  # checked by `check`

    @property
    def type(self) -> type:
        """The type its values have: its default's, or `kind` where the default is None."""
        return self.kind if self.default is None else type(self.default)


_OPTIONS = {f.name: f for f in dataclasses.fields(Options)}


def _option(name: str, kind: type | None = None, **kwargs) -> Field:
    option = _OPTIONS[name]
    return Field(name, option.default, option.metadata["help"], kind=kind, **kwargs)


FIELDS = (
    Field(
        "dataset",
        "cifar10",
        f"one of {', '.join(DATASETS)}, or a tfds text as NAME:FEATURE",
        rule=Rule(
            lambda name: name in DATASETS or is_text(name), "choose one of: " + ", ".join(DATASETS)
        ),
    ),
    Field(
        "data_dir",
        "",
        "where tfds datasets are prepared ('' = $TFDS_DATA_DIR or ~/tensorflow_datasets)",
        resumable=True,
    ),
    Field("image_size", 224, "side of the ImageNet crops", rule=POSITIVE),
    Field(
        "synthetic_examples",
        4096,
        "synthetic: random 32px training images (for speed runs; 64 steps of 64 by default)",
        rule=POSITIVE,
    ),
    Field("model.name", "cifar_resnet", f"one of {', '.join(MODELS)}", rule=one_of(*MODELS)),
    Field(
        "model.depth",
        56,
        "depth: 6n+2 for cifar_resnet (20, 56, 110, 1202), 6n+4 for WRN, blocks for cnn1d",
        rule=POSITIVE,
    ),
    Field(
        "model.width",
        16,
        "cifar_resnet: channels of the first group; cnn1d: channels",
        rule=POSITIVE,
    ),
    Field(
        "model.widen",
        10,
        "wide_resnet: widening factor (WRN-28-10: depth 28, widen 10)",
        rule=POSITIVE,
    ),
    Field(
        "model.hidden",
        (128, 128),
        "mlp: the hidden layer sizes",
        rule=Rule(
            lambda sizes: all(
                isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1
                for n in sizes
            ),
            "use positive layer sizes separated by commas, as in 128,128",
        ),
    ),
    Field(
        "model.heads",
        4,
        "gpt: attention heads (model.depth: blocks, model.width: dim)",
        rule=POSITIVE,
    ),
    Field(
        "context",
        256,
        "text datasets (stdlib): tokens per window, the gpt's context",
        rule=POSITIVE,
    ),
    Field(
        "tokenizer",
        "bytes",
        "text: bytes (256 tokens) or bpe (a byte-level BPE of vocab_size trained on the "
        "training split with Hugging Face tokenizers, kept in the data folder)",
        rule=one_of("bytes", "bpe"),
    ),
    Field(
        "vocab_size",
        4096,
        "text with tokenizer=bpe: the BPE's vocabulary",
        rule=Rule(lambda size: 256 < size <= 1 << 16, "use more than 256 and at most 65536 tokens"),
    ),
    Field(
        "split",
        "authors",
        "where the model is cut into stages: authors (the papers' cuts), balanced (equal "
        "multiply-adds) or auto (authors' where they give one, else balanced)",
        rule=one_of(*SPLITS),
    ),
    _option("method"),
    Field("num_stages", 2, "K, the number of pipeline stages", rule=POSITIVE),
    _option("beta"),
    _option("weights", kind=str),
    _option("memory", kind=str),
    _option("data_parallel", resumable=True),
    _option("accumulate"),
    _option("microbatches", kind=int),
    _option("virtual_stages"),
    _option("probe_every", kind=int),
    _option("predict", kind=str),
    _option("predict_lr", kind=float),
    Field(
        "placement",
        "spread",
        f"how stages and their replicas map onto devices: {', '.join(PLACEMENTS)} "
        "(see dgrad.placement)",
        resumable=True,
        rule=one_of(*PLACEMENTS),
    ),
    Field(
        "baseline",
        "",
        "bp: also train fused backprop (data parallel over the same D devices) beside the "
        "run; empty: do not",
        rule=one_of("", "bp"),
    ),
    Field(
        "batch_size",
        128,
        "the global batch, split between the data_parallel replicas",
        rule=POSITIVE,
    ),
    Field(
        "num_epochs",
        300,
        "epochs to train (change it on a finished run with --extend)",
        rule=POSITIVE,
    ),
    Field(
        "steps_per_epoch",
        -1,
        "batches per epoch (-1: every full batch of the train split)",
        rule=ALL_OR_POSITIVE,
    ),
    Field(
        "eval_examples",
        -1,
        "test examples evaluated each epoch (-1: the whole test split)",
        rule=ALL_OR_POSITIVE,
    ),
    Field("eval_batch_size", 500, "evaluation batch", resumable=True, rule=POSITIVE),
    Field(
        "seed",
        0,
        "fixes the weights, the data order and the augmentation",
        rule=NONNEGATIVE,
    ),
    Field(
        "optimizer.name",
        "sgd",
        "sgd (momentum, coupled weight decay), adamw (optax.adamw, decoupled weight decay) "
        "muon (optax.contrib.muon on matrices, AdamW on the rest) or async_nesterov "
        "(NAdamW whose momentum grows with each stage's staleness, Ajanthan et al. 2025)",
        rule=one_of(*OPTIMIZERS),
    ),
    Field(
        "optimizer.learning_rate",
        0.1,
        "learning rate",
        rule=finite(lambda rate: rate > 0, "use a positive rate"),
    ),
    Field(
        "optimizer.clip_norm",
        0.0,
        "clip each stage's gradient to this global norm, each stage by its own (0: none)",
        rule=finite(lambda norm: norm >= 0, "use a norm > 0, or 0 for none"),
    ),
    Field(
        "optimizer.momentum",
        0.9,
        "SGD momentum (0: none)",
        rule=Rule(lambda momentum: 0 <= momentum < 1, "use a value in [0, 1)"),
    ),
    Field(
        "optimizer.nesterov",
        None,
        "Nesterov momentum; unset: the authors' choice (DDG's code used it, FDG's did not)",
        kind=bool,
    ),
    Field(
        "optimizer.weight_decay",
        5e-4,
        "coupled weight decay, added to the gradient",
        rule=finite(lambda decay: decay >= 0, "use 0 or more"),
    ),
    Field(
        "optimizer.schedule",
        "piecewise",
        f"learning-rate schedule: {', '.join(SCHEDULES)} (counted in each stage's own updates)",
        rule=one_of(*SCHEDULES),
    ),
    Field(
        "optimizer.boundaries",
        None,
        "piecewise: epochs where the rate is multiplied by optimizer.decay; unset: the "
        "authors' 150, 225 (and 275 for FDG)",
        kind=tuple,
    ),
    Field(
        "optimizer.decay",
        0.1,
        "piecewise: factor at each boundary",
        rule=finite(lambda factor: factor > 0, "use a positive factor"),
    ),
    Field(
        "optimizer.warmup_epochs",
        None,
        "epochs of linear warm-up from lr/100 (schedules count data steps); unset: 5 with "
        "accumulate > 1 (the ADL authors' code), else 0",
        kind=int,
        rule=NONNEGATIVE,
    ),
    Field(
        "log_every_steps", 50, "steps between train-metric records", resumable=True, rule=POSITIVE
    ),
    Field(
        "peak_tflops",
        0.0,
        "peak TFLOP/s of one device in the run's dtype: train records carry the MFU over "
        "all the run's devices (0: no MFU)",
        resumable=True,
        rule=finite(lambda tflops: tflops >= 0, "use a positive number, or 0 for no MFU"),
    ),
    Field(
        "checkpoint_every_steps",
        0,
        "steps between checkpoints (0: only at epoch ends)",
        resumable=True,
        rule=NONNEGATIVE,
    ),
    Field(
        "keep_checkpoints",
        2,
        "newest checkpoints kept (at least 2: the older one stands in for a damaged newest)",
        resumable=True,
        rule=Rule(lambda count: count >= 2, "keep at least 2"),
    ),
    Field(
        "stall_timeout",
        -1.0,
        "seconds without a finished step before a run stops itself with status 75 (-1: 10x "
        "the slowest step so far, at least 300 s; 0: never)",
        resumable=True,
        rule=Rule(
            lambda s: s in (-1, 0) or 0 < s < math.inf,
            "use seconds > 0, 0 (never) or -1 (follow the run)",
        ),
    ),
    Field("prefetch", 4, "batches prepared ahead", resumable=True, rule=POSITIVE),
    Field("data_workers", 4, "threads preparing batches", resumable=True, rule=POSITIVE),
)

FIELD_NAMES = tuple(f.name for f in FIELDS)
RESUMABLE_FIELDS = tuple(f.name for f in FIELDS if f.resumable)
OPTION_FIELDS = tuple(name for name in FIELD_NAMES if name in _OPTIONS)  # dgrad.Options's


def base() -> ml_collections.ConfigDict:
    """A config holding every field at its default; new fields cannot be added (typos fail).

    >>> config = base()
    >>> config.model.name, config.num_stages, config.optimizer.learning_rate
    ('cifar_resnet', 2, 0.1)
    """
    config = ml_collections.ConfigDict()
    for field in FIELDS:
        *parents, leaf = field.name.split(".")
        node = config
        for parent in parents:
            if parent not in node:
                node[parent] = ml_collections.ConfigDict()
            node = node[parent]
        default = field.default
        node[leaf] = config_dict.placeholder(field.kind) if default is None else default
    config.lock()
    return config


def describe() -> str:
    """Every field with its default and meaning, for `--help`.

    >>> [line for line in describe().splitlines() if "--config.num_stages " in line]
    ['  --config.num_stages               K, the number of pipeline stages [2]']
    """
    width = max(len(name) for name in FIELD_NAMES)
    lines = []
    for field in FIELDS:
        default = "unset" if field.default is None else repr(field.default)
        lines.append(f"  --config.{field.name:<{width}}  {field.help} [{default}]")
    return "\n".join(lines)


def nearest_field(name: str) -> str | None:
    """The field whose name is closest to `name`, if any is close.

    >>> nearest_field("learning_rate"), nearest_field("num_stage"), nearest_field("xyz")
    ('optimizer.learning_rate', 'num_stages', None)
    """
    match = difflib.get_close_matches(name, FIELD_NAMES, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_field(name: str, prefix: str = "") -> str:
    """The one line for a `name` that is no field, written and corrected as the user wrote
    it (`prefix`: "--config." on the command line, "config." in code).

    >>> unknown_field("num_stage", "--config.")
    '--config.num_stage is not a config field; did you mean --config.num_stages?'
    """
    near = nearest_field(name)
    hint = f"did you mean {prefix}{near}?" if near else "--help lists them"
    return f"{prefix}{name} is not a config field; {hint}"


def flatten(config: ml_collections.ConfigDict | dict) -> dict[str, Any]:
    """Fields by dotted name.

    >>> flatten({"a": 1, "b": {"c": 2, "d": {"e": 3}}})
    {'a': 1, 'b.c': 2, 'b.d.e': 3}
    """
    out = {}
    for key, value in config.items() if hasattr(config, "items") else config:
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            out.update({f"{key}.{k}": v for k, v in flatten(value).items()})
        else:
            out[key] = value
    return out


def _fail(field: str, value, expected: str):
    raise ValueError(f"config.{field} = {value!r} is not valid: {expected}.")


def check(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the field and the fix for any value that cannot work, on
    its own (its `Field.rule`) or beside the others.

    >>> config = base()
    >>> config.num_stages = 0
    >>> check(config)
    Traceback (most recent call last):
    ...
    ValueError: config.num_stages = 0 is not valid: use a positive integer.
    """
    values = flatten(config)
    for name in values:
        if name not in FIELD_NAMES:
            raise ValueError(unknown_field(name, "config."))
    for field in FIELDS:
        value = values[field.name]
        if value is None:
            continue
        expected = field.type
        real = expected is float and isinstance(value, numbers.Real) and not isinstance(value, bool)
        wrong = not isinstance(value, expected) or (expected is int and isinstance(value, bool))
        if wrong and not real:
            _fail(field.name, value, f"expected a {expected.__name__}")
        if field.rule is not None and not field.rule.holds(value):
            _fail(field.name, value, field.rule.fix)
    text, model = is_text(values["dataset"]), values["model.name"] == "gpt"
    if text != model:
        _fail(
            "model.name",
            values["model.name"],
            "text (stdlib, a tfds text dataset) trains model gpt, and gpt trains on text",
        )
    if values["tokenizer"] == "bpe" and not text:
        _fail("tokenizer", "bpe", "tokenizes text: use it with stdlib or a tfds text dataset")
    if model and values["method"] == "dgl":
        _fail("method", "dgl", "DGL's auxiliary heads pool images; gpt has none, use another")
    if model and values["model.width"] % values["model.heads"]:
        _fail("model.heads", values["model.heads"], "use a divisor of model.width")
    try:
        Options(**{name: values[name] for name in OPTION_FIELDS})
    except ValueError as error:
        raise ValueError(f"config: {error}") from None
    parts = values["microbatches"] or 1
    if values["batch_size"] % parts:
        _fail("batch_size", values["batch_size"], f"use a multiple of microbatches={parts}")
    chunks = values["virtual_stages"]
    if chunks > 1:
        try:
            check_virtual_stages(values["num_stages"] * chunks, chunks, parts, values["method"])
        except ValueError as error:
            raise ValueError(f"config: {error}") from None
