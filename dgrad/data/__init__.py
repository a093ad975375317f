"""Datasets for training: offline digits, MNIST-1D and text, synthetic data, tfds CIFAR /
ImageNet and tfds text (bytes, or a BPE of them).

`load(name)` gives a `Dataset`: the train and test splits as random-access
sources plus the transforms that turn their examples into model inputs.
`Stream` turns the training split into the seeded, prefetched batch stream
that a resumable run needs.

>>> ds = load("digits")
>>> ds.num_classes, ds.input_shape, len(ds.train), len(ds.test)
(10, (8, 8, 1), 1438, 359)
>>> x, y = Stream(ds.train, 32, transform=ds.train_transform, seed=0).batch(0)
>>> x.shape, y.shape
((32, 8, 8, 1), (32,))
"""

from __future__ import annotations

import dataclasses
import os

from dgrad.data import augment, text
from dgrad.data.arrays import Split, batches, synthetic
from dgrad.data.augment import Transform
from dgrad.data.digits import load_digits
from dgrad.data.mnist1d import load_mnist1d
from dgrad.data.stream import Source, Stream, eval_batches
from dgrad.data.text import TFDS_TEXT, Windows, stdlib_corpus, text_feature, tfds_corpus
from dgrad.data.tfds_source import DatasetNotFoundError, TfdsSource, default_data_dir

DATASETS = (
    "digits",
    "mnist1d",
    "synthetic",
    "cifar10",
    "cifar100",
    "imagenet2012",
    "stdlib",
    *TFDS_TEXT,
)


def token_cache(name: str, data_dir: str | None) -> str:
    """Where a text's BPE tokenizer and tokens are kept: `data_dir/dgrad_tokens`, for a tfds
    text by default in its data folder, for stdlib by default in `~/.cache/dgrad`.

    >>> token_cache("stdlib", "/data"), token_cache("stdlib", None).endswith(".cache/dgrad")
    ('/data/dgrad_tokens', True)
    """
    if data_dir is None and name == "stdlib":
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(home, "dgrad")
    return os.path.join(data_dir or default_data_dir(), "dgrad_tokens")


def is_text(name: str) -> bool:
    """Whether dataset `name` is text (token windows for a GPT): stdlib, a tfds text dataset
    of `TFDS_TEXT`, or any tfds dataset's text feature as `NAME:FEATURE`.

    >>> is_text("stdlib"), is_text("tiny_shakespeare"), is_text("ptb:text"), is_text("cifar10")
    (True, True, True, False)
    """
    return name == "stdlib" or text_feature(name) is not None


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset's splits and how to turn their examples into model inputs.

    >>> import numpy as np
    >>> split = synthetic(6, (2, 2, 1))
    >>> ds = Dataset("tiny", split, split, augment.identity, augment.identity, 10, (2, 2, 1))
    >>> x, y = ds.train_transform(*ds.train.get(np.arange(3)))
    >>> x.shape, x.dtype, y
    ((3, 2, 2, 1), dtype('float32'), array([0, 0, 1], dtype=int32))
    """

    name: str
    train: Source
    test: Source
    train_transform: Transform
    eval_transform: Transform
    num_classes: int
    input_shape: tuple[int, ...]
    tokens_per_example: int | None = None  # text: the window's tokens (one byte each)
    fingerprint: dict | None = None  # text: what the corpus was (it differs by Python)


def load(
    name: str,
    *,
    data_dir: str | None = None,
    seed: int = 0,
    image_size: int = 224,
    synthetic_shape: tuple[int, ...] = (32, 32, 3),
    synthetic_examples: int = 4096,
    context: int = 256,
    tokenizer: str = "bytes",
    vocab_size: int = 4096,
) -> Dataset:
    """The dataset `name`, one of `DATASETS`.

    `"digits"` ships with scikit-learn (no download); `"mnist1d"` is generated
    by the `mnist1d` package with its fixed seed (the same dataset whatever
    `seed`; cached, see `dgrad.data.mnist1d`); `"synthetic"` is random
    uint8 images of `synthetic_shape` for speed runs; CIFAR and ImageNet are
    read from `data_dir` (default `$TFDS_DATA_DIR` or `~/tensorflow_datasets`)
    and raise `DatasetNotFoundError`, saying how to prepare them, when absent.
    `"stdlib"` is text: this interpreter's standard library source as bytes
    (`dgrad.data.text.stdlib_corpus`), in windows of `context` tokens whose
    labels are the next tokens; `num_classes` is its vocabulary (256). A tfds text
    dataset (`tiny_shakespeare`, `lm1b`, or `NAME:FEATURE`) is read the same way as
    bytes (`dgrad.data.text.tfds_corpus`), once prepared like CIFAR. With
    `tokenizer="bpe"` a text is in the tokens of a byte-level BPE of `vocab_size`
    trained on its training split (`dgrad.data.bpe`), kept in `token_cache`.

    >>> ds = load("digits")
    >>> ds.name, ds.num_classes, ds.input_shape
    ('digits', 10, (8, 8, 1))
    >>> small = load("synthetic", synthetic_shape=(4, 4, 3), synthetic_examples=64)
    >>> len(small.train), len(small.test), small.input_shape
    (64, 8, (4, 4, 3))
    """
    if name == "digits":
        train, test = load_digits(seed=seed)
        return Dataset(
            name, train, test, augment.identity, augment.identity, 10, train.images.shape[1:]
        )
    if name == "mnist1d":
        train, test = load_mnist1d()
        return Dataset(
            name, train, test, augment.identity, augment.identity, 10, train.images.shape[1:]
        )
    if name == "synthetic":
        train = synthetic(synthetic_examples, tuple(synthetic_shape), 10, seed=seed)
        test = synthetic(max(1, synthetic_examples // 8), tuple(synthetic_shape), 10, seed=seed + 1)
        transform = augment.cifar_eval((0.5,) * synthetic_shape[-1], (0.25,) * synthetic_shape[-1])
        return Dataset(name, train, test, transform, transform, 10, tuple(synthetic_shape))
    if name in ("cifar10", "cifar100"):
        mean, std = {
            "cifar10": (augment.CIFAR10_MEAN, augment.CIFAR10_STD),
            "cifar100": (augment.CIFAR100_MEAN, augment.CIFAR100_STD),
        }[name]
        train = TfdsSource(name, "train", data_dir)
        test = TfdsSource(name, "test", data_dir)
        return Dataset(
            name,
            train,
            test,
            augment.cifar_train(mean, std),
            augment.cifar_eval(mean, std),
            train.num_classes,
            (32, 32, 3),
        )
    if is_text(name):
        corpus = stdlib_corpus() if name == "stdlib" else tfds_corpus(*text_feature(name), data_dir)
        if tokenizer == "bpe":
            from dgrad.data.bpe import bpe_corpus

            corpus = bpe_corpus(corpus, vocab_size, token_cache(name, data_dir))
        train, test = Windows(corpus.train, context), Windows(corpus.test, context)
        return Dataset(
            name,
            train,
            test,
            text.tokens,
            text.tokens,
            corpus.vocab_size,
            (context,),
            tokens_per_example=context,
            fingerprint=corpus.fingerprint,
        )
    if name == "imagenet2012":
        train = TfdsSource(name, "train", data_dir)
        test = TfdsSource(name, "validation", data_dir)
        return Dataset(
            name,
            train,
            test,
            augment.imagenet_train(image_size),
            augment.imagenet_eval(image_size, resize=round(image_size * 256 / 224)),
            train.num_classes,
            (image_size, image_size, 3),
        )
    raise ValueError(f"Unknown dataset {name!r}; choose one of {DATASETS}.")


__all__ = [
    "DATASETS",
    "is_text",
    "Dataset",
    "DatasetNotFoundError",
    "Split",
    "Source",
    "Stream",
    "TfdsSource",
    "Windows",
    "augment",
    "batches",
    "eval_batches",
    "load",
    "load_digits",
    "load_mnist1d",
    "stdlib_corpus",
    "synthetic",
    "tfds_corpus",
]
