"""The fused GAT kernel (ops.attention) equals AE then the weighted GA, in values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from ops import attention, dense, models, sparse


def _block(rows=12, cols=20, density=0.3, pad=0, seed=0):
    rng = np.random.default_rng(seed)
    a = sp.random(rows, cols, density=density, random_state=rng, format="csr", dtype=np.float32)
    a = a + sp.eye(rows, cols, dtype=np.float32, format="csr")  # every row has an entry
    a.data[:] = 1.0
    a.eliminate_zeros()
    return sparse.Adjacency.from_scipy(a, nnz_pad=a.nnz + pad, row_gids=np.arange(rows) + 7,
                                       col_gids=np.arange(cols)).to_device()


def _unfused(adj, s_src, s_dst, z, rate, seed):
    alpha = dense.apply_edge(s_src, s_dst, adj, negative_slope=0.2, rate=rate, seed=seed)
    return sparse.gather_weighted(adj, alpha, z)


@pytest.mark.parametrize("rate,pad", [(0.0, 0), (0.4, 5)])
def test_fused_attention_equals_ae_then_weighted_gather(rate, pad):
    adj = _block(pad=pad)
    heads, f = 3, 4
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    s_src = jax.random.normal(ks[0], (20, heads))
    s_dst = jax.random.normal(ks[1], (12, heads))
    z = jax.random.normal(ks[2], (20, heads, f))
    w = jax.random.normal(ks[3], (12, heads, f))
    seed = jnp.uint32(1234)

    def out_and_grads(fn):
        def f(a, b, c):
            return jnp.sum(jnp.sin(fn(adj, a, b, c, rate, seed)) * w)
        return jax.jit(lambda a, b, c: (fn(adj, a, b, c, rate, seed), jax.grad(f, argnums=(0, 1, 2))(a, b, c)))

    fused = lambda adj, a, b, c, rate, seed: attention.attend_and_gather(adj, a, b, c, rate=rate, seed=seed)
    out1, g1 = out_and_grads(fused)(s_src, s_dst, z)
    out2, g2 = out_and_grads(_unfused)(s_src, s_dst, z)
    np.testing.assert_allclose(out1, out2, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g2):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gat_forward_and_gradients_equal_the_stage_by_stage_path():
    adj = _block(rows=20, cols=20, density=0.2)
    model = models.gat(6, 4, 3, heads=2, dropout=0.5)
    params = model.init(jax.random.PRNGKey(1))
    x = jax.random.normal(jax.random.PRNGKey(2), (20, 6))
    seeds = jnp.arange(len(model.stages), dtype=jnp.uint32) + 11

    def staged(p):
        state = {"h": x}
        for st in model.stages[:-1]:
            state = {**state, **models.run_stage(st, p, state, adj, seeds[st.index])}
        return models.logits_of(model.stages[-1], p, state["h"])

    fused = lambda p: models.forward(model, p, adj, x, seeds)
    (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(f(p)))))(params)
                          for f in (fused, staged))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_fused_attention_falls_back_to_the_row_max_when_the_bound_underflows():
    adj = _block()
    heads, f = 2, 3
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    s_src = jax.random.normal(ks[0], (20, heads)).at[19].set(500.0)   # far above every other score
    s_dst = jax.random.normal(ks[1], (12, heads))
    z = jax.random.normal(ks[2], (20, heads, f))
    seed = jnp.uint32(9)
    for rate in (0.0, 0.3):
        got = attention.attend_and_gather(adj, s_src, s_dst, z, rate=rate, seed=seed)
        want = _unfused(adj, s_src, s_dst, z, rate, seed)
        assert bool(jnp.all(jnp.isfinite(got)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
