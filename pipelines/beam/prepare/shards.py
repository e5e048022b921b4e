"""BuildPartitions and WriteEdgeShards: each partition's deduplicated entries and vertex rows -> its vertex
shard, then its edge shard weighted with Â = D^-1/2 (A + I) D^-1/2 (the degree vector as a side input)."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import apache_beam as beam
from apache_beam import pvalue

from pipelines.beam.combiners import SAMPLES, ConcatArrays, Stat, stat_outputs
from pipelines.beam.prepare.partition import entry_keys
from pipelines.beam.prepare.spill import load, spill
from pipelines.beam.prepare.tables import TABLES
from pipelines.beam.writers import shard_name, write_table
from pipelines.data.registry import sha256_file
from schemas import files as file_schemas
from schemas.files import SPLIT_CODES, SPLIT_NAMES

EDGE_SCHEMA = file_schemas.EDGE_SHARD_SCHEMA.with_metadata(
    {**file_schemas.EDGE_SHARD_SCHEMA.metadata, b"dorylus.normalization": b"gcn-sym-self-loops"})


def vertex_schema(feature_dim: int) -> pa.Schema:
    """schemas.files.vertex_shard_schema(F); without the features column when F = 0."""
    if feature_dim > 0:
        return file_schemas.vertex_shard_schema(feature_dim)
    schema = file_schemas.vertex_shard_schema(1)
    return schema.remove(schema.get_field_index("features"))


def _low_bits(keys: np.ndarray) -> np.ndarray:
    """bool [n]: the lowest bit of every uint64 key, read from its low byte without a full-size temporary."""
    return (keys.view(np.uint8)[::8] & 1).view(bool)


def _load_keys(spilled, owned: np.ndarray) -> np.ndarray:
    """One uint64 array of a partition's spilled entry keys and a self-loop per owned vertex, filled in place."""
    spilled = list(spilled)
    keys = np.empty(sum(int(n) for _, n in spilled) + owned.size, "<u8")   # little-endian: see _low_bits
    at = 0
    for path, n in spilled:
        keys[at:at + int(n)] = load(path)[0]
        at += int(n)
    keys[at:] = entry_keys(owned, owned, 0)
    return keys


def dedupe(spilled, owned: np.ndarray):
    """Sorted unique (dst, src) int32 entries of a partition with one self-loop per owned vertex, the degree of
    every owned vertex (self-loop included) and the number of duplicate records. ``spilled``: (path, count) of
    the partition's entry-key files. Works in place: about 17 bytes per entry at its peak."""
    keys = _load_keys(spilled, owned)
    keys.sort()
    if not keys.size:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(owned.size, np.int32), 0
    forward = _low_bits(keys)
    keys >>= np.uint64(1)                       # now the (dst, src) pairs
    first = np.empty(keys.size, bool)
    first[0] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    # a pair's forward entries sort after its reverse one: the pair has one iff its last entry is forward
    last = np.empty_like(first)
    last[-1] = True
    last[:-1] = first[1:]
    duplicates = int(forward.sum()) - int(forward[last].sum())
    del forward, last
    keys = keys[first]
    del first
    halves = keys.view("<u4").reshape(-1, 2)   # little-endian: [:, 0] = src, [:, 1] = dst (both < 2**31)
    src, dst = halves[:, 0].astype(np.int32), halves[:, 1].astype(np.int32)
    del keys, halves
    deg = (np.searchsorted(dst, owned, "right") - np.searchsorted(dst, owned, "left")).astype(np.int32)
    return dst, src, deg, duplicates


def place(chunks, owned: np.ndarray, default, dtype, width: int | None = None):
    """Values of the owned vertices from (ids, values) chunks, one chunk at a time (a chunk may be a (spill path,
    rows) pair): (array, missing ids, duplicated ids)."""
    shape = (owned.size,) if width is None else (owned.size, width)
    out = np.full(shape, default, dtype)
    count = np.zeros(owned.size, np.int64)
    for chunk in chunks:
        ids, vals = load(chunk[0]) if isinstance(chunk[0], str) else chunk
        pos = np.searchsorted(owned, ids)
        ok = pos < owned.size
        ok[ok] = owned[pos[ok]] == ids[ok]     # rows are routed by owner, so always true; a guard all the same
        count += np.bincount(pos[ok], minlength=owned.size)
        out[pos[ok]] = vals[ok]
    return out, owned[count == 0], owned[count > 1]


def _rows(chunk) -> int:
    """Rows of an (ids, values) chunk or of a (spill path, rows) pair."""
    return int(chunk[1]) if isinstance(chunk[0], str) else int(chunk[0].size)


def _vertex_stats(name: str, vertices: np.ndarray):
    yield from stat_outputs(name, vertices.size, [f"vertex {v}" for v in vertices[:SAMPLES]])


class _BuildPartition(beam.DoFn):
    """One partition's edge entries and vertex rows -> its vertex shard (written here), its sorted unique edge
    entries (main output) and the degrees of its vertices (tagged 'degrees')."""

    def __init__(self, root: str, feature_dim: int, tables: tuple):
        self.root, self.feature_dim, self.tables = root, feature_dim, tables

    def process(self, kv, assignment, num_nodes, split):
        p, g = kv
        owned = assignment.owned(p, int(num_nodes))
        spilled = list(g["edges"])
        yield from stat_outputs("grouped:entries", sum(int(n) for _, n in spilled))
        dst, src, deg, duplicates = dedupe(spilled, owned)
        yield from stat_outputs("duplicate_edges", duplicates)
        yield from stat_outputs("deduped:entries", dst.size)
        entries = (p, (spill(self.root, "csr", p, dst, src), dst.size))   # freed before the vertex rows are built
        del dst, src
        tables = {t: list(g[t]) for t in self.tables}
        for t, rows in tables.items():
            yield from stat_outputs(f"grouped:{t}", sum(_rows(c) for c in rows))
        if int(deg.sum()) != entries[1][1]:
            yield from stat_outputs("assignment_errors", 1,
                                    [f"partition {p}: edge entries of vertices it does not own"])
        cols = [pa.array(owned), pa.array(np.full(owned.size, p, np.int32)), pa.array(deg)]
        f = self.feature_dim
        if f > 0:
            feats, missing, dup = place(tables["features"], owned, 0.0, np.float32, f)
            yield from _vertex_stats("missing_features", missing)
            yield from _vertex_stats("duplicate_features", dup)
            cols.append(pa.FixedSizeListArray.from_arrays(pa.array(feats.reshape(-1), pa.float32()),
                                                          type=vertex_schema(f).field("features").type))
        labels = yield from self._labels(tables, owned)
        codes = yield from self._split(tables, owned, split, labels)
        cols += [pa.array(labels), pa.array(codes.astype(np.int8))]
        table = pa.Table.from_arrays(cols, schema=vertex_schema(f))
        name = shard_name(p)
        meta = write_table(table, os.path.join(self.root, "vertices", name))
        yield pvalue.TaggedOutput("stats", Stat("list:files", 1, {"kind": "vertices", "partition": p,
                                                                 "path": f"vertices/{name}", **meta}))
        yield pvalue.TaggedOutput("degrees", (owned, deg))
        yield entries

    def _labels(self, tables: dict, owned: np.ndarray):
        """The owned vertices' labels (-1 without a label file); stats on the way."""
        if "labels" not in self.tables:
            return np.full(owned.size, -1, np.int32)
        labels, missing, dup = place(tables["labels"], owned, -1, np.int32)
        yield from _vertex_stats("missing_labels", missing)
        yield from _vertex_stats("duplicate_labels", dup)
        if (labels >= 0).any():
            yield pvalue.TaggedOutput("stats", Stat("max:label", int(labels.max())))
        return labels

    def _split(self, tables: dict, owned: np.ndarray, split, labels: np.ndarray):
        """The owned vertices' split codes (a split file's, the computed split's, or none); stats on the way."""
        if "splits" in self.tables:
            codes, _, dup = place(tables["splits"], owned, SPLIT_CODES["none"], np.int8)   # no row: in no split
            yield from _vertex_stats("duplicate_splits", dup)
        elif split is not None:
            codes = split[owned]
        else:
            codes = np.full(owned.size, SPLIT_CODES["none"], np.int8)
        unlabelled = (codes >= 0) & (labels < 0)
        if unlabelled.any():
            yield from _vertex_stats("split_unlabelled", owned[unlabelled])
        for name in SPLIT_NAMES:
            yield from stat_outputs(f"split_{name}", int((codes == SPLIT_CODES[name]).sum()))
        return codes


class BuildPartitions(beam.PTransform):
    """{'edges': (p, (spill path, count)) of entry keys, ['features' | 'labels' | 'splits']: (p, (ids, values))
    or (p, (spill path, rows)), 'assignment', 'num_nodes', ['split']} -> {'entries': (p, (spill path, count)) of
    the sorted unique (dst, src) entries, self-loops included,
    'degrees': (ids, degrees), 'stats': Stat (vertex shard files included)}.

    One CoGroupByKey by partition (every partition 0..P-1 appears, empty ones included); each partition's vertex
    shard is written by the worker that holds it."""

    def __init__(self, root: str, partitions: int, feature_dim: int):
        super().__init__()
        self.root, self.partitions, self.feature_dim = root, int(partitions), int(feature_dim)

    def expand(self, inputs):
        os.makedirs(os.path.join(self.root, "vertices"), exist_ok=True)
        pipeline = inputs["edges"].pipeline
        tables = tuple(t for t in TABLES if inputs.get(t) is not None)
        tagged = {"edges": inputs["edges"], **{t: inputs[t] for t in tables},
                  "all": pipeline | "Partitions" >> beam.Create([(p, None) for p in range(self.partitions)])}
        split = inputs.get("split")
        if split is None:
            split = pipeline | "NoSplit" >> beam.Create([None])
        out = (
            tagged
            | "GroupByPartition" >> beam.CoGroupByKey()
            | "Build" >> beam.ParDo(_BuildPartition(self.root, self.feature_dim, tables),
                                    assignment=pvalue.AsSingleton(inputs["assignment"]),
                                    num_nodes=pvalue.AsSingleton(inputs["num_nodes"]),
                                    split=pvalue.AsSingleton(split)).with_outputs("stats", "degrees", main="entries")
        )
        return {"entries": out.entries, "degrees": out.degrees, "stats": out.stats}


def _inverse_sqrt_degrees(columns, num_nodes: int) -> np.ndarray:
    ids, deg = columns
    if ids.size != int(num_nodes) or np.unique(ids).size != ids.size:
        raise RuntimeError(f"internal error: degrees of {ids.size} vertex entries for {num_nodes} vertices "
                           f"(the runner lost or duplicated elements)")
    d = np.ones(int(num_nodes), np.float64)
    d[ids] = deg
    return 1.0 / np.sqrt(d)


EDGE_SLICE = 1 << 22   # edge-shard rows converted and written at a time (a multiple of Parquet's row group)


def _write_edge_shard(path: str, dst: np.ndarray, src: np.ndarray, dinv: np.ndarray) -> dict:
    """An edge shard written EDGE_SLICE rows at a time (the int64 columns never exist whole), atomically;
    returns its file record {rows, bytes, sha256} as :func:`pipelines.beam.writers.write_table` does."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with pq.ParquetWriter(tmp, EDGE_SCHEMA, compression="zstd") as writer:
        for lo in range(0, max(dst.size, 1), EDGE_SLICE):
            d, s = dst[lo:lo + EDGE_SLICE], src[lo:lo + EDGE_SLICE]
            # the same float64 products as gcn_normalize's diags(dinv) @ (A+I) @ diags(dinv), then float32
            weight = (dinv[s] * dinv[d]).astype(np.float32)
            writer.write_table(pa.Table.from_arrays([pa.array(s.astype(np.int64)), pa.array(d.astype(np.int64)),
                                                     pa.array(weight)], schema=EDGE_SCHEMA))
    os.replace(tmp, path)
    return {"rows": int(dst.size), "bytes": os.path.getsize(path), "sha256": sha256_file(path)}


class _WriteEdges(beam.DoFn):
    def __init__(self, root: str):
        self.root = root

    def process(self, kv, dinv):
        p, (path, _) = kv
        dst, src = load(path)
        name = shard_name(p)
        meta = _write_edge_shard(os.path.join(self.root, "edges", name), dst, src, dinv)
        yield Stat("written:entries", meta["rows"])
        yield Stat("list:files", 1, {"kind": "edges", "partition": p, "path": f"edges/{name}", **meta})


class WriteEdgeShards(beam.PTransform):
    """{'entries': (p, (spill path of (dst, src), count)), 'degrees': (ids, degrees), 'num_nodes'} -> Stat records
    of the edge shards:
    weight = Â[dst, src] = 1/sqrt(deg(src) deg(dst)), the degree vector broadcast as a side input."""

    def __init__(self, root: str):
        super().__init__()
        self.root = root

    def expand(self, inputs):
        os.makedirs(os.path.join(self.root, "edges"), exist_ok=True)
        dinv = (
            inputs["degrees"]
            | "CollectDegrees" >> beam.CombineGlobally(ConcatArrays((np.int64, np.int32)))
            | "InverseSqrt" >> beam.Map(_inverse_sqrt_degrees, num_nodes=pvalue.AsSingleton(inputs["num_nodes"]))
        )
        return inputs["entries"] | "Write" >> beam.ParDo(_WriteEdges(self.root), dinv=pvalue.AsSingleton(dinv))
