"""GAT's AE and weighted GA fused: edge scores, edge softmax, dropout and the gather in one custom VJP."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ops import dense
from ops.sparse import Adjacency

# Every per-edge float lives only inside one chunk of CHUNK edges. The forward makes one pass over the chunks
# (the softmax's sums and the gather of e-weighted z together, see `_forward`); the backward one, recomputing
# α from the scores and the saved per-row max and sum. So the step holds vertex-sized arrays (z, the output,
# the scores), [CHUNK, heads, F] transients and, during each pass, the dropout's [E, heads] keep-mask (one
# byte each, see `_keep`), never a float [E, heads] or [E, heads, F] array: the separate AE
# and GA stages keep α, its logits, softmax terms and dropout mask for the backward, and the BCSR gather and
# the SDDMM materialize [E, F] per head. The softmax's row term Σ_e α_e ∂α_e equals <∂out[r], out[r]>.
CHUNK = 1 << 15


class _Edges(NamedTuple):
    """The block's entries padded to whole chunks: [chunks, CHUNK] rows, columns, validity and dropout keys."""

    rows: jax.Array
    cols: jax.Array
    valid: jax.Array
    keys: jax.Array


def _edges(adj: Adjacency) -> _Edges:
    e = adj.nnz
    chunk = min(CHUNK, max(e, 1))
    n = -(-e // chunk) * chunk

    def pad(v):
        return jnp.pad(v, (0, n - e)).reshape(-1, chunk)

    return _Edges(pad(adj.row_ids), pad(adj.indices), pad(adj.data != 0), pad(dense.edge_keys(adj)))


def _at(v, idx, rows: bool = False):
    """v[idx] for the chunk's row or column ids: they are in bounds and never negative (padding entries point at
    vertex 0), so the gather skips jnp indexing's wrap of negative ids and its bounds handling, which XLA's loop
    emitter evaluates per gathered element; row ids are sorted."""
    return v.at[idx].get(mode="promise_in_bounds", wrap_negative_indices=False, indices_are_sorted=rows)


def _scores(s_src, s_dst, ed: _Edges, i, slope):
    """pre-activation and masked logits [CHUNK, H] of chunk i."""
    pre = _at(s_dst, ed.rows[i], True) + _at(s_src, ed.cols[i])
    return pre, jnp.where(ed.valid[i][:, None], jax.nn.leaky_relu(pre, slope), -jnp.inf)


def _keep(ed: _Edges, seed, rate, heads):
    """Dropout keep-mask [chunks, CHUNK, heads] of every entry (the same draws as `dense.apply_edge`), drawn
    before the chunk loop: one byte per entry and head, and drawn there the hash vectorizes, while drawn inside
    the loop XLA fuses it into the chunk's gathers and the dropout cost as much as the rest of the pass."""
    if rate <= 0.0:
        return None
    return dense.random_bits(seed, ed.keys, jnp.arange(heads, dtype=jnp.uint32)) >= rate


def _alpha(logits, m, s, ed: _Edges, i, keep, rate):
    """α and the dropped-out α of chunk i."""
    r = ed.rows[i]
    alpha = jnp.where(ed.valid[i][:, None], jnp.exp(logits - _at(m, r, True)) / (_at(s, r, True) + 1e-16), 0.0)
    if keep is None:
        return alpha, alpha
    return alpha, jnp.where(keep[i], alpha / (1.0 - rate), 0.0)


def _loop(n, body, init):
    return jax.lax.fori_loop(0, n, body, init)


def _forward(adj, s_src, s_dst, z, seed, slope, rate):
    """One pass over the chunks accumulates each row's softmax sum and its unnormalized gather together, the
    softmax shifted by a per-row bound instead of the row's max (see `_shift`); out = gather / sum."""
    ed = _edges(adj)
    n, (r, h) = ed.rows.shape[0], s_dst.shape
    keep = _keep(ed, seed, rate, h)

    def accumulate(m):
        def body(i, acc):
            s, out = acc
            rows = ed.rows[i]
            e = jnp.where(ed.valid[i][:, None], jnp.exp(_scores(s_src, s_dst, ed, i, slope)[1] - _at(m, rows, True)),
                          0.0)
            dropped = e if keep is None else jnp.where(keep[i], e / (1.0 - rate), 0.0)
            return (s.at[rows].add(e, indices_are_sorted=True, mode="promise_in_bounds"),
                    out.at[rows].add(dropped[:, :, None] * _at(z, ed.cols[i]), indices_are_sorted=True,
                                     mode="promise_in_bounds"))

        return _loop(n, body, (jnp.zeros((r, h), s_dst.dtype), jnp.zeros((r, *z.shape[1:]), z.dtype)))

    def exact():
        def row_max(i, m):
            return m.at[ed.rows[i]].max(_scores(s_src, s_dst, ed, i, slope)[1], indices_are_sorted=True,
                                        mode="promise_in_bounds")

        m = _loop(n, row_max, jnp.full((r, h), -jnp.inf, s_dst.dtype))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        return (m, *accumulate(m))

    bound = _shift(s_src, s_dst, slope)
    s_b, out_b = accumulate(bound)
    # rows with an entry, counted in one scatter outside the loop (inside, it cost one more per chunk)
    count = jnp.zeros((r,), jnp.int32).at[ed.rows.reshape(-1)].add(ed.valid.reshape(-1).astype(jnp.int32))
    underflow = jnp.any((count[:, None] > 0) & (s_b < _TINY))
    m, s, out = jax.lax.cond(underflow, exact, lambda: (bound, s_b, out_b))
    return out / (s[:, :, None] + 1e-16), m, s


# The softmax does not depend on its shift, so any per-row upper bound of the logits keeps exp() <= 1 without
# the pass for the row's max: leaky(s_dst[r] + max_c s_src[c]) bounds every logit of row r (LeakyReLU is
# increasing). A row whose sum would underflow with it (a bound far above the row's own scores) sends the step
# to the exact max; above _TINY every term that matters (α > 1e-8) stays a normal float.
_TINY = 1e-30


def _shift(s_src, s_dst, slope):
    top = jnp.max(s_src, axis=0)
    return jax.nn.leaky_relu(s_dst + jnp.where(jnp.isfinite(top), top, 0.0), slope)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(adj, s_src, s_dst, z, seed, negative_slope, rate):
    return _forward(adj, s_src, s_dst, z, seed, negative_slope, rate)[0]


def _attend_fwd(adj, s_src, s_dst, z, seed, negative_slope, rate):
    out, m, s = _forward(adj, s_src, s_dst, z, seed, negative_slope, rate)
    return out, (adj, s_src, s_dst, z, seed, m, s, out)


def _attend_bwd(negative_slope, rate, res, g):
    adj, s_src, s_dst, z, seed, m, s, out = res
    ed = _edges(adj)
    keep = _keep(ed, seed, rate, s_dst.shape[1])
    row_term = jnp.sum(g * out, axis=-1)                        # Σ_e α_e ∂α_e per (row, head)

    def body(i, acc):
        dz, ds_src, ds_dst = acc
        rows, cols = ed.rows[i], ed.cols[i]
        pre, logits = _scores(s_src, s_dst, ed, i, negative_slope)
        alpha, dropped = _alpha(logits, m, s, ed, i, keep, rate)
        g_rows = _at(g, rows, True)
        dz = dz.at[cols].add(dropped[:, :, None] * g_rows, mode="promise_in_bounds")
        d_dropped = jnp.einsum("ehf,ehf->eh", g_rows, _at(z, cols))  # SDDMM (einsum: XLA's reduce of it is slower)
        d_alpha = d_dropped if rate <= 0.0 else jnp.where(dropped != 0, d_dropped / (1.0 - rate), 0.0)
        d_pre = alpha * (d_alpha - _at(row_term, rows, True)) * jnp.where(pre >= 0, 1.0, negative_slope)
        return (dz, ds_src.at[cols].add(d_pre, mode="promise_in_bounds"),
                ds_dst.at[rows].add(d_pre, indices_are_sorted=True, mode="promise_in_bounds"))

    init = (jnp.zeros_like(z), jnp.zeros_like(s_src), jnp.zeros_like(s_dst))
    dz, ds_src, ds_dst = _loop(ed.rows.shape[0], body, init)
    return None, ds_src, ds_dst, dz, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def attend_and_gather(adj: Adjacency, s_src: jax.Array, s_dst: jax.Array, z: jax.Array, *,
                      negative_slope: float = 0.2, rate: float = 0.0, seed=None) -> jax.Array:
    """out[r, h] = Σ_e α'[e, h] · z[col(e), h]: `dense.apply_edge` then `sparse.gather_weighted`, fused.

    s_src: [C, H], s_dst: [R, H], z: [C, H, F]; returns [R, H, F]. α' is the attention softmax with dropout
    (rate, keyed by seed; none when seed is None), drawn exactly as `dense.apply_edge` draws it.
    """
    if seed is None or rate <= 0.0:
        rate, seed = 0.0, jnp.uint32(0)
    return _attend(adj, s_src, s_dst, z, jnp.asarray(seed, jnp.uint32), float(negative_slope), float(rate))
