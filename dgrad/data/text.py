"""Text as token windows: a flat token array cut into windows of context + 1 tokens.

A `Windows` source's example i is the window starting at token i * context:
its first `context` tokens are the inputs and the same window shifted by one
the targets, so every token but the first is a target exactly once per epoch.
The `dgrad.data.Stream` over it shuffles the windows per epoch, so batch t is a
pure function of (seed, t) and each process builds only its own rows, as with
images.

`stdlib_corpus()` is the embedded default: the Python standard library's own
source files of the interpreter that runs it (read at run time; its test
suites and site-packages left out), byte-level (256 tokens), split into train
and test by file. It differs between Python versions, so `fingerprint` names
the version, the file count, the bytes and a hash.

>>> corpus = stdlib_corpus()
>>> corpus.fingerprint["files"] > 100, corpus.train.dtype, corpus.vocab_size
(True, dtype('uint8'), 256)
>>> inputs, targets = Windows(corpus.train, context=8).get(np.array([0, 1]))
>>> inputs.shape, bool((inputs[:, 1:] == targets[:, :-1]).all())  # shifted by one token
((2, 8), True)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import platform
import sysconfig

import numpy as np

from dgrad.data.augment import Transform


class Windows:
    """Windows of `context` + 1 tokens of `tokens`, one every `context` tokens.

    >>> windows = Windows(np.arange(10, dtype=np.uint8), context=3)
    >>> len(windows)  # windows start at 0, 3, 6
    3
    >>> windows.get(np.array([2]))
    (array([[6, 7, 8]], dtype=int32), array([[7, 8, 9]], dtype=int32))
    """

    def __init__(self, tokens: np.ndarray, context: int):
        if context < 1 or len(tokens) < context + 1:
            raise ValueError(
                f"A window of context={context} needs at least {context + 1} tokens; the "
                f"corpus has {len(tokens)}: use a shorter context or more text."
            )
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def get(self, indices: np.ndarray):
        """The windows at `indices` as (inputs, targets), int32 arrays of shape (n, context).

        >>> Windows(np.arange(7, dtype=np.uint8), context=2).get(np.array([0, 2]))[1]
        array([[1, 2],
               [5, 6]], dtype=int32)
        """
        starts = np.asarray(indices) * self.context
        rows = starts[:, None] + np.arange(self.context + 1)
        window = self.tokens[rows].astype(np.int32)
        return window[:, :-1], window[:, 1:]


tokens = Transform(lambda inputs, targets, rows: (inputs, targets))  # already int32


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenised text's train and test tokens, its vocabulary size and fingerprint."""

    train: np.ndarray
    test: np.ndarray
    vocab_size: int
    fingerprint: dict


def _is_test_file(path: pathlib.Path) -> bool:
    return any(part in ("test", "tests", "idle_test") for part in path.parts)


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> Corpus:
    """The standard library's source of this interpreter as bytes: every `.py` file under
    `sysconfig`'s stdlib path but its test suites and site-packages, in sorted order; a
    file goes to the test split when the first byte of its path's SHA-256 is below 26
    (about 10%).

    >>> fingerprint = stdlib_corpus().fingerprint
    >>> sorted(fingerprint)
    ['bytes', 'files', 'python', 'sha256', 'test_bytes', 'test_files']
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        path
        for path in root.rglob("*.py")
        if "site-packages" not in path.parts
        and "__pycache__" not in path.parts
        and not _is_test_file(path.relative_to(root))
    )
    if not paths:
        raise FileNotFoundError(
            f"No Python source files under {root}: this interpreter ships its standard "
            "library compiled only; use a tfds text dataset instead."
        )
    train, test, digest = [], [], hashlib.sha256()
    for path in paths:
        name = path.relative_to(root).as_posix()
        text = path.read_bytes()
        digest.update(name.encode() + b"\0" + text)
        held_out = hashlib.sha256(name.encode()).digest()[0] < 26
        (test if held_out else train).append(text)
    fingerprint = {
        "python": platform.python_version(),
        "files": len(paths),
        "bytes": sum(map(len, train)) + sum(map(len, test)),
        "test_files": len(test),
        "test_bytes": sum(map(len, test)),
        "sha256": digest.hexdigest()[:16],
    }

    def joined(texts):
        return np.frombuffer(b"".join(texts), np.uint8)

    return Corpus(joined(train), joined(test), 256, fingerprint)


def save_whole(path: pathlib.Path, array: np.ndarray) -> None:
    """Saves `array` as `path` (.npy), whole or not at all: written beside it, then renamed,
    so a stopped run leaves no half file for the next one to trust.

    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp(), "cache", "tokens.npy")
    >>> save_whole(path, np.arange(3, dtype=np.uint8))
    >>> np.load(path), sorted(p.name for p in path.parent.iterdir())
    (array([0, 1, 2], dtype=uint8), ['tokens.npy'])
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npy")
    np.save(partial, array)
    partial.rename(path)


TFDS_TEXT = {"tiny_shakespeare": "text", "lm1b": "text"}  # tfds text datasets: their feature


def text_feature(name: str) -> tuple[str, str] | None:
    """The tfds dataset and text feature a dataset name stands for (None: not tfds text):
    a name of `TFDS_TEXT`, or any tfds dataset as `NAME:FEATURE`.

    >>> text_feature("tiny_shakespeare"), text_feature("wiki40b/en:text"), text_feature("cifar10")
    (('tiny_shakespeare', 'text'), ('wiki40b/en', 'text'), None)
    """
    if name in TFDS_TEXT:
        return name, TFDS_TEXT[name]
    dataset, colon, feature = name.partition(":")
    return (dataset, feature) if colon and dataset and feature else None


def tfds_corpus(name: str, feature: str = "text", data_dir: str | None = None) -> Corpus:
    """The text feature of a prepared tfds dataset as bytes (UTF-8), its examples joined by
    newlines: the train split for training, and its test split (else validation) for test.
    Read once, then kept beside the data as `<data_dir>/dgrad_bytes/*.npy`.

    >>> import tensorflow_datasets as tfds, tempfile
    >>> with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    ...     corpus = tfds_corpus("tiny_shakespeare", data_dir=tempfile.mkdtemp())
    >>> corpus.vocab_size, corpus.train.dtype, corpus.fingerprint["tfds"], corpus.train.size > 0
    (256, dtype('uint8'), 'tiny_shakespeare', True)
    """
    from dgrad.data.tfds_source import DatasetNotFoundError, default_data_dir, open_split

    data_dir = data_dir or default_data_dir()
    train_source = open_split(name, "train", data_dir)
    splits = train_source.dataset_info.splits
    test_split = "validation" if splits and "test" not in splits else "test"
    version = str(train_source.dataset_info.version)
    if feature not in train_source.dataset_info.features:
        features = ", ".join(train_source.dataset_info.features)
        raise DatasetNotFoundError(
            f"Dataset {name} has no feature {feature!r}; name one of its features ({features}) "
            f"as {name}:FEATURE"
        )

    def read(split, source):
        cache = pathlib.Path(data_dir, "dgrad_bytes", f"{name}-{version}-{split}-{feature}.npy")
        if cache.exists():
            return np.load(cache)
        texts = []
        for index in range(len(source)):
            value = source[index][feature]
            texts.append(value if isinstance(value, bytes) else str(value).encode())
        array = np.frombuffer(b"\n".join(texts), np.uint8)
        save_whole(cache, array)
        return array

    train = read("train", train_source)
    test = read(test_split, open_split(name, test_split, data_dir))
    digest = hashlib.sha256(train.tobytes() + b"\0" + test.tobytes()).hexdigest()[:16]
    fingerprint = {
        "tfds": name,
        "version": version,
        "feature": feature,
        "bytes": int(train.size + test.size),
        "test_bytes": int(test.size),
        "sha256": digest,
    }
    return Corpus(train, test, 256, fingerprint)
