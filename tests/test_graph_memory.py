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


def test_host_buffers_are_aligned_and_the_device_uses_them_in_place():
    from ops import host, xla
    for shape, dtype in (((1000, 33), np.float32), (7, np.int32), ((0, 4), np.float32)):
        a = host.host_zeros(shape, dtype)
        assert a.shape == (shape if isinstance(shape, tuple) else (shape,)) and a.dtype == dtype and not a.any()
        assert (a.size == 0 or a.ctypes.data % host.ALIGNMENT == 0) and a.flags.c_contiguous
    a = host.host_empty((4096, 16))
    a[:] = 1.5
    assert host.aligned(a) is a
    d = xla.to_device(a)
    assert np.asarray(d).ctypes.data == a.ctypes.data   # no copy on the CPU backend
    odd = np.ones(4097, np.float64)[1:]                  # 8 bytes past an allocation: not 64-byte aligned
    b = host.aligned(odd, np.float32)
    assert b.dtype == np.float32 and b.ctypes.data % host.ALIGNMENT == 0 and np.array_equal(b, odd)


def test_an_adjacency_block_is_held_once_on_the_device(skewed):
    a = G.gcn_normalize(skewed.adj)
    for blk in (sparse.Adjacency.from_scipy(a, symmetric=True),
                sparse.Adjacency.from_scipy(a[:100], nnz_pad=a[:100].nnz + 5, rows_pad=128)):
        dev = blk.to_device()
        for k in ("data", "indices", "indptr"):
            assert np.asarray(getattr(dev, k)).ctypes.data == getattr(blk, k).ctypes.data, k


@pytest.mark.parametrize("model,order", [("gcn", "auto"), ("gcn", "ga-first"), ("sage", "auto")])
def test_a_staged_partitioned_evaluation_equals_the_whole_graph_one(skewed, model, order):
    from ops import models
    from ops.spec import ModelSpec
    from pipelines.engine.partition import build_plan
    cfg = TrainConfig(model=model, order=order, hidden=8).resolved()
    m = ModelSpec.for_graph(cfg, skewed).build()
    params = m.init(jax.random.PRNGKey(1))
    x, a = epochs.model_inputs(cfg, skewed)
    whole = sparse.Adjacency.from_scipy(a, symmetric=True).to_device()
    want = models.forward(m, params, whole, jnp.asarray(x), None)
    plan = build_plan(a, 3, 2, "hash", whole=True, interval_blocks=False)
    parts = sparse.Partitioned.from_blocks([pp.block.to_device() for pp in plan.partitions], skewed.num_nodes)
    for adj in (whole, parts):
        xin = models.constant_prefix(m, adj, jnp.asarray(x))
        np.testing.assert_allclose(models.forward_staged(m, params, adj, xin), want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(models.forward(m, params, parts, jnp.asarray(x), None), want, rtol=2e-5, atol=2e-6)
    gat = ModelSpec.for_graph(TrainConfig(model="gat").resolved(), skewed).build()
    with pytest.raises(ValueError, match="staged forward runs"):
        models.forward_staged(gat, gat.init(jax.random.PRNGKey(0)), whole, jnp.asarray(x))


def test_huge_page_environ_decides_when_a_reexec_helps():
    from ops.host import HUGE_PAGE_TUNABLE, huge_page_environ

    madvise = "always [madvise] never\n"
    env = huge_page_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}, madvise, "glibc 2.36")
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}" and env["PATH"] == "/bin"
    assert huge_page_environ(env, madvise, "glibc 2.36") is None            # never twice
    assert huge_page_environ({}, "[always] madvise never", "glibc 2.36") is None   # nothing to gain
    assert huge_page_environ({}, "always madvise [never]", "glibc 2.36") is None
    assert huge_page_environ({}, None, "glibc 2.36") is None                  # no THP in this kernel
    assert huge_page_environ({}, madvise, "glibc 2.31") is None               # no such tunable yet
    assert huge_page_environ({}, madvise, "") is None                         # not glibc
    assert huge_page_environ({"DORYLUS_HUGE_PAGES": "0"}, madvise, "glibc 2.36") is None


def test_an_entry_point_reexecutes_itself_once_with_the_tunable():
    import json
    import os
    import subprocess
    import sys

    from ops.host import _THP_MODE, huge_page_environ

    try:
        mode = open(_THP_MODE).read()
    except OSError:
        mode = None
    want = huge_page_environ(os.environ, mode, os.confstr("CS_GNU_LIBC_VERSION") or "")
    code = ("import json, os, sys; from ops.host import reexec_with_huge_pages as r; r(); "
            "print(json.dumps([os.environ.get('GLIBC_TUNABLES', ''), sys.argv[1:]]))")
    out = subprocess.run([sys.executable, "-c", code, "a", "b"], capture_output=True, text=True, check=True)
    tunables, argv = json.loads(out.stdout)
    assert argv == ["a", "b"]   # the same command line after the exec
    if want is None:
        assert tunables == os.environ.get("GLIBC_TUNABLES", "")
    else:
        assert tunables == want["GLIBC_TUNABLES"]
