"""The pipelined engine's partitions on a stream: kept from round to round, new vertices placed as they arrive.

A stream that trains on the pipelined engine partitions its graph once (METIS, or the config's partitioner) and
keeps that ownership: a vertex never moves between graph servers while the graph grows. Each round, the vertices
that arrived since are placed by linear deterministic greedy (Stanton & Kliot, KDD 2012): a vertex goes to the
partition holding most of its already placed neighbours, weighed by that partition's room under the capacity
``max_balance x n / P``, or to the least loaded one when it has no placed neighbour; vertices are placed in
chunks, so a chunk sees the neighbours placed by the chunks before it. The whole graph is partitioned again only
when the balance (largest partition over the mean) exceeds ``max_balance`` or the fraction of edges cut grows past
``max_cut_growth`` times the fraction right after the last partitioning (plus ``CUT_SLACK``), and the round's
metrics say so (``repartitioned``, ``repartition_reason``).

The ownership is indexed by slot (arrival order, :mod:`.state`), so it extends by appending; a checkpoint holds the
slots placed since the one before (a full copy after a partitioning), and a restored stream continues with it.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from pipelines.engine.partition import PrecomputedAssignment, assign

MAX_BALANCE = 1.10      # re-partition when the largest partition holds more than this x the mean
MAX_CUT_GROWTH = 1.25   # ... or when the edge cut fraction grew past this x its value after the last partitioning
CUT_SLACK = 0.05        # ... plus this share of all edges (a graph that fills in from a few edges, as a replayed one
                        # does, starts from a cut near 0: without it every round re-partitioned)
CHUNKS = 16             # new vertices are placed in this many chunks (at least MIN_CHUNK each)
MIN_CHUNK = 256


def _stats(adj: sp.csr_matrix, parts: np.ndarray, p: int) -> tuple[float, float]:
    """(balance, fraction of the off-diagonal entries whose ends lie in different partitions)."""
    counts = np.bincount(parts, minlength=p)
    balance = float(counts.max() / (parts.size / p)) if parts.size else 1.0
    coo = adj.tocoo()
    off = coo.row != coo.col
    cut = float((parts[coo.row[off]] != parts[coo.col[off]]).mean()) if off.any() else 0.0
    return balance, cut


class Ownership:
    """Partition of every slot for the pipelined engine's rounds (see the module doc)."""

    def __init__(self, partitions: int, method: str = "metis", seed: int = 0, max_balance: float = MAX_BALANCE,
                 max_cut_growth: float = MAX_CUT_GROWTH):
        self.partitions, self.method, self.seed = partitions, method, seed
        self.max_balance, self.max_cut_growth = max_balance, max_cut_growth
        self.parts = np.zeros(0, np.int32)   # by slot
        self.base_cut: float | None = None   # the cut fraction right after the last partitioning
        self.repartitions = 0
        self._saved_upto = 0                 # slots [0, this) are in a checkpoint already
        self._full = True                    # the next checkpoint must hold the whole vector

    # ------------------------------------------------------------------------------------------- rounds
    def assignment(self, adj: sp.csr_matrix, order: np.ndarray) -> tuple[PrecomputedAssignment, dict]:
        """The partition of every vertex of a round's graph (vertex i is slot order[i]; adj without self-loops
        or with, in that vertex order) and the round's partition metrics."""
        n, p = adj.shape[0], self.partitions
        reason = None
        if self.base_cut is None or self.parts.size == 0:
            reason = "initial"
        else:
            rank = np.empty(n, np.int64)
            rank[order] = np.arange(n)
            known = self.parts.size
            parts_g = np.full(n, -1, np.int32)
            old = order < known
            parts_g[old] = self.parts[order[old]]
            new_rows = rank[np.arange(known, n)] if n > known else np.zeros(0, np.int64)
            self._place(adj, parts_g, new_rows)
            balance, cut = _stats(adj, parts_g, p)
            if balance > self.max_balance:
                reason = f"balance {balance:.3f} > {self.max_balance}"
            elif cut > self.base_cut * self.max_cut_growth + CUT_SLACK:
                reason = f"edge cut {cut:.3f} > {self.max_cut_growth} x {self.base_cut:.3f} + {CUT_SLACK}"
            else:
                self.parts = np.concatenate([self.parts, parts_g[new_rows]]).astype(np.int32)
        if reason is not None:
            parts_g = assign(adj, p, self.method, self.seed).astype(np.int32)
            self.parts = np.empty(n, np.int32)
            self.parts[order] = parts_g
            balance, cut = _stats(adj, parts_g, p)
            self.base_cut = cut
            self.repartitions += 1
            self._full = True
        info = {"partition_balance": balance, "edge_cut": cut, "repartitioned": reason is not None,
                "repartition_reason": reason, "repartitions": self.repartitions}
        return PrecomputedAssignment(parts_g, "stream"), info

    def _place(self, adj: sp.csr_matrix, parts_g: np.ndarray, new_rows: np.ndarray) -> None:
        """Linear deterministic greedy over the new rows, chunk by chunk (parts_g: -1 where not placed yet)."""
        p, n = self.partitions, adj.shape[0]
        if new_rows.size == 0:
            return
        loads = np.bincount(parts_g[parts_g >= 0], minlength=p).astype(np.float64)
        cap = self.max_balance * n / p
        sub = sp.csr_matrix(adj[new_rows])
        step = max(MIN_CHUNK, -(-new_rows.size // CHUNKS))
        for s in range(0, new_rows.size, step):
            rows = slice(s, min(s + step, new_rows.size))
            blk = sub[rows]
            placed = parts_g[blk.indices] >= 0
            r = np.repeat(np.arange(blk.shape[0]), np.diff(blk.indptr))[placed]
            counts = np.zeros((blk.shape[0], p))
            np.add.at(counts, (r, parts_g[blk.indices[placed]]), 1.0)
            room = np.maximum(1.0 - loads / cap, 0.0)
            score = counts * room
            choice = np.argmax(score, axis=1).astype(np.int32)
            lonely = score.max(axis=1) <= 0
            if lonely.any():  # no placed neighbour (or only in full partitions): the least loaded, in turn
                order = np.argsort(loads, kind="stable")
                choice[lonely] = order[np.arange(int(lonely.sum())) % p]
            parts_g[new_rows[rows]] = choice
            loads += np.bincount(choice, minlength=p)

    # ------------------------------------------------------------------------------------------- checkpoints
    def checkpoint(self, full: bool = False) -> tuple[int, np.ndarray]:
        """(first slot, partitions from it): what the next checkpoint holds: the slots placed since the last one,
        or everything (a base checkpoint, which starts a new chain, or after a partitioning)."""
        start = 0 if full or self._full else self._saved_upto
        return start, self.parts[start:].copy()

    def saved(self) -> None:
        """The last `checkpoint()` is committed."""
        self._saved_upto, self._full = self.parts.size, False

    def restore(self, pieces: list[tuple[int, np.ndarray]], base_cut: float | None, repartitions: int) -> None:
        """Rebuild from the pieces of a checkpoint chain, in order."""
        parts = np.zeros(0, np.int32)
        for start, arr in pieces:
            parts = np.concatenate([parts[:start], np.asarray(arr, np.int32)])
        self.parts, self.base_cut, self.repartitions = parts, base_cut, repartitions
        self._saved_upto, self._full = parts.size, False
