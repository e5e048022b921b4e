"""The one immutable in-memory graph record every part of the system reads."""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses

import numpy as np
import scipy.sparse as sp

from ops.host import host_empty


class DataError(ValueError):
    """A graph input (file, array, flag) is wrong; the message names the problem."""


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A node-classification graph.

    adj: symmetric binary CSR adjacency, N x N, int32 indices, no self-loops, no duplicate entries.
    features: float32 [N, F]. labels: int32 [N], -1 where a node has no label.
    train_mask/val_mask/test_mask: bool [N].
    """

    name: str
    adj: sp.csr_matrix
    features: np.ndarray
    labels: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    num_classes: int

    @property
    def num_nodes(self) -> int:
        return int(self.adj.shape[0])

    @property
    def num_edges(self) -> int:
        """Directed edges, both directions counted (the PyG convention)."""
        return int(self.adj.nnz)

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    def replace(self, **changes) -> "Graph":
        return dataclasses.replace(self, **changes)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "nodes": self.num_nodes,
            "edges": self.num_edges,
            "features": self.feature_dim,
            "classes": self.num_classes,
            "train": int(self.train_mask.sum()),
            "val": int(self.val_mask.sum()),
            "test": int(self.test_mask.sum()),
        }


def clean_adjacency(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> sp.csr_matrix:
    """Symmetrize an edge list, drop self-loops and duplicates; ids must lie in [0, num_nodes)."""
    src = np.asarray(src, dtype=np.int64).ravel()
    dst = np.asarray(dst, dtype=np.int64).ravel()
    if src.shape != dst.shape:
        raise DataError(f"edge list has {src.size} sources but {dst.size} destinations")
    if src.size:
        lo = min(int(src.min()), int(dst.min()))
        hi = max(int(src.max()), int(dst.max()))
        if lo < 0 or hi >= num_nodes:
            bad = lo if lo < 0 else hi
            raise DataError(f"edge endpoint id {bad} is out of range [0, {num_nodes})")
    keep = src != dst
    src, dst = src[keep], dst[keep]
    # Sort int64 keys row*n+col instead of scipy's coo->csr + sum_duplicates: same result, ~5x faster and
    # half the memory at tens of millions of edges. n^2 fits int64 for any n below 2^31.
    keys = np.concatenate([src * num_nodes + dst, dst * num_nodes + src])
    keys.sort()
    if keys.size:
        first = np.empty(keys.size, dtype=bool)
        first[0] = True
        np.not_equal(keys[1:], keys[:-1], out=first[1:])
        keys = keys[first]
    rows = keys // num_nodes
    cols = (keys - rows * num_nodes).astype(np.int32)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64 if keys.size > np.iinfo(np.int32).max else np.int32)
    np.cumsum(np.bincount(rows, minlength=num_nodes), out=indptr[1:])
    a = sp.csr_matrix((np.ones(keys.size, np.float32), cols, indptr), shape=(num_nodes, num_nodes))
    a.has_sorted_indices = True
    return a


def make_graph(
    name: str,
    src: np.ndarray,
    dst: np.ndarray,
    features: np.ndarray,
    labels: np.ndarray,
    train_mask: np.ndarray,
    val_mask: np.ndarray,
    test_mask: np.ndarray,
    num_classes: int | None = None,
    adj: sp.csr_matrix | None = None,
) -> Graph:
    """Validate raw arrays and build a Graph (symmetrized, deduplicated, no self-loops).

    adj: the adjacency already in the Graph convention (a reader that builds it itself, e.g. from prepared
    shards); then src/dst are ignored."""
    features = np.asarray(features)
    if features.ndim != 2:
        raise DataError(f"features must be a 2-D array, got shape {features.shape}")
    n = features.shape[0]
    if not np.issubdtype(features.dtype, np.number):
        raise DataError(f"features must be numeric, got dtype {features.dtype}")
    features = np.ascontiguousarray(features, dtype=np.float32)
    if not np.isfinite(features).all():
        bad = int(np.argwhere(~np.isfinite(features))[0][0])
        raise DataError(f"features contain NaN or inf (first at node {bad})")
    labels = np.asarray(labels)
    if labels.shape != (n,):
        raise DataError(f"label count {labels.shape[0] if labels.ndim else 0} does not match node count {n}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integers, got dtype {labels.dtype}")
    labels = labels.astype(np.int32)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size and labels.max() >= 0 else 0
    if labels.size and (labels.min() < -1 or labels.max() >= num_classes):
        raise DataError(f"labels must lie in [-1, {num_classes}), found [{labels.min()}, {labels.max()}]")
    masks = []
    for mname, m in (("train", train_mask), ("val", val_mask), ("test", test_mask)):
        m = np.asarray(m, dtype=bool)
        if m.shape != (n,):
            raise DataError(f"{mname} mask has shape {m.shape}, expected ({n},)")
        if (labels[m] < 0).any():
            raise DataError(f"{mname} mask selects nodes without a label")
        masks.append(m)
    if adj is None:
        adj = clean_adjacency(src, dst, n)
    elif adj.shape != (n, n):
        raise DataError(f"adjacency of shape {adj.shape} for {n} nodes")
    return Graph(name, adj, features, labels, masks[0], masks[1], masks[2], int(num_classes))


def check_trainable(graph: Graph) -> list[str]:
    """What training on `graph` needs of its split: DataError when no vertex is in train, val or test (nothing to
    learn from, select by or report on); returns warnings, one per problem that still lets a run go on (a labelled
    class with no training vertex, which the model then never sees)."""
    sets = {"training": graph.train_mask, "validation": graph.val_mask, "test": graph.test_mask}
    empty = [k for k, m in sets.items() if not m.any()]
    if empty:
        got = ", ".join(f"{int(m.sum())} {k}" for k, m in sets.items())
        labelled = int((graph.labels >= 0).sum())
        raise DataError(f"graph {graph.name!r} has no {' and no '.join(empty)} vertices ({got}; {labelled} of "
                        f"{graph.num_nodes} labelled): give it a split that has all three (`dorylus prepare "
                        f"--split` or `--split-file`, a split file beside an edge list, train=/val= per class for "
                        f"synthetic graphs)")
    labelled = np.unique(graph.labels[graph.labels >= 0])
    missing = np.setdiff1d(labelled, np.unique(graph.labels[graph.train_mask]))
    if missing.size:
        shown = ", ".join(str(int(c)) for c in missing[:10]) + (", ..." if missing.size > 10 else "")
        return [f"graph {graph.name!r}: labelled class(es) {shown} have no training vertex; the model cannot "
                f"learn {'it' if missing.size == 1 else 'them'}"]
    return []


def gcn_normalize(adj: sp.csr_matrix) -> sp.csr_matrix:
    """Â = D^-1/2 (A + I) D^-1/2 (Kipf & Welling, ICLR 2017), float32 CSR with sorted int32 indices.

    A Graph's adjacency (binary, sorted, no self-loops) takes the lean path: the diagonal is inserted into a new
    index array directly and each entry's weight is d_i^-1/2 d_j^-1/2 from the row lengths, in chunks, about
    9 bytes per entry beside the input instead of scipy's several CSR temporaries. Any other matrix goes through
    scipy. Both give the same float32 values: the float64 product d_i^-1/2 d_j^-1/2 (times the entry), rounded.
    """
    a = sp.csr_matrix(adj)
    if not _binary_without_loops(a):
        return _gcn_normalize_scipy(a)
    n = a.shape[0]
    nnz = a.nnz + n
    itype = np.int64 if nnz > np.iinfo(np.int32).max else np.int32
    counts = np.diff(a.indptr).astype(itype)
    indptr = np.zeros(n + 1, itype)
    np.cumsum(counts + 1, out=indptr[1:])
    dinv = 1.0 / np.sqrt(counts.astype(np.float64) + 1.0)
    indices = host_empty(nnz, itype)   # aligned: the device graph uses Â's arrays in place
    data = host_empty(nnz, np.float32)
    below = np.zeros(n, itype)   # entries left of the diagonal, per row
    for lo, hi in _row_chunks(a.indptr, ENTRY_CHUNK):
        s, e = int(a.indptr[lo]), int(a.indptr[hi])
        rows = np.repeat(np.arange(lo, hi, dtype=itype), counts[lo:hi])
        cols = a.indices[s:e]
        left = cols < rows
        below[lo:hi] = np.bincount(rows[left] - lo, minlength=hi - lo)
        # an entry moves right by its row (one diagonal per earlier row) and by one more if right of its diagonal
        pos = np.arange(s, e, dtype=itype) + rows + (~left)
        indices[pos] = cols
        data[pos] = dinv[rows] * dinv[cols]
    diag = indptr[:-1] + below
    indices[diag] = np.arange(n, dtype=itype)
    data[diag] = dinv * dinv
    out = sp.csr_matrix((data, indices, indptr), shape=(n, n))
    out.has_sorted_indices = True
    return out


ENTRY_CHUNK = 1 << 22   # entries per step of gcn_normalize's lean path (bounds its per-entry temporaries)


def _row_chunks(indptr: np.ndarray, entries: int):
    """(lo, hi) row ranges of about `entries` stored entries each."""
    n = indptr.size - 1
    lo = 0
    while lo < n:
        hi = int(np.searchsorted(indptr, indptr[lo] + entries, side="right")) - 1
        hi = min(max(hi, lo + 1), n)
        yield lo, hi
        lo = hi


def _binary_without_loops(a: sp.csr_matrix) -> bool:
    """Whether `a` is square with sorted unique indices, all values 1 and an empty diagonal (a Graph's adj)."""
    if a.shape[0] != a.shape[1] or not a.has_canonical_format:
        return False
    if a.nnz == 0:
        return True
    return bool((a.data == 1).all()) and not a.diagonal().any()


def _gcn_normalize_scipy(adj: sp.csr_matrix) -> sp.csr_matrix:
    n = adj.shape[0]
    a = (adj + sp.identity(n, dtype=np.float32, format="csr")).tocsr()
    a.sum_duplicates()
    deg = np.asarray(a.sum(axis=1)).ravel().astype(np.float64)
    dinv = 1.0 / np.sqrt(deg)
    a = sp.diags(dinv) @ a @ sp.diags(dinv)
    a = a.tocsr().astype(np.float32)
    a.sort_indices()
    a.indices = a.indices.astype(np.int32)
    a.indptr = a.indptr.astype(np.int64 if a.nnz > np.iinfo(np.int32).max else np.int32)
    return a


HUB_SHARE = 0.3   # hub order pays when the top 10% of vertices by degree hold more than this share of the edges


def locality_order(adj: sp.csr_matrix) -> np.ndarray | None:
    """A vertex order that keeps the gather's reads in cache, or None when the ids are as good as any.

    Hub order (vertices by descending degree, ties by id; Balaji & Lucia, "When is graph reordering an
    optimization?", IISWC 2018): on a skewed graph most entries read the rows of few high-degree vertices, and
    numbered first those rows share cache lines and stay in cache; on a graph with near-uniform degrees
    (planted-partition, Erdős-Rényi) no cheap order helps and the copy it costs is saved.
    """
    deg = np.diff(adj.indptr)
    n = deg.size
    if n < 2 or not deg.sum():
        return None
    top = max(1, n // 10)
    share = np.partition(deg, n - top)[n - top:].sum() / deg.sum()
    if share <= HUB_SHARE:
        return None
    return np.argsort(-deg, kind="stable").astype(np.int64)


def permute_symmetric(a: sp.csr_matrix, perm: np.ndarray) -> sp.csr_matrix:
    """P A Pᵀ for a square CSR: row i of the result is row perm[i] of `a`, column ids renumbered the same way,
    indices sorted; in chunks of rows, so the temporaries stay small beside the result."""
    n = a.shape[0]
    inv = np.empty(n, np.int64)
    inv[perm] = np.arange(n)
    counts = np.diff(a.indptr)[perm]
    itype = a.indices.dtype
    indptr = np.zeros(n + 1, a.indptr.dtype)
    np.cumsum(counts, out=indptr[1:])
    indices = host_empty(a.nnz, itype)
    data = host_empty(a.nnz, a.data.dtype)
    starts = a.indptr[perm]
    for lo, hi in _row_chunks(indptr, ENTRY_CHUNK):
        s, e = int(indptr[lo]), int(indptr[hi])
        src = np.repeat(starts[lo:hi] - indptr[lo:hi], counts[lo:hi]) + np.arange(s, e)
        indices[s:e] = inv[a.indices[src]]
        data[s:e] = a.data[src]
    out = sp.csr_matrix((data, indices, indptr), shape=a.shape)
    out.sort_indices()   # in place, row by row
    return out


def row_normalize(features: np.ndarray) -> np.ndarray:
    """Divide each feature row by its sum (rows summing to 0 stay 0), as Kipf's GCN preprocessing does."""
    s = features.sum(axis=1, keepdims=True)
    s[s == 0] = 1.0
    return (features / s).astype(np.float32)


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading a graph frees many temporaries of tens of MB; glibc raises its mmap threshold after freeing such
    blocks, so later ones come from the heap and stay resident after they are freed. Called once a graph is in
    its final arrays, so the peak of training does not stand on the loader's garbage."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)
