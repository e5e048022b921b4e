"""The evolving graph of a stream: partitioned, mutable, materialized into an immutable `Graph` per round.

Ownership is a stable hash of the vertex id (it never changes as the graph grows, so no vertex moves between
partitions when others arrive). Each partition holds, for the vertices it owns, the feature row, the label and
split, and the neighbour set; for the remote neighbours of its vertices (ghosts) it holds a reference count
and a mirror of their feature rows. An event goes to the partition that owns its vertex; an edge event to
both endpoints' owners; a feature change of a vertex is pushed to every partition that holds it as a ghost.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from pipelines.data.graph import Graph

SPLIT_CODES = {"none": 0, "train": 1, "val": 2, "test": 3}


def owner_of(vertex: int, partitions: int) -> int:
    """Partition owning a vertex: a splitmix64 hash of its id, modulo the partition count."""
    if partitions == 1:
        return 0
    z = (int(vertex) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) % partitions


@dataclasses.dataclass
class PartitionStore:
    """What one partition (graph server) keeps of the evolving graph."""

    partition: int
    features: dict = dataclasses.field(default_factory=dict)       # owned vertex -> float32 row
    labels: dict = dataclasses.field(default_factory=dict)         # owned vertex -> class (-1: none)
    splits: dict = dataclasses.field(default_factory=dict)         # owned vertex -> split code
    adj: dict = dataclasses.field(default_factory=dict)            # owned vertex -> set of neighbours
    ghosts: dict = dataclasses.field(default_factory=dict)         # remote neighbour -> reference count
    ghost_features: dict = dataclasses.field(default_factory=dict)  # remote neighbour -> mirrored row

    @property
    def num_owned(self) -> int:
        return len(self.features)


class ApplyError(ValueError):
    """An event cannot be applied to the graph as it stands (e.g. an edge to an unknown vertex)."""


class StreamGraph:
    """A partitioned mutable graph. `apply_*` methods return True when the graph changed, False for a no-op,
    and raise ApplyError for an event the graph rejects."""

    def __init__(self, partitions: int = 1, feature_dim: int | None = None):
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.num_partitions = partitions
        self.feature_dim = feature_dim
        self.parts = [PartitionStore(p) for p in range(partitions)]
        self._owner: dict[int, int] = {}
        self.num_edges = 0  # undirected

    # ------------------------------------------------------------------------------------------------ queries
    def owner(self, v: int) -> int:
        return owner_of(v, self.num_partitions)

    def has_vertex(self, v: int) -> bool:
        return v in self.parts[self.owner(v)].features

    def has_edge(self, u: int, v: int) -> bool:
        s = self.parts[self.owner(u)].adj.get(u)
        return s is not None and v in s

    @property
    def num_vertices(self) -> int:
        return sum(p.num_owned for p in self.parts)

    # ------------------------------------------------------------------------------------------------ updates
    def _need(self, v: int) -> PartitionStore:
        st = self.parts[self.owner(v)]
        if v not in st.features:
            raise ApplyError(f"unknown vertex {v}")
        return st

    def _row(self, features) -> np.ndarray:
        row = np.array(features, dtype=np.float32).ravel()
        if self.feature_dim is None:
            self.feature_dim = row.size
        if row.size != self.feature_dim:
            raise ApplyError(f"feature row has {row.size} values, expected {self.feature_dim}")
        return row

    def add_vertex(self, v: int, features) -> bool:
        st = self.parts[self.owner(v)]
        if v in st.features:
            raise ApplyError(f"vertex {v} already exists")
        st.features[v] = self._row(features)
        st.labels[v] = -1
        st.splits[v] = 0
        st.adj[v] = set()
        return True

    def update_features(self, v: int, features) -> bool:
        st = self._need(v)
        row = self._row(features)
        st.features[v] = row
        for q in self.parts:  # the ghost copies of v, wherever v is a ghost
            if v in q.ghosts:
                q.ghost_features[v] = row
        return True

    def set_label(self, v: int, label: int, split: str | int = "none") -> bool:
        st = self._need(v)
        code = split if isinstance(split, int) else SPLIT_CODES[split or "none"]
        changed = st.labels[v] != label or st.splits[v] != code
        st.labels[v] = int(label)
        st.splits[v] = int(code)
        return changed

    def _link(self, st: PartitionStore, u: int, v: int) -> None:
        st.adj[u].add(v)
        if self.owner(v) != st.partition:
            c = st.ghosts.get(v, 0)
            st.ghosts[v] = c + 1
            if c == 0:
                st.ghost_features[v] = self.parts[self.owner(v)].features[v]

    def _unlink(self, st: PartitionStore, u: int, v: int) -> None:
        st.adj[u].discard(v)
        if self.owner(v) != st.partition:
            c = st.ghosts[v] - 1
            if c:
                st.ghosts[v] = c
            else:
                del st.ghosts[v]
                del st.ghost_features[v]

    def add_edge(self, u: int, v: int) -> bool:
        if u == v:
            raise ApplyError(f"self-loop {u}-{v} (self-loops are not stored)")
        su, sv = self._need(u), self._need(v)
        if v in su.adj[u]:
            return False
        self._link(su, u, v)
        self._link(sv, v, u)
        self.num_edges += 1
        return True

    def remove_edge(self, u: int, v: int) -> bool:
        su, sv = self._need(u), self._need(v)
        if v not in su.adj[u]:
            return False
        self._unlink(su, u, v)
        self._unlink(sv, v, u)
        self.num_edges -= 1
        return True

    # ------------------------------------------------------------------------------------------ materialize
    def vertex_ids(self) -> np.ndarray:
        ids = [np.fromiter(p.features.keys(), np.int64, len(p.features)) for p in self.parts]
        return np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)

    def arrays(self) -> dict[str, np.ndarray]:
        """The whole graph state as arrays (vertices sorted by id; each undirected edge once, src < dst)."""
        ids = self.vertex_ids()
        n = ids.size
        dim = self.feature_dim or 0
        feats = np.zeros((n, dim), np.float32)
        labels = np.full(n, -1, np.int32)
        splits = np.zeros(n, np.int8)
        src, dst = [], []
        for st in self.parts:
            if not st.features:
                continue
            own = np.fromiter(st.features.keys(), np.int64, len(st.features))
            idx = np.searchsorted(ids, own)
            if dim:
                feats[idx] = np.stack([st.features[v] for v in own.tolist()])
            labels[idx] = np.fromiter((st.labels[v] for v in own.tolist()), np.int32, own.size)
            splits[idx] = np.fromiter((st.splits[v] for v in own.tolist()), np.int8, own.size)
            for u, nb in st.adj.items():
                if nb:
                    a = np.fromiter(nb, np.int64, len(nb))
                    a = a[a > u]
                    src.append(np.full(a.size, u, np.int64))
                    dst.append(a)
        src = np.concatenate(src) if src else np.zeros(0, np.int64)
        dst = np.concatenate(dst) if dst else np.zeros(0, np.int64)
        return {"vertex": ids, "features": feats, "label": labels, "split": splits, "src": src, "dst": dst}

    @classmethod
    def from_arrays(cls, arrays, partitions: int, feature_dim: int | None = None) -> "StreamGraph":
        g = cls(partitions, feature_dim)
        feats = np.asarray(arrays["features"], np.float32)
        if g.feature_dim is None and feats.ndim == 2 and feats.shape[0]:
            g.feature_dim = int(feats.shape[1])
        for v, row, lab, spl in zip(np.asarray(arrays["vertex"]).tolist(), feats,
                                    np.asarray(arrays["label"]).tolist(), np.asarray(arrays["split"]).tolist()):
            g.add_vertex(v, row)
            g.set_label(v, int(lab), int(spl))
        for u, v in zip(np.asarray(arrays["src"]).tolist(), np.asarray(arrays["dst"]).tolist()):
            g.add_edge(u, v)
        return g

    def materialize(self, name: str, num_classes: int) -> tuple[Graph, np.ndarray]:
        """An immutable Graph of the current state (vertex i is the i-th smallest id) and the id array."""
        a = self.arrays()
        ids = a["vertex"]
        n = ids.size
        s = np.searchsorted(ids, a["src"])
        d = np.searchsorted(ids, a["dst"])
        rows = np.concatenate([s, d])
        cols = np.concatenate([d, s])
        adj = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, cols.astype(np.int32))), shape=(n, n))
        adj.sort_indices()
        labels = a["label"]
        split = a["split"]
        has = labels >= 0
        g = Graph(name, adj, a["features"], labels, has & (split == 1), has & (split == 2), has & (split == 3),
                  int(num_classes))
        return g, ids

    def check_invariants(self) -> None:
        """Symmetric adjacency, ghost reference counts and ghost feature mirrors consistent (tests)."""
        edges = 0
        for st in self.parts:
            want: dict[int, int] = {}
            for u, nb in st.adj.items():
                assert self.owner(u) == st.partition
                for v in nb:
                    assert u in self.parts[self.owner(v)].adj[v], f"edge {u}-{v} not symmetric"
                    if u < v:
                        edges += 1
                    if self.owner(v) != st.partition:
                        want[v] = want.get(v, 0) + 1
            assert want == st.ghosts, f"partition {st.partition}: ghost counts differ"
            for v, row in st.ghost_features.items():
                assert np.array_equal(row, self.parts[self.owner(v)].features[v]), f"stale ghost {v}"
            assert set(st.ghost_features) == set(st.ghosts)
        assert edges == self.num_edges
