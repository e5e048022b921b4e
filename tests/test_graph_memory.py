"""The lean adjacency: Â built without scipy temporaries, no transpose for symmetric Â, hub order for locality;
each gives the numbers of the plain construction (up to summation order)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import sparse
from pipelines import epochs
from pipelines.config import TrainConfig
from pipelines.data import graph as G
from pipelines.data.synthetic import rmat
from pipelines.train import train


@pytest.fixture(scope="module")
def skewed():
    # R-MAT: skewed degrees (hub order applies), isolated vertices (empty rows)
    return rmat(9, num_edges=3000, feature_dim=12, num_classes=3, seed=3, train_per_class=10, val_per_class=10)


def test_lean_normalization_equals_scipy_bit_for_bit(skewed, monkeypatch):
    want = G._gcn_normalize_scipy(skewed.adj)
    monkeypatch.setattr(G, "ENTRY_CHUNK", 97)   # many chunks, rows split nowhere
    got = G.gcn_normalize(skewed.adj)
    assert got.indices.dtype == np.int32 and got.indptr.dtype == np.int32
    for k in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k))
    weighted = skewed.adj * 2.0   # not binary: the scipy path, D from the weights
    assert not G._binary_without_loops(weighted)
    dense = weighted.toarray() + np.eye(skewed.num_nodes)
    dinv = 1 / np.sqrt(dense.sum(1))
    np.testing.assert_allclose(G.gcn_normalize(weighted).toarray(), dinv[:, None] * dense * dinv, rtol=1e-6)


def test_hub_order_and_permutation(skewed, monkeypatch):
    perm = G.locality_order(skewed.adj)
    deg = np.diff(skewed.adj.indptr)
    assert perm is not None and np.all(np.diff(deg[perm]) <= 0)
    flat = G.clean_adjacency(np.arange(100), (np.arange(100) + 1) % 100, 100)   # a ring: uniform degrees
    assert G.locality_order(flat) is None
    a = G.gcn_normalize(skewed.adj)
    monkeypatch.setattr(G, "ENTRY_CHUNK", 50)
    got = G.permute_symmetric(a, perm)
    want = a[perm][:, perm].tocsr()
    want.sort_indices()
    assert got.has_sorted_indices
    for k in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k))


def test_symmetric_adjacency_has_no_transpose_and_the_same_gradients(skewed):
    a = G.gcn_normalize(skewed.adj)
    full = sparse.Adjacency.from_scipy(a).to_device()
    lean = sparse.Adjacency.from_scipy(a, symmetric=True).to_device()
    assert lean.t_perm is None and lean._row_ids is None
    assert lean.nbytes <= 8 * a.nnz + 12 * (a.shape[0] + 1)          # indices + values + indptr + ids
    np.testing.assert_array_equal(np.asarray(lean.row_ids), np.asarray(full.row_ids))
    x = jax.random.normal(jax.random.PRNGKey(0), (a.shape[0], 5))
    for fn in (lambda adj, h: sparse.gather(adj, h),
               lambda adj, h: sparse.gather_mean(adj, jnp.concatenate([h, h], 1), "mean-add")):
        f_full, g_full = jax.value_and_grad(lambda h: jnp.sum(jnp.sin(fn(full, h))))(x)
        f_lean, g_lean = jax.value_and_grad(lambda h: jnp.sum(jnp.sin(fn(lean, h))))(x)
        np.testing.assert_allclose(f_lean, f_full, rtol=1e-5)
        np.testing.assert_allclose(g_lean, g_full, rtol=1e-5, atol=1e-6)
    g = jax.random.normal(jax.random.PRNGKey(1), (a.shape[0], 10))
    for agg in ("mean-add", "mean-concat"):
        np.testing.assert_allclose(sparse.gather_mean_transpose(lean, g, agg), sparse.gather_mean_transpose(full, g, agg),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_hub_ordered_training_equals_the_plain_order(skewed, model, monkeypatch):
    cfg = TrainConfig(model=model, epochs=4, patience=0, hidden=8, **({"heads": 2} if model == "gat" else {})).resolved()
    ordered = train(cfg, skewed)
    monkeypatch.setattr(epochs, "locality_order", lambda adj: None)
    plain = train(cfg, skewed)
    for r1, r2 in zip(ordered.history, plain.history):
        assert abs(r1["loss"] - r2["loss"]) <= 1e-5 * abs(r2["loss"])
        assert r1["val_acc"] == r2["val_acc"]
    for stage, p in plain.params.items():
        for name, w in p.items():
            np.testing.assert_allclose(ordered.params[stage][name], w, rtol=1e-4, atol=1e-6)
