"""Split room: seeded train/val/test masks for graphs that ship without a fixed split."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from pipelines.data.graph import DataError


def largest_component(adj: sp.spmatrix) -> np.ndarray:
    """bool [N]: the vertices of the largest connected component of the (undirected) graph."""
    n = adj.shape[0]
    if n == 0:
        return np.zeros(0, dtype=bool)
    _, comp = sp.csgraph.connected_components(adj, directed=False)
    return comp == np.bincount(comp).argmax()


def per_class_split(
    labels: np.ndarray, num_classes: int, train_per_class: int, val_per_class: int, seed: int | np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random `train_per_class` train and `val_per_class` val nodes of every class, every other labelled node test.

    This is the protocol of Shchur et al. 2018 (20 / 30 per class). A class smaller than train+val gives up
    all its nodes to train first, then to val, and leaves none for test. Unlabelled nodes (-1) are in no mask.
    Vectorized: one permutation, one stable sort, so it stays cheap at millions of nodes.
    """
    if train_per_class < 0 or val_per_class < 0:
        raise DataError(f"per-class split sizes must be >= 0, got {train_per_class}/{val_per_class}")
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    n = labels.shape[0]
    labelled = np.flatnonzero(labels >= 0)
    perm = rng.permutation(labelled)
    cls = labels[perm]
    order = np.argsort(cls, kind="stable")
    nodes, cls = perm[order], cls[order]
    counts = np.bincount(cls, minlength=num_classes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(nodes.size) - starts[cls]
    masks = [np.zeros(n, dtype=bool) for _ in range(3)]
    masks[0][nodes[rank < train_per_class]] = True
    masks[1][nodes[(rank >= train_per_class) & (rank < train_per_class + val_per_class)]] = True
    masks[2][nodes[rank >= train_per_class + val_per_class]] = True
    return masks[0], masks[1], masks[2]


def fraction_split(
    labels: np.ndarray, train_frac: float, val_frac: float, seed: int | np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random fractions of the labelled nodes for train and val, the rest test."""
    if not (0 <= train_frac and 0 <= val_frac and train_frac + val_frac <= 1):
        raise DataError(f"split fractions must be >= 0 and sum to <= 1, got {train_frac}/{val_frac}")
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    perm = rng.permutation(np.flatnonzero(labels >= 0))
    n_train = int(round(train_frac * perm.size))
    n_val = int(round(val_frac * perm.size))
    masks = [np.zeros(labels.shape[0], dtype=bool) for _ in range(3)]
    masks[0][perm[:n_train]] = True
    masks[1][perm[n_train:n_train + n_val]] = True
    masks[2][perm[n_train + n_val:]] = True
    return masks[0], masks[1], masks[2]
