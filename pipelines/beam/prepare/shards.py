"""BuildPartitions and WriteEdgeShards: each partition's deduplicated entries and vertex rows -> its vertex
shard, then its edge shard weighted with Â = D^-1/2 (A + I) D^-1/2 (the degree vector as a side input)."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

import apache_beam as beam
from apache_beam import pvalue

from pipelines.beam.combiners import SAMPLES, ConcatArrays, Stat, stat_outputs
from pipelines.beam.prepare.partition import entry_forward, entry_keys, entry_pairs, unpack_pairs
from pipelines.beam.prepare.tables import TABLES
from pipelines.beam.writers import shard_name, write_table
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


def dedupe(chunks, owned: np.ndarray):
    """Sorted unique (dst, src) int32 entries of a partition with one self-loop per owned vertex, the degree of
    every owned vertex (self-loop included) and the number of duplicate records."""
    loops = entry_keys(owned, owned, 0)
    keys = np.concatenate([np.asarray(c, np.uint64) for c in chunks] + [loops])
    keys.sort()
    if not keys.size:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(owned.size, np.int32), 0
    pair = entry_pairs(keys)
    first = np.empty(keys.size, bool)
    first[0] = True
    np.not_equal(pair[1:], pair[:-1], out=first[1:])
    forward = np.add.reduceat(entry_forward(keys).astype(np.int64), np.flatnonzero(first))
    duplicates = int(np.maximum(forward - 1, 0).sum())
    del keys
    dst, src = unpack_pairs(pair[first])
    deg = (np.searchsorted(dst, owned, "right") - np.searchsorted(dst, owned, "left")).astype(np.int32)
    return dst, src, deg, duplicates


def place(chunks, owned: np.ndarray, default, dtype, width: int | None = None):
    """Values of the owned vertices from (ids, values) chunks: (array, missing ids, duplicated ids)."""
    chunks = list(chunks)
    shape = (owned.size,) if width is None else (owned.size, width)
    out = np.full(shape, default, dtype)
    if not chunks:
        return out, owned, np.zeros(0, np.int64)
    ids = np.concatenate([c[0] for c in chunks])
    vals = np.concatenate([c[1] for c in chunks])
    pos = np.searchsorted(owned, ids)
    ok = pos < owned.size
    ok[ok] = owned[pos[ok]] == ids[ok]     # rows are routed by owner, so always true; a guard all the same
    count = np.bincount(pos[ok], minlength=owned.size)
    out[pos[ok]] = vals[ok]
    return out, owned[count == 0], owned[count > 1]


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
        chunks = list(g["edges"])
        yield from stat_outputs("grouped:entries", sum(int(np.asarray(c).size) for c in chunks))
        dst, src, deg, duplicates = dedupe(chunks, owned)
        yield from stat_outputs("duplicate_edges", duplicates)
        yield from stat_outputs("deduped:entries", dst.size)
        tables = {t: list(g[t]) for t in self.tables}
        for t, rows in tables.items():
            yield from stat_outputs(f"grouped:{t}", sum(int(c[0].size) for c in rows))
        if int(deg.sum()) != dst.size:
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
        yield p, (dst, src)

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
    """{'edges': (p, entry keys), ['features' | 'labels' | 'splits']: (p, (ids, values)), 'assignment',
    'num_nodes', ['split']} -> {'entries': (p, (dst, src)) sorted unique, self-loops included,
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


class _WriteEdges(beam.DoFn):
    def __init__(self, root: str):
        self.root = root

    def process(self, kv, dinv):
        p, (dst, src) = kv
        # the same float64 products as gcn_normalize's diags(dinv) @ (A+I) @ diags(dinv), then float32
        weight = (dinv[src] * dinv[dst]).astype(np.float32)
        table = pa.Table.from_arrays([pa.array(src.astype(np.int64)), pa.array(dst.astype(np.int64)),
                                      pa.array(weight)], schema=EDGE_SCHEMA)
        name = shard_name(p)
        meta = write_table(table, os.path.join(self.root, "edges", name))
        yield Stat("written:entries", table.num_rows)
        yield Stat("list:files", 1, {"kind": "edges", "partition": p, "path": f"edges/{name}", **meta})


class WriteEdgeShards(beam.PTransform):
    """{'entries': (p, (dst, src)), 'degrees': (ids, degrees), 'num_nodes'} -> Stat records of the edge shards:
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
