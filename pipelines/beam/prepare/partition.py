"""AssignPartitions and Symmetrize: the partition of every vertex, and both directions of every edge routed to
the partition that owns the entry's destination (the graph server that gathers over it)."""
from __future__ import annotations

import array

import numpy as np

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.io.filesystems import FileSystems

from pipelines.beam.combiners import SAMPLES, ConcatArrays, stat_outputs
from pipelines.beam.prepare.read_edges import INT_RE
from pipelines.beam.prepare.spill import spill
from pipelines.data.graph import clean_adjacency
from pipelines.engine.partition import assign

PARTITIONERS = ("hash", "metis", "file")


class Assignment:
    """The partition of every vertex: ``v % parts`` (hash, no vector) or an explicit int32 vector [N]."""

    def __init__(self, parts: int, vector: np.ndarray | None = None, method: str = "hash"):
        self.parts = int(parts)
        self.vector = None if vector is None else np.asarray(vector, np.int32)
        self.method = method

    def of(self, ids: np.ndarray) -> np.ndarray:
        if self.vector is None:
            return (np.asarray(ids) % self.parts).astype(np.int32)
        return self.vector[ids]

    def owned(self, partition: int, num_nodes: int) -> np.ndarray:
        """Sorted int64 ids of the vertices ``partition`` owns."""
        if self.vector is None:
            return np.arange(partition, num_nodes, self.parts, dtype=np.int64)
        return np.flatnonzero(self.vector[:num_nodes] == partition).astype(np.int64)


def by_partition(parts: np.ndarray, num_parts: int, *arrays):
    """(p, arrays restricted to partition p) for every partition with rows (one array: the array itself)."""
    if num_parts == 1:
        if arrays[0].size:
            yield 0, arrays if len(arrays) > 1 else arrays[0]
        return
    order = np.argsort(parts, kind="stable")
    bounds = np.zeros(num_parts + 1, np.int64)
    np.cumsum(np.bincount(parts, minlength=num_parts), out=bounds[1:])
    sorted_arrays = [a[order] for a in arrays]
    for p in range(num_parts):
        lo, hi = bounds[p], bounds[p + 1]
        if hi > lo:
            sel = tuple(a[lo:hi] for a in sorted_arrays)
            yield p, sel if len(sel) > 1 else sel[0]


class _Metis(beam.DoFn):
    """All valid edges (collected) -> Assignment by METIS on the symmetric graph: the same call, on the same CSR,
    as the engine's ``pipelines.engine.partition.assign(..., "metis", seed)``, so both agree for a seed."""

    def __init__(self, parts: int, seed: int):
        self.parts, self.seed = parts, seed

    def process(self, columns, num_nodes):
        src, dst = columns
        n = int(num_nodes)
        if self.parts == 1 or n == 0:
            yield Assignment(self.parts, np.zeros(n, np.int32), "metis")
            return
        if self.parts > n:
            yield from stat_outputs("assignment_errors", 1, [f"--partitions {self.parts} exceeds the {n} vertices"])
            yield Assignment(self.parts, np.zeros(n, np.int32), "metis")
            return
        adj = clean_adjacency(src, dst, n)
        yield Assignment(self.parts, assign(adj, self.parts, "metis", self.seed), "metis")


class _Errors:
    """A count of problems with the first SAMPLES of their messages."""

    def __init__(self):
        self.count, self.samples = 0, []

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.samples) < SAMPLES:
            self.samples.append(message)


class _ReadAssignment(beam.DoFn):
    """A METIS-style partition file (line i = the partition of vertex i) -> Assignment (+ assignment_errors)."""

    def __init__(self, path: str, parts: int):
        self.path = path
        self.parts = parts

    def process(self, _, num_nodes):
        n = int(num_nodes)
        values = array.array("q")
        errors = _Errors()
        with FileSystems.open(self.path) as f:
            for lineno, raw in enumerate(f, start=1):
                body = raw.decode("utf-8", errors="replace").split("#", 1)[0].strip()
                if not body:
                    continue
                if not INT_RE.fullmatch(body):
                    errors.add(f"{self.path}:{lineno}: not an integer: {body!r}")
                    values.append(0)
                    continue
                part = int(body)
                if not 0 <= part < self.parts:
                    errors.add(f"{self.path}:{lineno}: partition {part} out of range [0, {self.parts})")
                    part = 0
                values.append(part)
        if len(values) != n:
            errors.add(f"{self.path}: {len(values)} partition ids for {n} vertices (one line per vertex)")
        vec = np.zeros(n, np.int32)
        got = np.frombuffer(values, np.int64)[:n]
        vec[:got.size] = got
        yield from stat_outputs("assignment_errors", errors.count, errors.samples)
        yield Assignment(self.parts, vec, "file")


class AssignPartitions(beam.PTransform):
    """{'edges': (src, dst) arrays, 'num_nodes'} -> {'assignment': one Assignment, 'stats': Stat or None}.

    hash: ``v % P``; metis: METIS on the whole symmetric graph (collected in one worker), seeded;
    file: a METIS-style assignment file, line i = the partition of vertex i.
    """

    def __init__(self, method: str, parts: int, assignment: str | None = None, seed: int = 0):
        super().__init__()
        if method not in PARTITIONERS:
            raise ValueError(f"unknown partitioner {method!r}")
        self.method, self.parts, self.assignment, self.seed = method, int(parts), assignment, int(seed)

    def expand(self, inputs):
        n = pvalue.AsSingleton(inputs["num_nodes"])
        if self.method == "hash":
            return {"assignment": inputs["num_nodes"].pipeline | "Hash" >> beam.Create([Assignment(self.parts)]),
                    "stats": None}
        if self.method == "metis":
            out = (
                inputs["edges"]
                | "Collect" >> beam.CombineGlobally(ConcatArrays((np.int32, np.int32)))
                | "Metis" >> beam.ParDo(_Metis(self.parts, self.seed), num_nodes=n).with_outputs(
                    "stats", main="assignment")
            )
        else:
            out = (
                inputs["num_nodes"].pipeline
                | "Impulse" >> beam.Impulse()
                | "Read" >> beam.ParDo(_ReadAssignment(self.assignment, self.parts), num_nodes=n)
                .with_outputs("stats", main="assignment")
            )
        return {"assignment": out.assignment, "stats": out.stats}


# Edge entries travel as packed uint64 keys: dst << 33 | src << 1 | forward (ids < 2**31), so that sorting them
# sorts by (dst, src) and one np.sort deduplicates a partition's entries.
_ONE = np.uint64(1)
_SHIFT_DST = np.uint64(33)
_LOW32 = np.uint64(0xFFFFFFFF)


def entry_keys(dst: np.ndarray, src: np.ndarray, forward: int) -> np.ndarray:
    """Packed uint64 entries: dst << 33 | src << 1 | forward (ids < 2**31). Sorting them sorts by (dst, src)."""
    keys = (dst.astype(np.uint64) << _SHIFT_DST) | (src.astype(np.uint64) << _ONE)
    if forward:
        keys |= _ONE
    return keys


def entry_pairs(keys: np.ndarray) -> np.ndarray:
    """The (dst, src) pair of packed entries without the forward bit (dst << 32 | src)."""
    return keys >> _ONE


def entry_forward(keys: np.ndarray) -> np.ndarray:
    """1 where a packed entry is the record's own direction, else 0 (uint64)."""
    return keys & _ONE


def unpack_pairs(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int32 (dst, src) of :func:`entry_pairs` values."""
    return (pairs >> np.uint64(32)).astype(np.int32), (pairs & _LOW32).astype(np.int32)


class _Route(beam.DoFn):
    def __init__(self, root: str):
        self.root = root

    def process(self, edges, assignment):
        src, dst = edges
        # the record's own direction (forward bit set: repeats of it are duplicates) and its reverse
        keys = np.concatenate([entry_keys(dst, src, 1), entry_keys(src, dst, 0)])
        heads = np.concatenate([dst, src])
        yield from stat_outputs("routed:entries", keys.size)
        for p, part in by_partition(assignment.of(heads), assignment.parts, keys):
            yield p, (spill(self.root, "entries", p, part), part.size)   # the keys stay out of the shuffle


class Symmetrize(beam.PTransform):
    """(src, dst) edge arrays -> {'entries': (partition, (spill path, count)), 'stats'}: both directions of every
    edge as uint64 entry keys, routed to the partition that owns the entry's destination; each chunk's keys of a
    partition are spilled under ``root`` (:mod:`pipelines.beam.prepare.spill`). Deduplication happens there
    (:class:`pipelines.beam.prepare.shards.BuildPartitions`): a record repeating an earlier one in the same
    direction counts as a duplicate (its reverse does not)."""

    def __init__(self, assignment, root: str):
        super().__init__()
        self.assignment, self.root = assignment, root

    def expand(self, edges):
        out = edges | "BothDirections" >> beam.ParDo(
            _Route(self.root), assignment=pvalue.AsSingleton(self.assignment)).with_outputs("stats", main="entries")
        return {"entries": out.entries, "stats": out.stats}
