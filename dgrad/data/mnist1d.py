"""MNIST-1D (Greydanus 2020): ten classes of 1-D signals, generated offline.

The `mnist1d` package builds the dataset from ten digit-like templates by
random padding, scaling, translation, correlated and iid noise and shear,
resampled to 40 points, all from one fixed seed: no download. Its default
arguments give 4000 training and 1000 test signals, split from one shuffled
draw (so no signal is in both). The generator standardises the whole set
(mean 0, standard deviation 1 over train and test together), so the signals
need no further normalisation.

Generating takes seconds, so the arrays are cached as
`$DGRAD_CACHE/mnist1d-<key>.npz` (default `~/.cache/dgrad/`), where the key
hashes the generator's arguments and the package's version.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as cache:
...     train, test = load_mnist1d(num_samples=100, cache_dir=cache)
>>> train.images.shape, test.images.shape, train.images.dtype, train.labels.dtype
((80, 40, 1), (20, 40, 1), dtype('float32'), dtype('int32'))
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
import uuid

import numpy as np

from dgrad.data.arrays import Split

# The `mnist1d` package's defaults (`mnist1d.data.get_dataset_args()` less the
# URL of a pickled copy, which this module never downloads), copied so that a
# load from the cache need not import the package; the tests check they match.
GENERATOR_ARGS = {
    "num_samples": 5000,
    "train_split": 0.8,
    "template_len": 12,
    "padding": [36, 60],
    "scale_coeff": 0.4,
    "max_translation": 48,
    "corr_noise_scale": 0.25,
    "iid_noise_scale": 2e-2,
    "shear_scale": 0.75,
    "shuffle_seq": False,
    "final_seq_length": 40,
    "seed": 42,
}


def default_cache_dir() -> str:
    """Where generated datasets are kept: `$DGRAD_CACHE`, else `~/.cache/dgrad`, made absolute.

    >>> os.path.isabs(default_cache_dir())
    True
    """
    directory = os.environ.get("DGRAD_CACHE") or os.path.join("~", ".cache", "dgrad")
    return os.path.abspath(os.path.expanduser(directory))


def load_mnist1d(
    num_samples: int = 5000, *, seed: int = 42, cache_dir: str | None = None
) -> tuple[Split, Split]:
    """MNIST-1D's train and test splits: `(N, 40, 1)` float32 signals, int32 labels.

    Args:
      num_samples: train and test together, rounded down to a multiple of 10
        (as many per class); the package's default 5000 gives 4000 + 1000.
        Fewer make quick tests.
      seed: the generator's seed (the package's 42 gives the standard dataset).
      cache_dir: where to keep the generated arrays, default `default_cache_dir()`.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as cache:
    ...     train, test = load_mnist1d(num_samples=50, cache_dir=cache)
    >>> len(train), len(test), sorted(set(train.labels.tolist()) | set(test.labels.tolist()))
    (40, 10, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 10:
        raise ValueError(f"num_samples must be an integer of at least 10, got {num_samples!r}.")
    args = {**GENERATOR_ARGS, "num_samples": num_samples, "seed": seed}
    directory = default_cache_dir() if cache_dir is None else cache_dir
    key = json.dumps({**args, "mnist1d": importlib.metadata.version("mnist1d")}, sort_keys=True)
    path = os.path.join(directory, f"mnist1d-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")
    if not os.path.exists(path):
        _save_atomically(path, _generate(args))
    with np.load(path) as arrays:
        return Split(arrays["x"], arrays["y"]), Split(arrays["x_test"], arrays["y_test"])


def _generate(args: dict) -> dict[str, np.ndarray]:
    """Runs the package's generator (without touching the global random state it reseeds)."""
    from mnist1d.data import make_dataset
    from mnist1d.utils import ObjectView

    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        dataset = make_dataset(ObjectView(dict(args)))
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    signals = lambda x: np.asarray(x, np.float32)[..., None]  # noqa: E731
    return {
        "x": signals(dataset["x"]),
        "y": np.asarray(dataset["y"], np.int32),
        "x_test": signals(dataset["x_test"]),
        "y_test": np.asarray(dataset["y_test"], np.int32),
    }


def _save_atomically(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Writes an `.npz` next to `path` and renames it, so readers never see half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}-{uuid.uuid4().hex}.partial"
    try:
        with open(partial, "xb") as f:
            np.savez(f, **arrays)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
