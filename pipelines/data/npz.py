"""SparseGraph npz loader room: Shchur's gnn-benchmark flat `.npz` files (adj_*, attr_*, labels).

The whole graph is loaded (counts match PyG's Amazon/Coauthor datasets, which keep the full graph), and the
split is Shchur et al. 2018's: drawn over the largest connected component (LCC) only, per class 20 random
train and 30 random val vertices, every other LCC vertex test, seeded. Vertices outside the LCC stay in the
graph and are trained over, in no mask: no message reaches them from the LCC, so LCC predictions are
exactly those of a model trained on the LCC alone, as Shchur's numbers are. Amazon Computers' 371 vertices
outside its LCC (281 isolated) have only their features, which a GCN classifies at about 30% there.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from pipelines.data.features import degree_features
from pipelines.data.graph import DataError, Graph, make_graph
from pipelines.data.splits import largest_component, per_class_split

TRAIN_PER_CLASS = 20
VAL_PER_CLASS = 30


def _csr(z, prefix: str, path: Path) -> sp.csr_matrix:
    keys = [f"{prefix}_{k}" for k in ("data", "indices", "indptr", "shape")]
    missing = [k for k in keys if k not in z.files]
    if missing:
        raise DataError(f"{path}: missing arrays {missing}")
    try:
        m = sp.csr_matrix((z[keys[0]], z[keys[1]], z[keys[2]]), shape=tuple(int(s) for s in z[keys[3]]))
        m.check_format(full_check=True)
    except ValueError as e:
        raise DataError(f"{path}: bad {prefix} CSR arrays ({e})") from None
    return m


def load_npz(
    path: str | Path,
    name: str | None = None,
    seed: int = 0,
    train_per_class: int = TRAIN_PER_CLASS,
    val_per_class: int = VAL_PER_CLASS,
) -> Graph:
    """Load a flat SparseGraph npz (no pickles allowed) with a seeded per-class split over the LCC.

    Without attr_* arrays (or a dense attr_matrix) the nodes get `degree_features`.
    """
    path = Path(path)
    name = name or path.stem
    if not path.is_file():
        raise DataError(f"missing npz file {path}")
    try:
        z = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable npz file ({e})") from None
    with z:
        adj = _csr(z, "adj", path)
        if adj.shape[0] != adj.shape[1]:
            raise DataError(f"{path}: adjacency is {adj.shape[0]}x{adj.shape[1]}, not square")
        if "labels" not in z.files:
            raise DataError(f"{path}: no 'labels' array; node classification needs labels")
        labels = z["labels"]
        if "attr_data" in z.files:
            # float32 before densifying: Coauthor CS is 0.5 GB dense in float32, twice that in float64
            features = _csr(z, "attr", path).astype(np.float32).toarray()
        elif "attr_matrix" in z.files:
            features = z["attr_matrix"]
        else:
            features = degree_features(adj)
    if labels.ndim == 2:  # some SparseGraph files store one-hot labels
        labels = np.where(labels.any(axis=1), labels.argmax(axis=1), -1)
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: labels must be integers, got dtype {labels.dtype}")
    if labels.shape != (adj.shape[0],):
        raise DataError(f"{path}: label count {labels.shape[0]} does not match node count {adj.shape[0]}")
    if features.shape[0] != adj.shape[0]:
        raise DataError(f"{path}: feature rows {features.shape[0]} do not match node count {adj.shape[0]}")
    num_classes = int(labels.max()) + 1 if labels.size and labels.max() >= 0 else 0
    # the LCC of the symmetrized graph; make_graph symmetrizes the same edges below
    lcc = largest_component(adj)
    train, val, test = per_class_split(np.where(lcc, labels, -1), num_classes, train_per_class, val_per_class,
                                       seed)
    coo = adj.tocoo()
    return make_graph(name, coo.row, coo.col, features, labels, train, val, test, num_classes=num_classes)
