"""The evolving graph of a stream: growable arrays, batches of events applied column-wise, one `Graph` per round.

Vertices live in *slots* (arrival order): slot-indexed growable arrays hold the id, feature row, label and split;
a sorted copy of the ids maps an id to its slot. Undirected edges are one sorted array of int64 keys
``lo_slot << 32 | hi_slot``. So the state costs a few bytes per edge and one row per vertex, and a batch of
events is applied with sorts and searches over arrays, never a Python step per event.

Ownership is a stable hash of the vertex id (it never changes as the graph grows, so no vertex moves between
partitions when others arrive and the partitions stay balanced in expectation); :meth:`StreamGraph.partition_stats`
reports the balance, the ghosts (remote neighbours) of each partition and the edge cut. (Rounds on the pipelined
engine use :mod:`.ownership` instead: partitioned once by METIS, kept, and extended by neighbourhood.)

Applying a batch (events sorted in (event time, op rank, id) order, as the stream applies them) keeps the
semantics of applying them one by one: a vertex exists for the events after its ``add_vertex``; a second add of a
vertex, an edge to a vertex that does not exist (yet), a label out of range are rejected (feature widths are
checked when the stream takes the events); an edge's
state after each event is decided by that event's op alone (add: present, remove: absent), so the outcome of
every edge event (applied or no-op) follows from the previous valid event on the same edge.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from pipelines.data.graph import Graph
import pyarrow as pa
import pyarrow.compute as pc

from schemas.events import OP_RANK, SPLITS, op_codes, split_codes

SPLIT_CODES = {s: i for i, s in enumerate(SPLITS)}
ADD_VERTEX, UPDATE_FEATURES, ADD_EDGE, REMOVE_EDGE, SET_LABEL = (OP_RANK[k] for k in (
    "add_vertex", "update_features", "add_edge", "remove_edge", "set_label"))
APPLIED, NOOP, REJECTED = 0, 1, 2
DENSE_SPAN, DENSE_MIN = 4, 1 << 16  # the id -> slot array covers ids below 4 x vertices + 64k
GROWTH = 1.5  # capacity growth of the slot arrays (amortized O(1) appends, at most 1/3 unused)


def owner_of(vertex, partitions: int):
    """Partition owning a vertex (or an array of them): a splitmix64 hash of its id, modulo the partition count."""
    scalar = np.isscalar(vertex)
    v = np.atleast_1d(np.asarray(vertex, np.int64)).astype(np.uint64)
    if partitions == 1:
        out = np.zeros(v.shape, np.int64)
    else:
        with np.errstate(over="ignore"):
            z = v + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            out = ((z ^ (z >> np.uint64(31))) % np.uint64(partitions)).astype(np.int64)
    return int(out[0]) if scalar else out


class ApplyError(ValueError):
    """An event cannot be applied to the graph as it stands (e.g. an edge to an unknown vertex)."""


class Applied:
    """What applying a batch did: per event an outcome code (APPLIED, NOOP, REJECTED), the reasons of the
    rejected ones (event position -> text) and the slots whose inputs to the model changed (features or edges)."""

    def __init__(self, outcome: np.ndarray, reasons: dict[int, str], touched: np.ndarray):
        self.outcome = outcome
        self.reasons = reasons
        self.touched = touched


def _grow(a: np.ndarray, need: int) -> np.ndarray:
    if a.shape[0] >= need:
        return a
    cap = max(need, int(a.shape[0] * GROWTH) + 16)
    out = np.zeros((cap,) + a.shape[1:], a.dtype)
    out[:a.shape[0]] = a
    return out


def _keys(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    return (lo.astype(np.int64) << 32) | hi.astype(np.int64)


class StreamGraph:
    """A partitioned graph that grows by batches of events (see the module docstring)."""

    def __init__(self, partitions: int = 1, feature_dim: int | None = None):
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.num_partitions = partitions
        self.feature_dim = feature_dim
        self.n = 0
        self._ids = np.zeros(0, np.int64)                # slot -> vertex id
        self._feat = np.zeros((0, feature_dim or 0), np.float32)
        self._label = np.zeros(0, np.int32)
        self._split = np.zeros(0, np.int8)
        self._sid = np.zeros(0, np.int64)                # sorted ids ...
        self._sslot = np.zeros(0, np.int64)              # ... and their slots
        self.ekeys = np.zeros(0, np.int64)               # sorted undirected edge keys over slots
        # id -> slot by direct indexing while the ids are small non-negative integers (at most DENSE_SPAN x the
        # vertices, int32): a lookup is one gather instead of a binary search that misses the cache at every
        # step; None once an id falls outside (the sorted ids answer then)
        self._dense: np.ndarray | None = np.zeros(0, np.int32)

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def num_vertices(self) -> int:
        return self.n

    @property
    def num_edges(self) -> int:
        return int(self.ekeys.size)

    def slots_of(self, ids) -> np.ndarray:
        """The slot of each id, -1 for ids that are not vertices."""
        ids = np.asarray(ids, np.int64)
        if self._dense is not None:
            d = self._dense
            inside = (ids >= 0) & (ids < d.size)
            return np.where(inside, d[np.where(inside, ids, 0)] if d.size else -1, -1).astype(np.int64)
        pos = np.searchsorted(self._sid, ids)
        pos_c = np.minimum(pos, max(self._sid.size - 1, 0))
        found = (pos < self._sid.size) & (self._sid[pos_c] == ids) if self._sid.size else np.zeros(ids.shape, bool)
        return np.where(found, self._sslot[pos_c] if self._sid.size else -1, -1)

    def has_vertex(self, v: int) -> bool:
        return bool(self.slots_of([v])[0] >= 0)

    def has_edge(self, u: int, v: int) -> bool:
        s = self.slots_of([u, v])
        if (s < 0).any():
            return False
        k = _keys(s[:1], s[1:])[0]
        i = np.searchsorted(self.ekeys, k)
        return bool(i < self.ekeys.size and self.ekeys[i] == k)

    def owner(self, v):
        return owner_of(v, self.num_partitions)

    def nbytes(self) -> int:
        """Bytes held by the state's arrays (capacity included)."""
        return sum(a.nbytes for a in (self._ids, self._feat, self._label, self._split, self._sid, self._sslot,
                                      self.ekeys)) + (self._dense.nbytes if self._dense is not None else 0)

    # ------------------------------------------------------------------------------------------------ apply
    def _exists_at(self, slot: np.ndarray, since: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Whether the vertex in `slot` exists just before event position `pos` (since: the position of its
        add in this batch, -1 for vertices that existed before it)."""
        ok = slot >= 0
        return ok & (since[np.where(ok, slot, 0)] < pos)

    def apply(self, code, vertex, dst, features, label, split, num_classes: int | None = None) -> Applied:
        """Apply a batch of events, given column-wise in application order.

        code: int8 op codes (:data:`schemas.events.OP_RANK`); vertex/dst: int64 (dst -1 where none);
        features: a 2-D float32 array with one row per add_vertex/update_features event, in order (or None when
        there are none);
        label: int32 (-1 where none); split: int8 split codes; num_classes: labels must lie below it."""
        code = np.asarray(code, np.int8)
        vertex = np.asarray(vertex, np.int64)
        dst = np.asarray(dst, np.int64)
        n = code.size
        outcome = np.full(n, APPLIED, np.int8)
        reasons: dict[int, str] = {}
        pos = np.arange(n)

        def reject(mask: np.ndarray, reason) -> None:
            for i in np.flatnonzero(mask & (outcome != REJECTED)):
                reasons[int(i)] = reason(int(i))
            outcome[mask] = REJECTED

        # vertices: a new id's first add is applied, every other add is a second add
        adds = np.flatnonzero(code == ADD_VERTEX)
        known = self.slots_of(vertex[adds]) >= 0
        _, first = np.unique(vertex[adds], return_index=True)
        new = np.zeros(adds.size, bool)
        new[first] = True
        new &= ~known
        has_row = (code == ADD_VERTEX) | (code == UPDATE_FEATURES)
        row_of = np.cumsum(has_row) - 1  # event position -> its row in `features`
        if has_row.any():
            if features is None or features.ndim != 2 or features.shape[0] != int(has_row.sum()):
                raise ValueError("features must hold one row per add_vertex/update_features event")
            if self.feature_dim is None:
                self.feature_dim = int(features.shape[1])
                self._feat = np.zeros((self._feat.shape[0], self.feature_dim), np.float32)
            if features.shape[1] != self.feature_dim:
                raise ValueError(f"feature rows have {features.shape[1]} values, the graph {self.feature_dim}")
        reject(np.isin(pos, adds[~new]), lambda i: f"vertex {vertex[i]} already exists")
        new_pos = adds[new]
        first_new_slot = self.n
        self._add_slots(vertex[new_pos])
        since = np.full(self.n, -1, np.int64)
        since[first_new_slot:] = new_pos
        if new_pos.size:
            self._feat[first_new_slot:self.n] = features[row_of[new_pos]]
        # feature updates and labels: the vertex must exist; the last valid event per vertex wins
        s_v = self.slots_of(vertex)
        exists_v = self._exists_at(s_v, since, pos)
        upd = code == UPDATE_FEATURES
        reject(upd & ~exists_v, lambda i: f"unknown vertex {vertex[i]}")
        lab = code == SET_LABEL
        reject(lab & ~exists_v, lambda i: f"unknown vertex {vertex[i]}")
        label = np.asarray(label, np.int32)
        if num_classes is not None:
            reject(lab & (label >= num_classes), lambda i: f"label {label[i]} out of range [-1, {num_classes})")
        for mask, write in ((upd & (outcome == APPLIED), "features"), (lab & (outcome == APPLIED), "label")):
            idx = np.flatnonzero(mask)
            if idx.size:
                last = idx.size - 1 - np.unique(s_v[idx][::-1], return_index=True)[1]
                sel = idx[last]
                if write == "features":
                    self._feat[s_v[sel]] = features[row_of[sel]]
                else:
                    self._label[s_v[sel]] = label[sel]
                    self._split[s_v[sel]] = np.asarray(split, np.int8)[sel]
        # edges: both ends must exist; then each event's outcome follows from the previous one on its edge
        edge = (code == ADD_EDGE) | (code == REMOVE_EDGE)
        s_d = self.slots_of(dst)
        reject(edge & ~exists_v, lambda i: f"unknown vertex {vertex[i]}")
        reject(edge & (vertex == dst), lambda i: f"self-loop {vertex[i]}-{dst[i]} (self-loops are not stored)")
        reject(edge & ~self._exists_at(s_d, since, pos), lambda i: f"unknown vertex {dst[i]}")
        eidx = np.flatnonzero(edge & (outcome == APPLIED))
        touched = [s_v[new_pos], s_v[np.flatnonzero(upd & (outcome == APPLIED))]]
        if eidx.size:
            changed = self._apply_edges(eidx, code, s_v, s_d)
            outcome[eidx[~changed]] = NOOP
            ch = eidx[changed]
            touched += [s_v[ch], s_d[ch]]
        mark = np.zeros(self.n, bool)  # (a mask, not np.unique: numpy's hash-based unique is slow on big batches)
        for t_ in touched:
            mark[t_] = True
        touched = np.flatnonzero(mark)
        return Applied(outcome, reasons, touched)

    def apply_table(self, t: pa.Table, num_classes: int | None = None) -> tuple[np.ndarray, Applied, np.ndarray]:
        """Apply a table of events (:data:`schemas.events.EVENT_SCHEMA`) in (event time, op rank, id) order;
        returns that order (positions in `t`), what applying did and the op codes (both in that order).
        Only the sort keys are sorted; the columns are gathered as numpy arrays (the table is not reordered)."""
        code_t = op_codes(t)
        order = pc.sort_indices(t.select(["event_time", "event_id"]).append_column("_rank", pa.array(code_t)),
                                sort_keys=[("event_time", "ascending"), ("_rank", "ascending"),
                                           ("event_id", "ascending")]).to_numpy()
        code = code_t[order]
        rows_t = (code_t == ADD_VERTEX) | (code_t == UPDATE_FEATURES)
        feats = None
        if rows_t.any():
            flat = pc.list_flatten(t.column("features").filter(pa.array(rows_t))).to_numpy()
            feats_t = flat.astype(np.float32, copy=False).reshape(int(rows_t.sum()), -1)
            feats = feats_t[(np.cumsum(rows_t) - 1)[order[rows_t[order]]]]  # the rows in application order

        def col(name, fill=None):
            c = t.column(name)
            return (pc.fill_null(c, fill) if fill is not None else c).to_numpy()[order]

        res = self.apply(code, col("vertex"), col("dst", -1), feats, col("label", -1), split_codes(t)[order],
                         num_classes)
        return order, res, code

    def _apply_edges(self, eidx: np.ndarray, code: np.ndarray, s_v: np.ndarray, s_d: np.ndarray) -> np.ndarray:
        """Apply the valid edge events at positions `eidx` (in order); returns which of them changed the graph.
        An edge's state after an event is the event's op (add: present, remove: absent), so each event's
        effect follows from the previous event on the same edge, or from the graph for the first."""
        keys = _keys(s_v[eidx], s_d[eidx])
        order = np.argsort(keys, kind="stable")        # by edge, then by position
        k, is_add = keys[order], code[eidx][order] == ADD_EDGE
        start = np.ones(k.size, bool)
        start[1:] = k[1:] != k[:-1]
        at = np.searchsorted(self.ekeys, k)
        initial = (at < self.ekeys.size) & (self.ekeys[np.minimum(at, max(self.ekeys.size - 1, 0))] == k) \
            if self.ekeys.size else np.zeros(k.size, bool)
        prior = np.where(start, initial, np.roll(is_add, 1))
        end = np.ones(k.size, bool)
        end[:-1] = start[1:]
        final, init_k, kk = is_add[end], initial[end], k[end]
        gone, born = kk[init_k & ~final], kk[~init_k & final]
        if gone.size:
            self.ekeys = np.delete(self.ekeys, np.searchsorted(self.ekeys, gone))
        if born.size:
            self.ekeys = np.insert(self.ekeys, np.searchsorted(self.ekeys, born), born)
        changed = np.empty(k.size, bool)
        changed[order] = is_add != prior
        return changed

    def _add_slots(self, ids: np.ndarray) -> None:
        m = ids.size
        if m == 0:
            return
        need = self.n + m
        self._ids, self._label, self._split = _grow(self._ids, need), _grow(self._label, need), _grow(self._split, need)
        self._feat = _grow(self._feat, need)
        self._ids[self.n:need] = ids
        self._label[self.n:need] = -1
        self._split[self.n:need] = 0
        slots = np.arange(self.n, need, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ins = np.searchsorted(self._sid, ids[order])
        self._sid = np.insert(self._sid, ins, ids[order])
        self._sslot = np.insert(self._sslot, ins, slots[order])
        self.n = need
        if self._dense is not None:
            top = int(ids.max())
            if int(ids.min()) < 0 or top >= DENSE_SPAN * need + DENSE_MIN or need >= 1 << 31:
                self._dense = None
            else:
                if top >= self._dense.size:
                    d = np.full(max(top + 1, int(self._dense.size * GROWTH) + 16), -1, np.int32)
                    d[:self._dense.size] = self._dense
                    self._dense = d
                self._dense[ids] = slots

    # --------------------------------------------------------------------------- one event at a time (tests)
    def _one(self, code: int, v: int, dst: int = -1, features=None, label: int = -1, split="none") -> bool:
        f = None if features is None else np.asarray(features, np.float32).reshape(1, -1)
        if f is not None and self.feature_dim is not None and f.shape[1] != self.feature_dim:
            raise ApplyError(f"feature row has {f.shape[1]} values, expected {self.feature_dim}")
        sc = split if isinstance(split, (int, np.integer)) else SPLIT_CODES[split or "none"]
        r = self.apply([code], [v], [dst], f, [label], [sc])
        if r.outcome[0] == REJECTED:
            raise ApplyError(r.reasons[0])
        return bool(r.outcome[0] == APPLIED)

    def add_vertex(self, v: int, features) -> bool:
        return self._one(ADD_VERTEX, v, features=features)

    def update_features(self, v: int, features) -> bool:
        return self._one(UPDATE_FEATURES, v, features=features)

    def set_label(self, v: int, label: int, split: str | int = "none") -> bool:
        return self._one(SET_LABEL, v, label=int(label), split=split)

    def add_edge(self, u: int, v: int) -> bool:
        return self._one(ADD_EDGE, u, v)

    def remove_edge(self, u: int, v: int) -> bool:
        return self._one(REMOVE_EDGE, u, v)

    # ------------------------------------------------------------------------------------------ materialize
    def order(self) -> np.ndarray:
        """Slots in vertex-id order (vertex i of a materialized graph is slot order()[i])."""
        return self._sslot

    def edge_slots(self) -> tuple[np.ndarray, np.ndarray]:
        return (self.ekeys >> 32), (self.ekeys & 0xFFFFFFFF)

    def arrays(self) -> dict[str, np.ndarray]:
        """The whole graph state as arrays (vertices sorted by id; each undirected edge once, src < dst by id)."""
        o = self._sslot
        lo, hi = self.edge_slots()
        a, b = self._ids[lo], self._ids[hi]
        return {"vertex": self._ids[o], "features": self._feat[o], "label": self._label[o],
                "split": self._split[o], "src": np.minimum(a, b), "dst": np.maximum(a, b)}

    @classmethod
    def from_arrays(cls, arrays, partitions: int, feature_dim: int | None = None) -> "StreamGraph":
        feats = np.asarray(arrays["features"], np.float32)
        dim = feature_dim if feature_dim is not None else (int(feats.shape[1]) if feats.ndim == 2 and
                                                           feats.shape[0] else None)
        g = cls(partitions, dim)
        ids = np.asarray(arrays["vertex"], np.int64)
        if dim is not None:
            g._feat = np.zeros((0, dim), np.float32)
        g._add_slots(ids)
        if ids.size:
            g._feat[:g.n] = feats.reshape(ids.size, -1)
        g._label[:g.n] = np.asarray(arrays["label"], np.int32)
        g._split[:g.n] = np.asarray(arrays["split"], np.int8)
        src, dst = np.asarray(arrays["src"], np.int64), np.asarray(arrays["dst"], np.int64)
        g.ekeys = np.unique(_keys(g.slots_of(src), g.slots_of(dst)))
        return g

    def materialize(self, name: str, num_classes: int) -> tuple[Graph, np.ndarray]:
        """An immutable Graph of the current state (vertex i is the i-th smallest id) and the id array."""
        n = self.n
        rank = np.empty(n, np.int64)
        rank[self._sslot] = np.arange(n)
        lo, hi = self.edge_slots()
        s, d = rank[lo], rank[hi]
        rows = np.concatenate([s, d]).astype(np.int32)
        cols = np.concatenate([d, s]).astype(np.int32)
        adj = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, cols)), shape=(n, n))
        adj.sort_indices()
        o = self._sslot
        labels, split = self._label[o], self._split[o]
        has = labels >= 0
        g = Graph(name, adj, self._feat[o], labels, has & (split == 1), has & (split == 2), has & (split == 3),
                  int(num_classes))
        return g, self._ids[o]

    def partition_stats(self) -> dict:
        """Vertices owned and ghosts held per partition, and the share of edges cut by the ownership."""
        p = self.num_partitions
        own = owner_of(self._ids[:self.n], p) if self.n else np.zeros(0, np.int64)
        owned = np.bincount(own, minlength=p)
        lo, hi = self.edge_slots()
        cut = own[lo] != own[hi] if lo.size else np.zeros(0, bool)
        ghosts = np.zeros(p, np.int64)
        if cut.any():  # a cut edge makes each end a ghost of the other's owner
            pairs = np.unique(np.concatenate([own[lo[cut]] * (self.n + 1) + hi[cut],
                                              own[hi[cut]] * (self.n + 1) + lo[cut]]))
            ghosts = np.bincount(pairs // (self.n + 1), minlength=p)
        mean = max(self.n / p, 1e-9)
        return {"owned": owned.tolist(), "ghosts": ghosts.tolist(), "balance": float(owned.max() / mean) if self.n
                else 1.0, "edge_cut": float(cut.mean()) if cut.size else 0.0}

    def check_invariants(self) -> None:
        """Edge keys sorted, unique, between distinct existing slots; the id index consistent (tests)."""
        k = self.ekeys
        assert np.all(np.diff(k) > 0), "edge keys not sorted/unique"
        lo, hi = self.edge_slots()
        assert np.all(lo < hi) and (hi < self.n).all(), "edge key out of range"
        assert np.all(np.diff(self._sid) > 0) and np.array_equal(self._ids[self._sslot], self._sid)
        assert self._sid.size == self.n
