"""Planetoid loader room: Cora and CiteSeer from `ind.<name>.*` files, in the Kipf & Welling layout."""
from __future__ import annotations

import collections
import pickle
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from pipelines.data.graph import DataError, Graph, make_graph

PARTS = ("x", "y", "allx", "ally", "tx", "ty", "graph", "test.index")
NUM_VAL = 500

try:  # NumPy 2 moved the pickle helper; NumPy 1.26 still only has numpy.core
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover
    from numpy.core.multiarray import _reconstruct


class _PlanetoidUnpickler(pickle.Unpickler):
    """Loads only the handful of classes the Planetoid pickles use.

    The files are Python 2 pickles naming `scipy.sparse.csr.csr_matrix` and `numpy.core.multiarray`, module
    paths that newer SciPy/NumPy deprecate; we map them to their public homes. Anything else is refused,
    because unpickling an arbitrary downloaded file would run arbitrary code.
    """

    def find_class(self, module: str, name: str):
        if module.startswith("scipy.sparse") and name.endswith("_matrix") and hasattr(sp, name):
            return getattr(sp, name)
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return _reconstruct
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "collections" and name == "defaultdict":
            return collections.defaultdict
        if module in ("builtins", "__builtin__") and name == "list":
            return list
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _unpickle(path: Path):
    try:
        with open(path, "rb") as f:
            return _PlanetoidUnpickler(f, encoding="latin1").load()
    except FileNotFoundError:
        raise DataError(f"missing Planetoid file {path}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: not a valid Planetoid pickle ({e})") from None


def _dense(m, path: Path) -> np.ndarray:
    if sp.issparse(m):
        return np.asarray(sp.csr_matrix(m).todense())
    if isinstance(m, np.ndarray) and m.ndim == 2:
        return m
    raise DataError(f"{path}: expected a 2-D matrix, got {type(m).__name__}")


def planetoid_files(prefix: str | Path) -> list[Path]:
    """The eight files of a Planetoid dataset; prefix is e.g. `dir/ind.cora`."""
    prefix = str(prefix)
    return [Path(f"{prefix}.{part}") for part in PARTS]


def load_planetoid(prefix: str | Path, name: str | None = None) -> Graph:
    """Load `prefix.{x,y,allx,ally,tx,ty,graph,test.index}` with the public split (Kipf & Welling 2017).

    Features are the raw (binary bag-of-words) rows; apply `row_normalize` for Kipf's preprocessing.
    Test-range ids missing from test.index (15 in CiteSeer) get zero features and label -1.
    """
    prefix = Path(prefix)
    name = name or prefix.name.removeprefix("ind.")
    path = {part: Path(f"{prefix}.{part}") for part in PARTS}
    for p in path.values():
        if not p.is_file():
            raise DataError(f"missing Planetoid file {p}")
    y = _dense(_unpickle(path["y"]), path["y"])
    allx = _dense(_unpickle(path["allx"]), path["allx"])
    ally = _dense(_unpickle(path["ally"]), path["ally"])
    tx = _dense(_unpickle(path["tx"]), path["tx"])
    ty = _dense(_unpickle(path["ty"]), path["ty"])
    adjlist = _unpickle(path["graph"])
    if not isinstance(adjlist, dict):
        raise DataError(f"{path['graph']}: expected a dict of adjacency lists, got {type(adjlist).__name__}")
    try:
        test_index = np.loadtxt(path["test.index"], dtype=np.int64, ndmin=1)
    except ValueError as e:
        raise DataError(f"{path['test.index']}: {e}") from None

    n_train, n_all = y.shape[0], allx.shape[0]
    if ally.shape[0] != n_all or tx.shape[0] != ty.shape[0] or tx.shape[0] != test_index.size:
        raise DataError(f"{prefix}: inconsistent row counts allx={n_all} ally={ally.shape[0]} "
                        f"tx={tx.shape[0]} ty={ty.shape[0]} test.index={test_index.size}")
    if test_index.size == 0 or test_index.min() < n_all:
        raise DataError(f"{path['test.index']}: test ids must be >= {n_all} (rows of allx)")
    # Kipf's layout: the test range starts right after allx, gaps (CiteSeer) become empty nodes.
    n = n_all + int(test_index.max() - test_index.min()) + 1
    if int(test_index.max()) >= n:
        raise DataError(f"{path['test.index']}: test ids do not start at {n_all}")

    features = np.zeros((n, allx.shape[1]), dtype=np.float32)
    features[:n_all] = allx
    features[test_index] = tx
    onehot = np.zeros((n, ally.shape[1]), dtype=np.int32)
    onehot[:n_all] = ally
    onehot[test_index] = ty
    labels = np.where(onehot.any(axis=1), onehot.argmax(axis=1), -1).astype(np.int32)

    keys = np.fromiter(adjlist.keys(), dtype=np.int64, count=len(adjlist))
    lengths = np.fromiter((len(adjlist[k]) for k in adjlist), dtype=np.int64, count=len(adjlist))
    src = np.repeat(keys, lengths)
    dst = np.fromiter((v for k in adjlist for v in adjlist[k]), dtype=np.int64, count=int(lengths.sum()))

    idx = np.arange(n)
    train = idx < n_train
    val = (idx >= n_train) & (idx < n_train + NUM_VAL)
    test = np.zeros(n, dtype=bool)
    test[test_index] = True
    return make_graph(name, src, dst, features, labels, train, val, test, num_classes=ally.shape[1])
