"""Kernel tests: GA, AV and AE and their gradients against dense reference formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from ops import dense, models, sparse
from pipelines.data.graph import clean_adjacency, gcn_normalize

jax.config.update("jax_enable_x64", False)


def small_graph(n=40, m=120, seed=0):
    rng = np.random.default_rng(seed)
    a = clean_adjacency(rng.integers(0, n, m), rng.integers(0, n, m), n)
    return gcn_normalize(a)


def rect_block(r=12, c=30, density=0.2, seed=1):
    rng = np.random.default_rng(seed)
    a = sp.random(r, c, density=density, random_state=seed, format="csr", dtype=np.float32)
    a.data[:] = rng.uniform(0.1, 1.0, a.nnz).astype(np.float32)
    return a


@pytest.mark.parametrize("pad", [False, True])
def test_gather_and_grad_match_dense(pad):
    a = rect_block()
    adj = Adjacency = sparse.Adjacency.from_scipy(a, nnz_pad=a.nnz + 7 if pad else None,
                                                  rows_pad=15 if pad else None, cols_pad=33 if pad else None)
    adj = adj.to_device()
    dense_a = np.zeros(adj.shape, np.float32)
    dense_a[: a.shape[0], : a.shape[1]] = a.toarray()
    x = jax.random.normal(jax.random.PRNGKey(0), (adj.shape[1], 5))
    g = jax.random.normal(jax.random.PRNGKey(1), (adj.shape[0], 5))
    y = sparse.gather(adj, x)
    np.testing.assert_allclose(y, dense_a @ x, rtol=1e-5, atol=1e-5)
    _, vjp = jax.vjp(lambda x: sparse.gather(adj, x), x)
    np.testing.assert_allclose(vjp(g)[0], dense_a.T @ g, rtol=1e-4, atol=1e-5)


def test_gather_weighted_values_and_grads_match_dense():
    a = rect_block(10, 20, 0.3)
    adj = sparse.Adjacency.from_scipy(a).to_device()
    heads, f = 3, 4
    key = jax.random.PRNGKey(2)
    vals = jax.random.uniform(key, (adj.nnz, heads))
    x = jax.random.normal(jax.random.PRNGKey(3), (20, heads, f))
    rows = np.asarray(adj.row_ids)
    cols = np.asarray(adj.indices)

    def dense_ref(vals, x):
        out = []
        for h in range(heads):
            m = jnp.zeros((10, 20)).at[rows, cols].add(vals[:, h])
            out.append(m @ x[:, h, :])
        return jnp.stack(out, 1)

    np.testing.assert_allclose(sparse.gather_weighted(adj, vals, x), dense_ref(vals, x), rtol=1e-5, atol=1e-5)
    g1 = jax.grad(lambda v, x: jnp.sum(jnp.sin(sparse.gather_weighted(adj, v, x))), argnums=(0, 1))(vals, x)
    g2 = jax.grad(lambda v, x: jnp.sum(jnp.sin(dense_ref(v, x))), argnums=(0, 1))(vals, x)
    for a_, b_ in zip(g1, g2):
        np.testing.assert_allclose(a_, b_, rtol=1e-4, atol=1e-5)


def test_av_gradient_matches_dense_formula():
    key = jax.random.PRNGKey(4)
    x = jax.random.normal(key, (9, 6))
    params = {"w": jax.random.normal(jax.random.PRNGKey(5), (6, 4)), "b_out": jnp.ones(4) * 0.1,
              "b_in": jnp.ones(6) * -0.2}
    f = lambda p, x: jnp.sum(dense.apply_vertex(p, x, act_in="relu", act_out="elu")["z"] ** 2)
    gp, gx = jax.grad(f, argnums=(0, 1))(params, x)
    # dense reference by hand: z = elu(relu(x + b_in) W + b_out); L = sum z^2
    xin = x + params["b_in"]
    r = jnp.maximum(xin, 0)
    pre = r @ params["w"] + params["b_out"]
    z = jax.nn.elu(pre)
    dpre = 2 * z * jnp.where(pre > 0, 1.0, jnp.exp(pre))
    np.testing.assert_allclose(gp["w"], r.T @ dpre, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gp["b_out"], dpre.sum(0), rtol=1e-4, atol=1e-5)
    dr = dpre @ params["w"].T
    np.testing.assert_allclose(gx, dr * (xin > 0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gp["b_in"], (dr * (xin > 0)).sum(0), rtol=1e-4, atol=1e-5)


def test_ae_attention_and_grad_match_dense_softmax():
    a = small_graph(15, 40)
    a.data[:] = 1.0
    adj = sparse.Adjacency.from_scipy(a).to_device()
    heads = 2
    s_src = jax.random.normal(jax.random.PRNGKey(6), (15, heads))
    s_dst = jax.random.normal(jax.random.PRNGKey(7), (15, heads))
    mask = a.toarray() > 0

    def dense_alpha(s_src, s_dst):
        e = jax.nn.leaky_relu(s_dst[:, None, :] + s_src[None, :, :], 0.2)  # [dst, src, H]
        e = jnp.where(mask[:, :, None], e, -jnp.inf)
        return jax.nn.softmax(e, axis=1)

    alpha = dense.apply_edge(s_src, s_dst, adj)
    ref = dense_alpha(s_src, s_dst)[np.asarray(adj.row_ids), np.asarray(adj.indices)]
    np.testing.assert_allclose(alpha, ref, rtol=1e-5, atol=1e-6)
    w = jax.random.normal(jax.random.PRNGKey(8), alpha.shape)
    g1 = jax.grad(lambda s, d: jnp.sum(dense.apply_edge(s, d, adj) * w), argnums=(0, 1))(s_src, s_dst)
    w_dense = jnp.zeros((15, 15, heads)).at[np.asarray(adj.row_ids), np.asarray(adj.indices)].set(w)
    g2 = jax.grad(lambda s, d: jnp.sum(jnp.where(mask[:, :, None], dense_alpha(s, d), 0) * w_dense),
                  argnums=(0, 1))(s_src, s_dst)
    for a_, b_ in zip(g1, g2):
        np.testing.assert_allclose(a_, b_, rtol=1e-4, atol=1e-5)


def test_ae_ignores_padding_entries():
    a = small_graph(10, 20)
    a.data[:] = 1.0
    plain = sparse.Adjacency.from_scipy(a).to_device()
    padded = sparse.Adjacency.from_scipy(a, nnz_pad=a.nnz + 5).to_device()
    s = jax.random.normal(jax.random.PRNGKey(9), (10, 1))
    np.testing.assert_allclose(dense.apply_edge(s, s, padded)[: a.nnz], dense.apply_edge(s, s, plain), atol=1e-6)
    assert float(jnp.abs(dense.apply_edge(s, s, padded)[a.nnz:]).sum()) == 0.0


@pytest.mark.parametrize("order", ["ga-first", "av-first"])
def test_gcn_layer_equals_dense_formula(order):
    a = small_graph()
    n = a.shape[0]
    model = models.gcn(6, (), 3, dropout=0.0, order=order)  # one layer: logits = Â X W + b
    params = model.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 6))
    adj = sparse.Adjacency.from_scipy(a).to_device()
    logits = models.forward(model, params, adj, x)
    w = params["av0"]["w"]
    ref = a.toarray() @ np.asarray(x) @ np.asarray(w)
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-5)


def test_auto_order_aggregates_on_narrow_side():
    m = models.gcn(1433, (16,), 7)
    assert [s.kind for s in m.stages] == ["AV", "GA", "AV", "GA", "LOSS"]
    m = models.gcn(128, (256,), 40)
    assert [s.kind for s in m.stages] == ["GA", "AV", "AV", "GA", "LOSS"]
    m = models.gcn(128, (256,), 40, order="ga-first")
    assert [s.kind for s in m.stages] == ["GA", "AV", "GA", "AV", "LOSS"]
    # a square hidden layer after an AV-first one: its bias and σ are pending, so it stays AV-first (a GA first
    # would aggregate the raw ÂHW and apply σ after the second aggregation)
    m = models.gcn(32, (16, 16), 8)
    assert [s.kind for s in m.stages] == ["AV", "GA", "AV", "GA", "AV", "GA", "LOSS"]


def test_dropout_masks_depend_only_on_global_ids():
    x = jnp.ones((6, 50))
    rows = jnp.arange(100, 106, dtype=jnp.int32)
    full = dense.dropout(jnp.ones((200, 50)), 0.5, jnp.uint32(7), jnp.arange(200, dtype=jnp.int32))
    part = dense.dropout(x, 0.5, jnp.uint32(7), rows)
    np.testing.assert_array_equal(part, full[100:106])
    kept = float((full > 0).mean())
    assert 0.45 < kept < 0.55
    assert float(full.max()) == pytest.approx(2.0)


def _sage_dense(a_hat):
    """Dense GraphSAGE operators of a graph given by Â's structure: S = I, P = D^-1 A (self-loops removed)."""
    adj = (a_hat.toarray() != 0).astype(np.float64)
    np.fill_diagonal(adj, 0.0)
    deg = adj.sum(1, keepdims=True)
    return adj / np.maximum(deg, 1.0)


@pytest.mark.parametrize("pad", [False, True])
def test_sage_gather_and_grad_match_dense_mean(pad):
    a = small_graph(30, 70)
    n = a.shape[0]
    p_dense = _sage_dense(a)
    adj = sparse.Adjacency.from_scipy(a, nnz_pad=a.nnz + 9 if pad else None, rows_pad=n + 3 if pad else None,
                                      cols_pad=n + 2 if pad else None).to_device()
    x = jax.random.normal(jax.random.PRNGKey(10), (adj.shape[1], 4))
    xs = np.asarray(x[:n], np.float64)
    concat = sparse.gather_mean(adj, x, "mean-concat")[:n]
    np.testing.assert_allclose(concat, np.concatenate([xs, p_dense @ xs], 1), rtol=1e-5, atol=1e-5)
    add = sparse.gather_mean(adj, x, "mean-add")[:n]
    np.testing.assert_allclose(add, xs[:, :2] + p_dense @ xs[:, 2:], rtol=1e-5, atol=1e-5)
    for agg, width in (("mean-concat", 8), ("mean-add", 2)):
        g = jax.random.normal(jax.random.PRNGKey(11), (adj.shape[0], width)).at[n:].set(0.0)
        _, vjp = jax.vjp(lambda x: sparse.gather_mean(adj, x, agg), x)
        gs = np.asarray(g[:n], np.float64)
        ref = gs[:, :4] + p_dense.T @ gs[:, 4:] if agg == "mean-concat" else np.concatenate([gs, p_dense.T @ gs], 1)
        np.testing.assert_allclose(vjp(g)[0][:n], ref, rtol=1e-4, atol=1e-5)
        # the graph server's ∇GA (no forward inputs) is the same VJP
        np.testing.assert_allclose(sparse.gather_mean_transpose(adj, g, agg), vjp(g)[0], rtol=1e-5, atol=1e-6)


def test_sage_mean_ignores_stored_values_and_isolated_vertices_get_zero():
    a = gcn_normalize(sp.csr_matrix((3, 3), dtype=np.float32))  # three isolated vertices: self-loops only
    adj = sparse.Adjacency.from_scipy(a).to_device()
    x = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_allclose(sparse.gather_mean(adj, x, "mean-concat"), np.concatenate([x, np.zeros((3, 2))], 1))
    b = small_graph(12, 30)
    b2 = b.copy()
    b2.data[:] = 7.0  # any nonzero Â: the mean comes from the structure
    x = jax.random.normal(jax.random.PRNGKey(12), (12, 3))
    np.testing.assert_allclose(sparse.gather_mean(sparse.Adjacency.from_scipy(b).to_device(), x, "mean-concat"),
                               sparse.gather_mean(sparse.Adjacency.from_scipy(b2).to_device(), x, "mean-concat"),
                               rtol=1e-6)


@pytest.mark.parametrize("order", ["ga-first", "av-first"])
def test_sage_model_equals_dense_formula(order):
    """Two layers: logits = (relu(X W1s + P X W1n + b1)) W2s + P (...) W2n + b2 (Hamilton et al., mean aggregator)."""
    a = small_graph()
    n = a.shape[0]
    model = models.sage(6, (5,), 3, dropout=0.0, order=order)
    assert [s.aggregator for s in model.stages if s.kind == "GA"] == (
        ["mean-concat"] * 2 if order == "ga-first" else ["mean-add"] * 2)
    params = model.init(jax.random.PRNGKey(0))
    params = jax.tree_util.tree_map(lambda v: v + 0.05, params)  # nonzero biases
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 6))
    adj = sparse.Adjacency.from_scipy(a).to_device()
    logits = models.forward(model, params, adj, x)
    p_dense = _sage_dense(a)

    def layer(h, w, b, f_in):
        w = np.asarray(w, np.float64)
        if order == "ga-first":
            w_self, w_neigh = w[:f_in], w[f_in:]
        else:
            half = w.shape[1] // 2
            w_self, w_neigh = w[:, :half], w[:, half:]
        return h @ w_self + p_dense @ h @ w_neigh + np.asarray(b, np.float64)

    if order == "ga-first":
        b1, b2 = params["av0"]["b_out"], params["av1"]["b_out"]
    else:
        b1, b2 = params["av1"]["b_in"], params["loss"]["b_in"]
    h1 = np.maximum(layer(np.asarray(x, np.float64), params["av0"]["w"], b1, 6), 0.0)
    ref = layer(h1, params["av1"]["w"], b2, 5)
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)
    # the spec a tensor worker receives rebuilds the same stages
    spec = {"name": "sage", "in_dim": 6, "hidden": [5], "num_classes": 3, "dropout": 0.0, "order": order}
    assert models.from_spec(spec).stages == model.stages


def test_sage_auto_order_and_pending_bias():
    m = models.sage(1433, (64,), 7)
    assert [s.kind for s in m.stages] == ["AV", "GA", "AV", "GA", "LOSS"]
    # wide hidden after a narrow-side AV-first layer: the bias and σ are pending, so the layer stays AV-first
    m = models.sage(100, (16, 64), 7)
    assert [s.kind for s in m.stages] == ["AV", "GA", "AV", "GA", "AV", "GA", "LOSS"]
    m = models.sage(16, (64,), 7)
    assert [s.kind for s in m.stages] == ["GA", "AV", "AV", "GA", "LOSS"]


@pytest.mark.parametrize("name", ["gcn-ga-first", "gat"])
def test_row_blocked_av_chain_and_constant_prefix_equal_the_plain_step(name, monkeypatch):
    """The whole-graph forward's blocked AV chains (many blocks and a remainder) and its precomputed Â·X give
    the loss and gradients of running every stage at full size, dropout on."""
    a = small_graph(n=45, m=150)
    n = a.shape[0]
    if name == "gat":
        model = models.gat(6, 4, 3, heads=2)
    else:
        model = models.gcn(6, (8, 5), 3, order=name[4:])
    adj = sparse.Adjacency.from_scipy(a).to_device()
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 6))
    labels = jnp.arange(n) % 3
    params = model.init(jax.random.PRNGKey(0))
    seeds = jnp.arange(len(model.stages), dtype=jnp.uint32) + 11

    def loss_grads(inputs, seeds):
        def loss(p):
            s, c = dense.softmax_cross_entropy(models.forward(model, p, adj, inputs, seeds), labels,
                                               jnp.ones(n, bool))
            return s / c
        return jax.jit(jax.value_and_grad(loss))(params)  # one compile, not one per op

    monkeypatch.setattr(dense, "ROW_BLOCK", 8)
    # Training drops the features out before the first GA (Â·dropout(X)), so its Â·X is evaluation's alone.
    pre_train = models.constant_prefix(model, adj, x, train=True)
    pre_eval = models.constant_prefix(model, adj, x)
    assert not isinstance(pre_train, models.Aggregated)
    assert isinstance(pre_eval, models.Aggregated) == (name == "gcn-ga-first")
    got = [loss_grads(pre_train, seeds), loss_grads(pre_eval, None)]
    monkeypatch.setattr(dense, "row_blocked", lambda fn, p, h, g, s, **_: fn(p, h, g, s))
    for (g_loss, g_grads), sd in zip(got, [seeds, None]):
        want = loss_grads(x, sd)
        np.testing.assert_allclose(g_loss, want[0], rtol=1e-6)
        for k, v in jax.tree_util.tree_leaves_with_path(want[1]):
            np.testing.assert_allclose(dict(jax.tree_util.tree_leaves_with_path(g_grads))[k], v, rtol=1e-4,
                                       atol=1e-5)


def test_ga_first_drops_out_before_the_aggregation():
    """A GA-first GCN computes Kipf's Â·dropout(H)·W: with every stage drawing from one seed it is the AV-first
    model's function (Â·(dropout(H)·W)), masks keyed by vertex id, in the loss and the weight gradients."""
    a = small_graph(n=40, m=140)
    n = a.shape[0]
    adj = sparse.Adjacency.from_scipy(a).to_device()
    x = jax.random.normal(jax.random.PRNGKey(2), (n, 6))
    labels = jnp.arange(n) % 3
    w = {"av0": jax.random.normal(jax.random.PRNGKey(3), (6, 8)), "av1": jax.random.normal(jax.random.PRNGKey(4),
                                                                                           (8, 3))}
    out = []
    for order in ("ga-first", "av-first"):
        model = models.gcn(6, 8, 3, order=order, dropout=0.5)
        ga = [s for s in model.stages if s.kind == "GA"]
        assert [s.rate for s in ga] == ([0.5, 0.5] if order == "ga-first" else [0.0, 0.0])
        params = model.init(jax.random.PRNGKey(0))   # biases start at zero in both orders
        params = {k: {**v, "w": w[k]} if "w" in v else v for k, v in params.items()}
        seeds = jnp.full(len(model.stages), 7, jnp.uint32)

        def loss(p):
            s, c = dense.softmax_cross_entropy(models.forward(model, p, adj, x, seeds), labels, jnp.ones(n, bool))
            return s / c
        val, grads = jax.value_and_grad(loss)(params)
        out.append((val, {k: grads[k]["w"] for k in w}))
        assert not np.isclose(float(val), float(loss_no_dropout(model, params, adj, x, labels)))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5)
    for k in w:
        np.testing.assert_allclose(out[0][1][k], out[1][1][k], rtol=1e-4, atol=1e-6)


def loss_no_dropout(model, params, adj, x, labels):
    s, c = dense.softmax_cross_entropy(models.forward(model, params, adj, x, None), labels,
                                       jnp.ones(x.shape[0], bool))
    return s / c


def test_kernels_compile_without_ynnpack_reductions():
    """ops.xla.jit keeps YNNPACK to dots: a reduction over a short minor axis (GAT's per-row softmax term) is
    XLA's own loop, where the default hands it to YNNPACK (25x slower there), and the values are the same."""
    from ops import xla

    if xla.compiler_options() is None:
        pytest.skip("this jaxlib does not take the YNNPACK fusion option")

    def row_term(g, out):
        return jnp.sum(g * out, axis=-1)

    rng = np.random.default_rng(0)
    g, out = (jnp.asarray(rng.standard_normal((20_000, 1, 40)), jnp.float32) for _ in range(2))
    ours = xla.jit(row_term).lower(g, out).compile().as_text()
    default = jax.jit(row_term).lower(g, out).compile().as_text()
    assert "__ynn_fusion" not in ours
    if "__ynn_fusion" not in default:
        pytest.skip("XLA's default here does not fuse this reduction into YNNPACK either")
    np.testing.assert_allclose(xla.jit(row_term)(g, out), jax.jit(row_term)(g, out), rtol=1e-5, atol=1e-5)
