"""GA and its VJP over adjacency blocks (with a precomputed transpose), and the whole graph as partition blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from ops import native
from ops.host import aligned, host_empty, host_zeros
from ops.xla import to_device


@jax.tree_util.register_pytree_node_class
class Adjacency:
    """The rows of a (normalized) adjacency that one task gathers over: R destination rows x C source columns.

    data/indices/indptr: CSR of the R x C block (the values are Â's entries for GCN), int32 indices (and indptr
      while nnz fits int32).
    row_ids: the CSR row of every stored entry, for per-edge work (attention, SDDMM). Stored when built with
      `edge_rows=True` (GAT, whose AE tasks ship it); otherwise derived from indptr inside the kernel that needs it.
    t_indices/t_indptr/t_perm: CSR structure of the transpose; the transpose's k-th value is data[t_perm[k]],
      so backward passes (∇GA with Âᵀ) run at the same speed as forward ones. None when `symmetric`: a square
      block equal to its transpose (GCN's and GraphSAGE's whole-graph Â) is its own transpose.
    row_gids/col_gids: global vertex id of each local row and column; counter-based dropout keys on them
      so every partitioning (and every vertex order) draws the same masks.
    Shapes and `symmetric` are static pytree metadata, so jit compiles once per (R, C, nnz).
    """

    def __init__(self, data, indices, indptr, row_ids, t_indices, t_indptr, t_perm, row_gids, col_gids, shape,
                 symmetric: bool = False):
        self.data = data
        self.indices = indices
        self.indptr = indptr
        self._row_ids = row_ids
        self.t_indices = t_indices
        self.t_indptr = t_indptr
        self.t_perm = t_perm
        self.row_gids = row_gids
        self.col_gids = col_gids
        self.shape = tuple(int(s) for s in shape)
        self.symmetric = bool(symmetric)

    def tree_flatten(self):
        return (
            (self.data, self.indices, self.indptr, self._row_ids, self.t_indices, self.t_indptr, self.t_perm,
             self.row_gids, self.col_gids),
            (self.shape, self.symmetric),
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        shape, symmetric = aux
        return cls(*children, shape=shape, symmetric=symmetric)

    @property
    def nnz(self) -> int:
        return int(self.data.shape[0])

    @property
    def row_ids(self):
        """The CSR row of every stored entry: the stored vector, else derived from indptr (O(nnz), in the
        caller's jit): a 1 at every row start, summed."""
        if self._row_ids is not None:
            return self._row_ids
        starts = jnp.zeros(self.nnz, jnp.int32).at[self.indptr[1:-1]].add(1, mode="drop")
        return jnp.cumsum(starts, dtype=jnp.int32)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored arrays (what the block costs in memory, wherever it lives)."""
        leaves = {id(a): a for a in jax.tree_util.tree_leaves(self)}   # row and column ids may be one array
        return int(sum(a.nbytes for a in leaves.values()))

    @classmethod
    def from_scipy(cls, a: sp.spmatrix, row_gids=None, col_gids=None, nnz_pad: int | None = None,
                   rows_pad: int | None = None, cols_pad: int | None = None, *, symmetric: bool = False,
                   edge_rows: bool | None = None) -> "Adjacency":
        """Build from a scipy matrix (host side), optionally padded to fixed sizes with zero-valued entries.

        symmetric=True (the caller knows the block equals its transpose, e.g. GCN's Â over the whole graph):
        no transpose is stored, and an unpadded float32/int32 CSR with sorted indices is used without a copy.
        edge_rows: store row_ids (default: only when a transpose is stored, as the engine's blocks need).
        """
        a = a if sp.isspmatrix_csr(a) or isinstance(a, sp.csr_array) else sp.csr_matrix(a)
        if not a.has_sorted_indices:
            a = a.copy()
            a.sort_indices()
        r, c = a.shape
        rp = r if rows_pad is None else int(rows_pad)
        cp = c if cols_pad is None else int(cols_pad)
        if rp < r or cp < c:
            raise ValueError(f"padding {rp}x{cp} is smaller than the block {r}x{c}")
        nnz = a.nnz
        npad = nnz if nnz_pad is None else int(nnz_pad)
        if npad < nnz:
            raise ValueError(f"nnz padding {npad} is smaller than the block's {nnz} entries")
        if symmetric and (r != c or rp != r or cp != c or npad != nnz):
            raise ValueError("a symmetric adjacency is square and unpadded")
        itype = np.int64 if npad > np.iinfo(np.int32).max else np.int32
        if npad == nnz:   # no padding: the CSR's own arrays (no copy when they have the dtypes and are aligned)
            data = aligned(a.data, np.float32)
            indices = aligned(a.indices, itype)
        else:
            data = host_zeros(npad, np.float32)
            data[:nnz] = a.data
            indices = host_zeros(npad, itype)
            indices[:nnz] = a.indices
        indptr = host_empty(rp + 1, itype)
        indptr[: r + 1] = a.indptr
        # Padding entries sit in the last padded row (or the last real row) with value 0 at column 0.
        indptr[r + 1:] = nnz
        indptr[-1] = npad
        rg = aligned(np.arange(rp, dtype=np.int32)) if row_gids is None else pad_ids(row_gids, rp)
        cg = None if symmetric and col_gids is None else (
            aligned(np.arange(cp, dtype=np.int32)) if col_gids is None else pad_ids(col_gids, cp))
        if symmetric:
            return cls(data, indices, indptr, _row_ids(indptr) if edge_rows else None, None, None, None,
                       rg, rg if cg is None else cg, shape=(rp, cp), symmetric=True)
        row_ids = _row_ids(indptr)
        order = aligned(np.lexsort((row_ids, indices)), itype)  # transpose order: by column, then row
        t_indptr = host_zeros(cp + 1, itype)
        np.cumsum(np.bincount(indices, minlength=cp), out=t_indptr[1:])
        t_indices = aligned(row_ids[order])
        return cls(data, indices, indptr, row_ids if edge_rows in (None, True) else None, t_indices, t_indptr,
                   order, rg, cg, shape=(rp, cp))

    def to_device(self) -> "Adjacency":
        """The block as device arrays. On the CPU backend they are the host arrays' memory (`from_scipy` builds
        them aligned, `ops.xla.to_device`), so the adjacency is held once; elsewhere they are copies."""
        return jax.tree_util.tree_map(to_device, self)


@jax.tree_util.register_pytree_node_class
class Partitioned:
    """All vertices' rows as P partition blocks (the engine's whole-partition `Adjacency` blocks, already on the
    device): a gather over it runs block by block and writes each block's rows back in vertex order, so a
    whole-graph pass reads the blocks the graph servers hold instead of a second copy of Â.

    col_ids[p]: the vertex each column of block p reads (padding columns read vertex 0; no entry names them);
    row_ids[p]: the vertex of each row (padding rows name `num_rows` and are dropped). Row-local work runs on
    all `num_rows` rows at once, in vertex order (`row_gids`)."""

    def __init__(self, blocks, col_ids, row_ids, num_rows: int):
        self.blocks, self.col_ids, self.row_ids = tuple(blocks), tuple(col_ids), tuple(row_ids)
        self.num_rows = int(num_rows)

    @classmethod
    def from_blocks(cls, blocks, num_rows: int) -> "Partitioned":
        """From blocks whose row and column global ids are padded with -1 (`Adjacency.from_scipy`'s)."""
        cols = [to_device(np.where(np.asarray(b.col_gids) < 0, 0, np.asarray(b.col_gids)).astype(np.int32))
                for b in blocks]
        rows = [to_device(np.where(np.asarray(b.row_gids) < 0, num_rows, np.asarray(b.row_gids)).astype(np.int32))
                for b in blocks]
        return cls(blocks, cols, rows, num_rows)

    def tree_flatten(self):
        return (self.blocks, self.col_ids, self.row_ids), self.num_rows

    @classmethod
    def tree_unflatten(cls, num_rows, children):
        return cls(*children, num_rows=num_rows)

    @property
    def row_gids(self) -> jax.Array:
        return jnp.arange(self.num_rows, dtype=jnp.int32)

    def gather_each(self, fn, h: jax.Array) -> jax.Array:
        """fn(block, h at the block's columns) -> the block's rows, for every block, as one [num_rows, ...]
        array in vertex order."""
        out = None
        for b, c, r in zip(self.blocks, self.col_ids, self.row_ids):
            o = fn(b, jnp.take(h, c, axis=0))
            if out is None:
                out = jnp.zeros((self.num_rows, *o.shape[1:]), o.dtype)
            out = out.at[r].set(o, mode="drop")  # block by block: one block's gathered columns live at a time
        return out


def _row_ids(indptr: np.ndarray) -> np.ndarray:
    return aligned(np.repeat(np.arange(indptr.size - 1, dtype=indptr.dtype), np.diff(indptr)))


def pad_ids(ids, n):
    """int32 ids padded to n entries with -1 (padding rows and columns have no vertex)."""
    out = host_empty(n, np.int32)
    out.fill(-1)
    ids = np.asarray(ids, np.int32)
    out[: ids.size] = ids
    return out


def _csr_matmul(data, indices, indptr, x, nrows):
    return native.csr_spmm(data, indices, indptr, x, nrows)


@jax.custom_vjp
def gather(adj: Adjacency, x: jax.Array) -> jax.Array:
    """GA: y = A · x for the rows of `adj` (x has one row per column of `adj`).

    The VJP is ∇GA: dx = Aᵀ · dy, using the precomputed transpose (Dorylus's backward gather over Âᵀ).
    Edge values are constants here (GCN); see `gather_weighted` for learned values (GAT).
    """
    return _csr_matmul(adj.data, adj.indices, adj.indptr, x, adj.shape[0])


def _gather_fwd(adj, x):
    return gather(adj, x), adj


def gather_transpose(adj: Adjacency, g: jax.Array) -> jax.Array:
    """∇GA: Aᵀ · g over the block's columns, with the precomputed transpose (no forward values needed); a
    symmetric block is its own transpose."""
    if adj.symmetric:
        return _csr_matmul(adj.data, adj.indices, adj.indptr, g, adj.shape[0])
    return _csr_matmul(adj.data[adj.t_perm], adj.t_indices, adj.t_indptr, g, adj.shape[1])


def _gather_bwd(adj, g):
    return None, gather_transpose(adj, g)


gather.defvjp(_gather_fwd, _gather_bwd)


@jax.custom_vjp
def gather_weighted(adj: Adjacency, values: jax.Array, x: jax.Array) -> jax.Array:
    """GA with per-edge, per-head values: y[r, h] = Σ_e values[e, h] · x[col(e), h] over the row's entries.

    values: [nnz, H]; x: [C, H, F]; returns [R, H, F]. This is the aggregation of GAT (Veličković et al., ICLR 2018)
    with attention coefficients as values. The VJP gives dx = Aᵀ-weighted gather and dvalues by SDDMM.
    """
    heads = [
        _csr_matmul(values[:, h], adj.indices, adj.indptr, x[:, h, :], adj.shape[0]) for h in range(x.shape[1])
    ]
    return jnp.stack(heads, axis=1)


def _gw_fwd(adj, values, x):
    return gather_weighted(adj, values, x), (adj, values, x)


def gather_weighted_transpose(adj: Adjacency, values: jax.Array, g: jax.Array) -> jax.Array:
    """∇GA of `gather_weighted` for x: dx[c, h] = Σ_e values[e, h] · g[row(e), h] over column c's entries,
    with the precomputed transpose. g: [R, H, F]; returns [C, H, F]."""
    tv = values[adj.t_perm]
    return jnp.stack(
        [_csr_matmul(tv[:, h], adj.t_indices, adj.t_indptr, g[:, h, :], adj.shape[1]) for h in range(g.shape[1])],
        axis=1,
    )


def _gw_bwd(res, g):
    adj, values, x = res
    dvalues = jnp.sum(g[adj.row_ids] * x[adj.indices], axis=-1)
    return None, dvalues, gather_weighted_transpose(adj, values, g)


gather_weighted.defvjp(_gw_fwd, _gw_bwd)


def _with_values(adj: Adjacency, values: jax.Array) -> Adjacency:
    return Adjacency(values, adj.indices, adj.indptr, adj._row_ids, adj.t_indices, adj.t_indptr, adj.t_perm,
                     adj.row_gids, adj.col_gids, adj.shape, symmetric=adj.symmetric)


def _self_and_neighbours(adj: Adjacency):
    """Per stored entry: 1 where it is its row's self-loop, 1 where it is a neighbour; and each row's neighbour
    count (at least 1). Taken from the structure (nonzero entries) and global ids, not the stored values."""
    valid = adj.data != 0
    rows = adj.row_ids
    is_self = valid & (adj.row_gids[rows] == adj.col_gids[adj.indices])
    neigh = (valid & ~is_self).astype(jnp.float32)
    count = jax.ops.segment_sum(neigh, rows, num_segments=adj.shape[0], indices_are_sorted=True)
    return is_self.astype(jnp.float32), neigh, jnp.maximum(count, 1.0), rows


def mean_self_split(adj: Adjacency) -> tuple[Adjacency, Adjacency]:
    """The self-loop selector S and the mean over in-neighbours D^-1 A of a block with self-loops.

    Taken from the structure (nonzero entries), not the stored values, so it works over any normalized Â: an
    entry is the row's self-loop when its column is the row's own vertex (global ids), a neighbour otherwise.
    Every row of a block holds all of its in-edges, so the per-row neighbour count is exact; a vertex without
    neighbours has mean 0. (D^-1 A is not symmetric: over a symmetric block `gather_mean` scales after a
    gather over A instead.)
    """
    sel, neigh, count, rows = _self_and_neighbours(adj)
    return _with_values(adj, sel), _with_values(adj, neigh / count[rows])


def _self_and_mean(adj: Adjacency, x_self: jax.Array, x_neigh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(S x_self, D^-1 A x_neigh). Over a symmetric block D^-1 is applied after gathering over the symmetric 0/1
    neighbour matrix, so the VJP gathers over that matrix (its own transpose) and scales first."""
    sel, neigh, count, rows = _self_and_neighbours(adj)
    if adj.symmetric:
        return gather(_with_values(adj, sel), x_self), gather(_with_values(adj, neigh), x_neigh) / count[:, None]
    return gather(_with_values(adj, sel), x_self), gather(_with_values(adj, neigh / count[rows]), x_neigh)


def gather_mean(adj: Adjacency, x: jax.Array, aggregator: str) -> jax.Array:
    """GraphSAGE's GA (mean aggregator, Hamilton et al. 2017) over a block's columns x [C, F].

    "mean-concat": [x_self, mean(x_N)] of width 2F (GA before AV: the AV weight is [W_self; W_neigh]).
    "mean-add": x_self[:, :F/2] + mean(x_N)[:, F/2:] (AV before GA: x = [h W_self, h W_neigh]).
    Both are linear in x, so the VJP is `gather_mean_transpose`, through `gather`'s.
    """
    if aggregator == "mean-concat":
        return jnp.concatenate(_self_and_mean(adj, x, x), axis=-1)
    if aggregator == "mean-add":
        f = x.shape[-1] // 2
        a, b = _self_and_mean(adj, x[:, :f], x[:, f:])
        return a + b
    raise ValueError(f"unknown aggregator {aggregator!r} (sum, mean-concat, mean-add)")


def _self_and_mean_transpose(adj: Adjacency, g_self: jax.Array, g_mean: jax.Array):
    """(Sᵀ g_self, (D^-1 A)ᵀ g_mean) without forward inputs; over a symmetric block (D^-1 A)ᵀ = A D^-1."""
    sel, neigh, count, rows = _self_and_neighbours(adj)
    s = _with_values(adj, sel)
    if adj.symmetric:
        return gather_transpose(s, g_self), gather_transpose(_with_values(adj, neigh), g_mean / count[:, None])
    return gather_transpose(s, g_self), gather_transpose(_with_values(adj, neigh / count[rows]), g_mean)


def gather_mean_transpose(adj: Adjacency, g: jax.Array, aggregator: str) -> jax.Array:
    """∇GA of `gather_mean`: Sᵀ and (D^-1 A)ᵀ over the precomputed transpose, no forward inputs needed."""
    if aggregator == "mean-concat":
        f = g.shape[-1] // 2
        a, b = _self_and_mean_transpose(adj, g[:, :f], g[:, f:])
        return a + b
    if aggregator == "mean-add":
        return jnp.concatenate(_self_and_mean_transpose(adj, g, g), axis=-1)
    raise ValueError(f"unknown aggregator {aggregator!r} (sum, mean-concat, mean-add)")


def segment_softmax(logits: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """Softmax of per-edge logits [nnz, H] over the entries of each row (each vertex's in-neighbours)."""
    m = jax.ops.segment_max(logits, segment_ids, num_segments=num_segments, indices_are_sorted=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - jax.lax.stop_gradient(m)[segment_ids])
    s = jax.ops.segment_sum(e, segment_ids, num_segments=num_segments, indices_are_sorted=True)
    return e / (s[segment_ids] + 1e-16)
