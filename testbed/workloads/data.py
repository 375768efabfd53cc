"""Data sets of the built-in training jobs: scikit-learn's bundled digits, and a synthetic
classification problem of any size. Nothing is downloaded.

* ``digits``: ``sklearn.datasets.load_digits`` (1797 images of 8x8 pixels, 10 classes; the
  file ships inside scikit-learn).
* ``synthetic``: ``sklearn.datasets.make_classification`` with ``samples`` rows of
  ``features`` columns and ``classes`` classes (half the features informative, one cluster
  per class), for models and gradients larger than digits allows.

:func:`load_dataset` shuffles with the job's seed, holds out ``test_fraction`` of the rows as
the test split (accuracy is always measured there) and standardises every feature with the
training split's mean and deviation. :meth:`Dataset.shard` gives worker ``rank`` of ``n`` its
own contiguous slice of the training rows (data parallelism: disjoint shards), and
:class:`BatchSampler` draws its batches without replacement, epoch by epoch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("digits", "synthetic")


@dataclass
class Dataset:
    """Standardised float32 features and int64 labels, split into train and test."""

    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    n_classes: int

    @property
    def n_features(self) -> int:
        """Columns of X."""
        return int(self.X_train.shape[1])

    def shard_bounds(self, n: int) -> np.ndarray:
        """Row offsets of ``n`` near-equal contiguous shards of the training split."""
        q, r = divmod(len(self.y_train), n)
        sizes = np.full(n, q, dtype=np.int64)
        sizes[:r] += 1
        return np.concatenate([[0], np.cumsum(sizes)])

    def shard(self, rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(X, y) of worker ``rank`` of ``n`` (views, no copies)."""
        b = self.shard_bounds(n)
        return self.X_train[b[rank]:b[rank + 1]], self.y_train[b[rank]:b[rank + 1]]


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(X, y) of scikit-learn's digits, read straight from the CSV file the package ships
    (``sklearn/datasets/data/digits.csv.gz``: 64 pixel columns, then the label), which is what
    ``sklearn.datasets.load_digits`` reads too, without importing scikit-learn (and scipy):
    0.5 s instead of 2-5 s for every training pool. Falls back to the public function when
    the file is not where this version of scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError("the digits data set ships with scikit-learn: pip install "
                          "scikit-learn (a dependency of the testbed)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        data = np.loadtxt(path, delimiter=",")
        return data[:, :-1], data[:, -1].astype(np.int64)
    # here, not at the top: scikit-learn takes about 2 s to import; only this data set, and
    # only before its CSV copy exists, needs it
    from sklearn.datasets import load_digits as sk_load_digits

    return sk_load_digits(return_X_y=True)


def load_dataset(name: str, *, seed: int = 0, test_fraction: float = 0.2,
                 samples: int = 10_000, features: int = 64, classes: int = 10) -> Dataset:
    """Data set ``name`` (see the module docstring), split and standardised.

    ``samples``/``features``/``classes`` size the synthetic one (digits is fixed)."""
    if name == "digits":
        X, y = load_digits()
        n_classes = 10
    elif name == "synthetic":
        # function-level: importing sklearn.datasets loads scipy (2-5 s measured here)
        from sklearn.datasets import make_classification

        informative = max(2, min(features, features // 2))
        X, y = make_classification(
            n_samples=samples, n_features=features, n_informative=informative,
            n_redundant=0, n_classes=classes, n_clusters_per_class=1, flip_y=0.01,
            class_sep=1.0, random_state=seed)
        n_classes = classes
    else:
        raise ValueError(f"dataset={name!r} is not one of {DATASETS}")
    rng = np.random.default_rng([seed, 0xDA7A])
    order = rng.permutation(len(y))
    X, y = np.asarray(X, dtype=np.float64)[order], np.asarray(y, dtype=np.int64)[order]
    n_test = int(round(len(y) * test_fraction))
    X_test, y_test = X[:n_test], y[:n_test]
    X_train, y_train = X[n_test:], y[n_test:]
    mean = X_train.mean(axis=0)
    std = X_train.std(axis=0)
    std[std < 1e-8] = 1.0  # constant pixels (digits' borders) stay 0 instead of dividing by 0
    return Dataset(name, ((X_train - mean) / std).astype(np.float32), y_train,
                   ((X_test - mean) / std).astype(np.float32), y_test, n_classes)


class BatchSampler:
    """Batches of ``batch`` row indices of a shard of ``size`` rows, without replacement
    within an epoch (a fresh permutation per epoch; a short tail is dropped)."""

    def __init__(self, size: int, batch: int, rng: np.random.Generator):
        if not 1 <= batch <= size:
            raise ValueError(f"batch_size={batch} must be between 1 and the shard's {size} rows")
        self.size, self.batch, self.rng = size, batch, rng
        self.order = rng.permutation(size)
        self.pos = 0
        self.epoch = 0

    def next(self) -> np.ndarray:
        """Indices of the next batch."""
        if self.pos + self.batch > self.size:
            self.order = self.rng.permutation(self.size)
            self.pos = 0
            self.epoch += 1
        idx = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return idx
