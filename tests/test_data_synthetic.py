"""Synthetic generators: exact sizes, determinism under a seed, the planted signal, and the specs."""
import time

import numpy as np
import pytest

from pipelines.data import DataError, load_dataset, planted_partition, rmat
from pipelines.data.graph import row_normalize


def _same(a, b):
    return ((a.adj != b.adj).nnz == 0 and np.array_equal(a.features, b.features)
            and np.array_equal(a.labels, b.labels) and np.array_equal(a.train_mask, b.train_mask)
            and np.array_equal(a.val_mask, b.val_mask) and np.array_equal(a.test_mask, b.test_mask))


def test_rmat_sizes_and_determinism():
    g = rmat(scale=10, num_edges=5000, seed=7, feature_dim=6, num_classes=3)
    assert (g.num_nodes, g.num_edges, g.feature_dim, g.num_classes) == (1024, 10000, 6, 3)
    assert _same(g, rmat(scale=10, num_edges=5000, seed=7, feature_dim=6, num_classes=3))
    assert not _same(g, rmat(scale=10, num_edges=5000, seed=8, feature_dim=6, num_classes=3))
    deg = g.adj.getnnz(axis=1)
    assert deg.max() > 10 * deg.mean()  # skewed: R-MAT hubs
    odd = rmat(num_nodes=1000, num_edges=3000, seed=1)
    assert (odd.num_nodes, odd.num_edges) == (1000, 6000)
    assert rmat(scale=6, seed=0).num_edges == 2 * 16 * 64  # Graph500 edge factor by default


def test_rmat_large_is_fast():
    t = time.perf_counter()
    g = rmat(scale=18, num_edges=2_000_000, feature_dim=4, seed=0)
    assert g.num_edges == 4_000_000
    assert time.perf_counter() - t < 20


def test_planted_partition_defaults_and_signal():
    g = planted_partition()
    assert (g.num_nodes, g.num_classes, g.feature_dim) == (3000, 7, 128)
    assert g.num_edges == 2 * 12000
    assert (g.train_mask.sum(), g.val_mask.sum()) == (140, 210)
    assert _same(g, planted_partition(seed=0)) and not _same(g, planted_partition(seed=1))
    coo = g.adj.tocoo()
    homophily = (g.labels[coo.row] == g.labels[coo.col]).mean()
    assert 0.5 < homophily < 0.6
    assert set(np.unique(g.features)) == {0.0, 1.0} and (g.features.sum(1) > 0).all()
    # A nearest-class-mean classifier fit on the 140 training nodes is weak on the (row-normalized) words of
    # a node and clearly better after one round of neighbour averaging: the gap a GCN exploits over an MLP.
    def accuracy(x):
        means = np.stack([x[g.train_mask & (g.labels == c)].mean(0) for c in range(7)])
        guess = ((x[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
        return (guess == g.labels)[g.test_mask].mean()

    x = row_normalize(g.features)
    smooth = (g.adj @ x + x) / (g.adj.getnnz(axis=1)[:, None] + 1)
    raw = accuracy(x)
    assert 0.3 < raw < 0.65 and accuracy(smooth) > raw + 0.15


def test_planted_partition_scales():
    t = time.perf_counter()
    g = planted_partition(num_nodes=200_000, avg_degree=20, feature_dim=8, seed=0)
    assert (g.num_nodes, g.num_edges) == (200_000, 4_000_000)
    assert time.perf_counter() - t < 20


def test_specs_and_bad_arguments():
    g = load_dataset("synthetic:planted?nodes=400&classes=4&degree=6&features=16&noise=0.5&train=5&val=5", seed=2)
    assert (g.num_nodes, g.num_classes, g.feature_dim, g.num_edges) == (400, 4, 16, 2400)
    assert g.train_mask.sum() == 20
    assert _same(g, load_dataset("synthetic:planted?nodes=400&classes=4&degree=6&features=16&noise=0.5"
                                 "&train=5&val=5&seed=2"))
    r = load_dataset("synthetic:rmat?scale=9&edges=2000&classes=2&seed=4")
    assert (r.num_nodes, r.num_edges, r.num_classes) == (512, 4000, 2)
    assert load_dataset(None).summary() == planted_partition().summary()
    with pytest.raises(DataError, match="do not fit"):
        planted_partition(num_nodes=10, avg_degree=20)
    with pytest.raises(DataError, match=r"feature_noise in \[0, 1\]"):
        planted_partition(feature_noise=1.5)
    with pytest.raises(DataError, match="probabilities"):
        rmat(scale=4, a=0.9, b=0.2)
