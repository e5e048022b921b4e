"""AV and AE: the dense, row-local and edge-local tensor tasks, plus counter-based dropout and the loss."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    None: lambda x: x,
    "relu": jax.nn.relu,
    "elu": jax.nn.elu,
}


def _mix(h):
    """A 32-bit integer finalizer (murmur3 fmix32): a cheap, well-mixed hash for counter-based random bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(seed: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """Uniform [0, 1) floats that depend only on (seed, row id, column id).

    Counter-based on global ids, so a vertex draws the same dropout mask whichever partition and interval
    holds it: the pipelined engine reproduces the single-machine trainer exactly.
    """
    s = jnp.asarray(seed, jnp.uint32)
    h = _mix(_mix(s ^ rows.astype(jnp.uint32)[..., :, None] * jnp.uint32(0x9E3779B1)) ^ cols.astype(jnp.uint32))
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def dropout(x: jax.Array, rate: float, seed, row_gids: jax.Array) -> jax.Array:
    """Inverted dropout on rows of x [R, D...], masks keyed by (seed, global row id, flat column)."""
    if rate <= 0.0 or seed is None:
        return x
    flat = x.reshape(x.shape[0], -1)
    keep = random_bits(seed, row_gids, jnp.arange(flat.shape[1], dtype=jnp.uint32)) >= rate
    return jnp.where(keep, flat / (1.0 - rate), 0.0).reshape(x.shape)


def apply_vertex(params: dict, x: jax.Array, *, act_in=None, act_out=None, rate: float = 0.0, seed=None,
                 row_gids=None, heads: int = 0) -> dict:
    """AV: y = act_out(dropout(act_in(x + b_in)) · W + b_out), Dorylus's ApplyVertex σ(AH · W).

    `b_in`/`act_in` finish the previous layer when it aggregated after its transform (Â(HW) + b, then σ).
    With heads > 0 (GAT) also returns the per-head attention scores s_src = z·a_src and s_dst = z·a_dst
    (Veličković et al., ICLR 2018, eq. 3 split into its source and destination halves).
    """
    if "b_in" in params:
        x = x + params["b_in"]
    x = ACTIVATIONS[act_in](x)
    x = dropout(x, rate, seed, row_gids)
    z = x @ params["w"]
    if "b_out" in params:
        z = z + params["b_out"]
    z = ACTIVATIONS[act_out](z)
    if heads:
        z = z.reshape(z.shape[0], heads, -1)
        return {"z": z, "s_src": jnp.sum(z * params["a_src"], -1), "s_dst": jnp.sum(z * params["a_dst"], -1)}
    return {"z": z}


#: rows per block of `row_blocked`: [ROW_BLOCK, 256] float32 is 16 MB, a GEMM still large enough for full speed
ROW_BLOCK = 1 << 14


def row_blocked(fn, params, x: jax.Array, row_gids: jax.Array, seeds, *, need_dx: bool = True,
                block: int | None = None):
    """fn(params, x, row_gids, seeds) for a row-local fn (a chain of AV stages), over blocks of `block` rows.

    Forward and backward run block by block, and the backward recomputes each block's forward (its dropout
    masks come from the counter-based seeds), so no intermediate of the chain lives at the graph's size: the
    step keeps x, the output and [block, width] transients, where the plain VJP keeps every layer's
    pre-activation and dropped input at N rows. Rows are independent, so values equal fn(...) up to the
    summation order of the weight gradients. need_dx=False (x needs no gradient: the input features or their
    constant Â·X) skips the input gradient's GEMM.
    """
    block = ROW_BLOCK if block is None else int(block)
    return _blocked(fn, max(1, min(block, x.shape[0])), bool(need_dx), params, x, row_gids, seeds)


def _map_blocks(f, block: int, x, gids):
    """Apply f(x_block, gid_block) to every block of rows and stack the outputs (a pytree)."""
    n = x.shape[0]
    full, rem = divmod(n, block)

    def sl(a, start, size):
        return jax.lax.dynamic_slice_in_dim(a, start, size)

    shapes = jax.eval_shape(f, sl(x, 0, block), sl(gids, 0, block))
    out = jax.tree_util.tree_map(lambda s: jnp.zeros((n, *s.shape[1:]), s.dtype), shapes)

    def put(out, start, size):
        y = f(sl(x, start, size), sl(gids, start, size))
        return jax.tree_util.tree_map(lambda o, v: jax.lax.dynamic_update_slice_in_dim(o, v, start, 0), out, y)

    out = jax.lax.fori_loop(0, full, lambda i, o: put(o, i * block, block), out)
    return put(out, full * block, rem) if rem else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _blocked(fn, block, need_dx, params, x, gids, seeds):
    return _map_blocks(lambda xb, gb: fn(params, xb, gb, seeds), block, x, gids)


def _blocked_fwd(fn, block, need_dx, params, x, gids, seeds):
    return _blocked(fn, block, need_dx, params, x, gids, seeds), (params, x, gids, seeds)


def _blocked_bwd(fn, block, need_dx, res, g):
    params, x, gids, seeds = res
    n = x.shape[0]
    full, rem = divmod(n, block)

    def grads(start, size):
        xb = jax.lax.dynamic_slice_in_dim(x, start, size)
        gb = jax.lax.dynamic_slice_in_dim(gids, start, size)
        cb = jax.tree_util.tree_map(lambda v: jax.lax.dynamic_slice_in_dim(v, start, size), g)
        if need_dx:
            _, pull = jax.vjp(lambda p, xx: fn(p, xx, gb, seeds), params, xb)
            return pull(cb)
        _, pull = jax.vjp(lambda p: fn(p, xb, gb, seeds), params)
        return pull(cb)[0], None

    def step(start, size, acc):
        dp, dx = acc
        dpb, dxb = grads(start, size)
        dp = jax.tree_util.tree_map(jnp.add, dp, dpb)
        return dp, None if dx is None else jax.lax.dynamic_update_slice_in_dim(dx, dxb, start, 0)

    acc = (jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros_like(x) if need_dx else None)
    acc = jax.lax.fori_loop(0, full, lambda i, a: step(i * block, block, a), acc)
    if rem:
        acc = step(full * block, rem, acc)
    dp, dx = acc
    return dp, dx, None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def edge_logits(s_src: jax.Array, s_dst: jax.Array, adj, negative_slope: float = 0.2):
    """GAT's per-edge scores: (pre, logits) with pre = s_dst[row] + s_src[col] and logits = LeakyReLU(pre),
    -inf on padding entries (stored value 0) so the softmax gives them α = 0."""
    pre = s_dst[adj.row_ids] + s_src[adj.indices]
    logits = jnp.where((adj.data != 0)[:, None], jax.nn.leaky_relu(pre, negative_slope), -jnp.inf)
    return pre, logits


def edge_keys(adj) -> jax.Array:
    """uint32 [nnz]: each entry's dropout key from its (destination, source) global ids, so every partitioning
    (and a backward that recomputes the mask) draws the same."""
    return adj.row_gids[adj.row_ids].astype(jnp.uint32) * jnp.uint32(0x27D4EB2F) ^ adj.col_gids[
        adj.indices].astype(jnp.uint32)


def edge_keep(seed, adj, heads: int, rate: float) -> jax.Array:
    """Dropout keep-mask [nnz, heads] of the attention coefficients (keyed by `edge_keys` and the head)."""
    return random_bits(seed, edge_keys(adj), jnp.arange(heads, dtype=jnp.uint32)) >= rate


def apply_edge(s_src: jax.Array, s_dst: jax.Array, adj, *, negative_slope: float = 0.2, rate: float = 0.0,
               seed=None) -> jax.Array:
    """AE: GAT attention α[e, h] = softmax over row r's entries of LeakyReLU(s_dst[r] + s_src[col(e)]).

    s_src: [C, H] scores of the block's columns (owned and ghost vertices); s_dst: [R, H] of its rows.
    Padding entries (stored value 0) get α = 0. Dropout on α as in the GAT paper. The engine runs this as its
    own tensor task; the whole-graph trainer fuses it with the weighted gather (`ops.attention`).
    """
    from ops.sparse import segment_softmax

    _, logits = edge_logits(s_src, s_dst, adj, negative_slope)
    alpha = segment_softmax(logits, adj.row_ids, adj.shape[0])
    alpha = jnp.where((adj.data != 0)[:, None], alpha, 0.0)
    if rate > 0.0 and seed is not None:
        keep = edge_keep(seed, adj, alpha.shape[1], rate)
        alpha = jnp.where(keep, alpha / (1.0 - rate), 0.0)
    return alpha


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum of masked softmax cross-entropy and the number of masked rows (divide after summing over intervals)."""
    logp = jax.nn.log_softmax(logits)
    safe = jnp.maximum(labels, 0)
    nll = -jnp.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    m = mask.astype(logits.dtype)
    return jnp.sum(nll * m), jnp.sum(m)


def correct_count(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Number of masked rows whose argmax equals the label."""
    return jnp.sum((jnp.argmax(logits, -1) == labels) & mask)
