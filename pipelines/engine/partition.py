"""Partitioning: METIS or hash assignment, per-partition ghost maps, and vertex intervals padded to fixed sizes."""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from ops import models
from ops.sparse import Adjacency, pad_ids
from pipelines.config import ConfigError


class PrecomputedAssignment(str):
    """A partitioner that carries its assignment (e.g. the partitions a Beam prepare run stored), usable wherever a
    partitioner name is: ``str(self)`` is its name ("prepared") for stats and config files, ``.parts`` the
    int32 partition of every vertex."""

    def __new__(cls, parts, name: str = "prepared"):
        self = super().__new__(cls, name)
        self.parts = np.asarray(parts, np.int32)
        return self

    def __reduce__(self):   # copy/pickle: rebuild from the vector, not from the name
        return PrecomputedAssignment, (self.parts, str(self))


def assign(adj: sp.csr_matrix, parts: int, method: str, seed: int = 0) -> np.ndarray:
    """Partition id of every vertex: METIS (Karypis & Kumar 1998, via pymetis), a seeded hash, or a
    :class:`PrecomputedAssignment` (checked: one id in [0, parts) per vertex, no empty partition)."""
    n = adj.shape[0]
    if parts < 1:
        raise ConfigError(f"partitions must be >= 1, got {parts}")
    if parts > n:
        raise ConfigError(f"partitions ({parts}) exceeds the graph's {n} vertices")
    if isinstance(method, PrecomputedAssignment):
        out = method.parts
        if out.shape != (n,):
            raise ConfigError(f"the {method} assignment has {out.size} entries for {n} vertices")
        if n and (out.min() < 0 or out.max() >= parts):
            raise ConfigError(f"the {method} assignment has ids in [{out.min()}, {out.max()}], "
                              f"expected [0, {parts})")
        empty = np.flatnonzero(np.bincount(out, minlength=parts) == 0)
        if empty.size:
            raise ConfigError(f"the {method} assignment leaves partition {int(empty[0])} empty")
        return out.copy()
    if parts == 1:
        return np.zeros(n, np.int32)
    if method == "hash":
        # A seeded permutation, then round robin: balanced, and independent of id locality.
        perm = np.random.default_rng(seed).permutation(n)
        out = np.empty(n, np.int32)
        out[perm] = np.arange(n) % parts
        return out
    if method == "metis":
        import pymetis

        a = sp.csr_matrix(adj, copy=True)  # setdiag below must not touch the caller's matrix
        a.setdiag(0)
        a.eliminate_zeros()
        opts = pymetis.Options(seed=seed)
        csr = pymetis.CSRAdjacency(a.indptr.astype(np.int64), a.indices.astype(np.int64))
        _, membership = pymetis.part_graph(parts, csr, options=opts)
        out = np.asarray(membership, np.int32)
        # METIS may leave a part empty on tiny or disconnected graphs; give it a vertex so every server has work.
        for p in range(parts):
            if not (out == p).any():
                counts = np.bincount(out, minlength=parts)
                donor = int(np.argmax(counts))
                out[np.flatnonzero(out == donor)[0]] = p
        return out
    raise ConfigError(f"unknown partitioner {method!r} (metis or hash)")


@dataclasses.dataclass
class IntervalPlan:
    """One vertex interval: owned rows [start, end) in the partition's order and its gather block."""

    index: int
    start: int
    end: int
    cols: np.ndarray           # partition column-space indices the block reads (compact, padded with 0)
    num_cols: int
    block: Adjacency | None    # host arrays, padded to the plan-wide (rows, cols, nnz); None without blocks
    row_gids: np.ndarray       # global id of each of the plan-wide padded rows, -1 on padding rows


@dataclasses.dataclass
class PartitionPlan:
    """Everything graph server p owns: vertices, ghosts, ghost maps in both directions, intervals."""

    partition: int
    owned: np.ndarray          # global ids, the partition's row order
    ghosts: np.ndarray         # global ids of the columns owned elsewhere, grouped by owner, ascending in each
    ghost_owner: np.ndarray    # partition owning each ghost
    send: dict                 # q -> owned local indices that partition q reads as ghosts (forward SC)
    recv: dict                 # q -> positions in `ghosts` of the rows q sends (forward); ∇SC goes back
    intervals: list
    block: Adjacency | None = None  # all owned rows over the column space (`build_plan(whole=True)`), padded

    @property
    def num_owned(self) -> int:
        return int(self.owned.size)

    @property
    def colspace(self) -> np.ndarray:
        return np.concatenate([self.owned, self.ghosts])


@dataclasses.dataclass
class Plan:
    parts: np.ndarray
    partitions: list
    rows_pad: int
    cols_pad: int
    nnz_pad: int
    stats: dict


def _chunks(indptr: np.ndarray, k: int) -> list[tuple[int, int]]:
    """k consecutive row ranges of a CSR's rows with about equal cost, a row costing its entries plus the mean
    entries per row: every block is padded to the largest one's rows and entries, and on a skewed graph equal
    row counts gave one interval 3.5x the mean entries (R-MAT at 2^20 vertices, P=4 x 4; now about 1.1x), while
    equal entries alone would give intervals of many light rows. Each range holds at least one row."""
    n = indptr.size - 1
    nnz = np.asarray(indptr, np.float64) - indptr[0]
    per_row = np.diff(nnz) + (nnz[-1] / n if n else 0.0)
    mid = np.cumsum(per_row) - per_row / 2     # each row's cost midpoint: a range ends at the nearest row bound
    total = float(per_row.sum())
    bounds = np.searchsorted(mid, total * np.arange(1, k) / k, side="left")
    bounds = np.concatenate([[0], bounds, [n]]).astype(np.int64)
    for i in range(1, k):        # strictly increasing, leaving a row for each later range
        bounds[i] = min(max(bounds[i], bounds[i - 1] + 1), n - (k - i))
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(k)]


def _equal_rows(n: int, k: int, rows: int) -> list[tuple[int, int]]:
    """k consecutive ranges of n rows where every gather runs over the whole block: a tensor task costs its rows,
    so ranges of `rows` rows each (the plan's padded row count) and the remainder last; those need no padding
    rows, and a task that fills its static shape is sent, padded and sliced without a copy (P=4 x 8 at
    ogbn-arxiv's size: cost-balanced ranges held 5,268-5,305 rows, so every task was copied into a padded
    buffer twice). A partition too small for that (METIS's imbalance, hash) gets ranges within a row of equal."""
    if n > (k - 1) * rows:
        bounds = [min(i * rows, n) for i in range(k)] + [n]
    else:
        bounds = [int(b) for b in np.linspace(0, n, k + 1).round()]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


#: a partition's blocks are padded to the plan's largest entry (and column) count divided by a power of this
LADDER = 2.0


def _ladder(sizes: list[int]) -> list[int]:
    """Each partition's padded size: the largest size over all partitions divided by the largest power of LADDER
    that still holds this partition's own. Partitions within 2x of the heaviest share its shape (on a graph of
    even degrees, all of them: jitted kernels compile once); a far lighter one is not padded to it (METIS
    balances vertices, so on a skewed graph one partition can hold most of the entries: R-MAT at 2^20
    vertices, P=4, held 15.0M, 2.2M, 0.28M and 0.28M, and padding all to the first cost 3.4x the entries;
    with the ladder 1.13x)."""
    top = max(sizes)
    out = []
    for z in sizes:
        k = int(np.floor(np.log(top / max(z, 1)) / np.log(LADDER))) if z < top else 0
        while k > 0 and int(np.ceil(top / LADDER ** k)) < z:
            k -= 1
        out.append(int(np.ceil(top / LADDER ** k)))
    return out


def _distinct(ids: np.ndarray, n: int) -> np.ndarray:
    """np.unique(ids) for ids in [0, n), by marking: linear in ids + n instead of a sort (the plan of a graph with
    hundreds of millions of edges sorted each partition's column ids, then each interval's)."""
    mark = np.zeros(n, bool)
    mark[ids] = True
    return np.flatnonzero(mark)


def bucket_size(n: int, factor: float, minimum: int = 16) -> int:
    """The smallest minimum x factor^k that is >= n: sizes rounded up to a geometric grid, so shapes that grow
    a little (a graph that grows between continuous-training rounds) keep the same padded size."""
    size = max(int(minimum), 1)
    while size < n:
        size = int(np.ceil(size * factor))
    return size


def _whole_pads(blocks: list, bucket: float | None) -> tuple[list[int], list[int], list[int]]:
    """Padded (rows, columns, entries) of each partition's whole block: laddered over the partitions as the
    intervals' are (balanced partitions share one shape), then bucketed."""
    pads = [_ladder([b.shape[k] for b in blocks]) for k in (0, 1)] + [_ladder([b.nnz for b in blocks])]
    if bucket is not None:
        pads = [[bucket_size(z, bucket) for z in w] for w in pads]
    return tuple(pads)


def layout_for(stages) -> dict:
    """`build_plan`'s whole / interval_blocks for a model's stages, as the engine builds its plan."""
    whole = any(models.runs_whole(st) for st in stages)
    return {"whole": whole, "interval_blocks": not whole or models.needs_interval_blocks(stages)}


def build_plan(a_norm: sp.csr_matrix, num_parts: int, num_intervals: int, method: str = "metis",
               seed: int = 0, bucket: float | None = None, whole: bool = False,
               interval_blocks: bool = True) -> Plan:
    """Partition a normalized adjacency (with self-loops) and cut each partition into padded intervals.

    Each interval's block holds the in-edges of its rows (GA forward); its transpose, kept inside the block,
    serves ∇GA, whose per-column results go back to the columns' owners (∇SC). bucket (> 1, optional): every
    padded size (rows, columns and entries of the blocks) is rounded up to a power of it (`bucket_size`), so a
    plan of a slightly larger graph has the same shapes and the jitted kernels do not compile again.
    whole: also give every partition one block of all its rows over its column space (`PartitionPlan.block`),
    padded to shapes shared as the intervals' are: an unweighted GA runs over it once per epoch instead of once
    per interval, reading the column store in place where each interval's block read a gathered copy of its
    columns (and its ∇GA summed the intervals' column gradients by a host scatter).
    interval_blocks=False (with whole=True): the intervals keep only their rows (`IntervalPlan.block` is None),
    for models whose every gather runs over the whole block (GCN, GraphSAGE): their blocks were a second copy of
    the adjacency, with its transpose, and cost 22 bytes per entry (R-MAT at 2^20 vertices, P=4 x 4: 0.37 GB of
    arrays; with their construction's transients, the run's peak went from 3.50 to 2.75 GiB without them).
    """
    if num_intervals < 1:
        raise ConfigError(f"intervals must be >= 1, got {num_intervals}")
    if not (interval_blocks or whole):
        raise ValueError("a plan without interval blocks needs the whole blocks (whole=True)")
    a = sp.csr_matrix(a_norm)
    n = a.shape[0]
    parts = assign(a, num_parts, method, seed)
    owned_by = [np.flatnonzero(parts == p).astype(np.int64) for p in range(num_parts)]
    smallest = min(o.size for o in owned_by)
    if num_intervals > smallest:
        raise ConfigError(f"intervals ({num_intervals}) exceeds the smallest partition's {smallest} vertices")
    local_index = np.empty(n, np.int64)
    for o in owned_by:
        local_index[o] = np.arange(o.size)

    equal_rows = -(-max(o.size for o in owned_by) // num_intervals)
    raw = []
    for p, owned in enumerate(owned_by):
        sub = a[owned]
        cols_g = _distinct(sub.indices, n)
        ghosts = cols_g[parts[cols_g] != p]
        # grouped by owner (ids ascending within each): the rows owner q sends land in one contiguous run of the
        # column store, so a ghost exchange copies slices where it scattered and gathered by index
        ghosts = ghosts[np.argsort(parts[ghosts], kind="stable")]
        colspace = np.concatenate([owned, ghosts])
        pos = np.full(n, -1, np.int64)
        pos[colspace] = np.arange(colspace.size)
        blocks = []
        chunks = (_chunks(sub.indptr, num_intervals) if interval_blocks
                  else _equal_rows(owned.size, num_intervals, equal_rows))
        for i, (s, e) in enumerate(chunks):
            lo, hi = sub.indptr[s], sub.indptr[e]
            cols_local = pos[sub.indices[lo:hi]]
            ucols = _distinct(cols_local, colspace.size)
            if not interval_blocks:   # its sizes only: the stats (and the schedule simulator) count in them
                blocks.append((i, s, e, None, ucols.size, hi - lo, None))
                continue
            pos_u = np.empty(colspace.size, np.int32)
            pos_u[ucols] = np.arange(ucols.size, dtype=np.int32)
            blk = sp.csr_matrix((sub.data[lo:hi], pos_u[cols_local], sub.indptr[s:e + 1] - lo),
                                shape=(e - s, ucols.size))
            blocks.append((i, s, e, ucols, ucols.size, hi - lo, blk))
        full = (sp.csr_matrix((sub.data, pos[sub.indices], sub.indptr), shape=(owned.size, colspace.size))
                if whole else None)
        raw.append((p, owned, ghosts, blocks, full))

    rows_pad = max(e - s for *_, bl, _ in raw for _, s, e, *_ in bl)
    cols_pads = _ladder([max(c for *_, c, _, _ in bl) for *_, bl, _ in raw])
    nnz_pads = _ladder([max(z for *_, z, _ in bl) for *_, bl, _ in raw])
    if bucket is not None:
        rows_pad = bucket_size(rows_pad, bucket)
        cols_pads = [bucket_size(c, bucket) for c in cols_pads]
        nnz_pads = [bucket_size(z, bucket) for z in nnz_pads]
    cols_pad, nnz_pad = max(cols_pads), max(nnz_pads)
    whole_pads = _whole_pads([f for *_, f in raw], bucket) if whole else None
    plans = []
    for p, owned, ghosts, blocks, full in raw:
        colspace = np.concatenate([owned, ghosts])
        ghost_owner = parts[ghosts].astype(np.int32)
        intervals = []
        for j, (i, s, e, ucols, ncols, _, blk) in enumerate(blocks):
            if blk is None:
                intervals.append(IntervalPlan(i, s, e, np.zeros(0, np.int64), int(ncols), None,
                                              pad_ids(owned[s:e], rows_pad)))
                continue
            block = Adjacency.from_scipy(blk, row_gids=owned[s:e], col_gids=colspace[ucols], nnz_pad=nnz_pads[p],
                                         rows_pad=rows_pad, cols_pad=cols_pads[p])
            blocks[j] = None  # the scipy block is not needed once padded: the plan never holds both
            cols = np.zeros(cols_pads[p], np.int64)
            cols[: ucols.size] = ucols
            intervals.append(IntervalPlan(i, s, e, cols, int(ucols.size), block, block.row_gids))
        recv = {int(q): np.flatnonzero(ghost_owner == q) for q in np.unique(ghost_owner)}
        block = None
        if full is not None:
            rp, cp, zp = (w[p] for w in whole_pads)
            block = Adjacency.from_scipy(full, row_gids=owned, col_gids=colspace, nnz_pad=zp, rows_pad=rp,
                                         cols_pad=cp, edge_rows=False)
            raw[p] = None
        plans.append(PartitionPlan(p, owned, ghosts, ghost_owner, {}, recv, intervals, block))
    for pp in plans:
        for q, idx in pp.recv.items():
            plans[q].send[pp.partition] = local_index[pp.ghosts[idx]]
    edges_total = a.nnz - n
    cut = int(sum(((parts[a[o].indices] != p)).sum() for p, o in enumerate(owned_by)))
    stats = {
        "partitions": num_parts,
        "intervals": num_intervals,
        "partitioner": method if num_parts > 1 else "none",
        "edge_cut": cut // 2,
        "edge_cut_fraction": (cut / edges_total) if edges_total else 0.0,
        "ghost_ratio": float(sum(pp.ghosts.size for pp in plans) / n),
        "balance": float(max(o.size for o in owned_by) / (n / num_parts)),
        "rows_pad": rows_pad,
        "cols_pad": cols_pad,
        "nnz_pad": nnz_pad,
        "nnz_pads": nnz_pads,
        "cols_pads": cols_pads,
        "padding_overhead": float(num_intervals * sum(nnz_pads) / a.nnz),  # as if every interval had a block
        "interval_blocks": bool(interval_blocks),
    }
    return Plan(parts, plans, rows_pad, cols_pad, nnz_pad, stats)
