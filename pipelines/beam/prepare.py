"""Prepare a graph for Dorylus: validate, symmetrize, normalize, partition and shard it (an Apache Beam pipeline).

    python -m pipelines.prepare --edges 'data/g/edges-*.csv' --features data/g/x.npy --labels data/g/y.npy \\
        --partitions 4 --partitioner metis --split --out runs/g-prepared            # DirectRunner
    python -m pipelines.prepare ... --engine flink                                  # embedded Flink cluster
    python -m pipelines.prepare ... --runner=FlinkRunner --flink_master=host:8081    # any Beam runner flags

App flags are parsed with argparse; every other flag goes to Beam's PipelineOptions (``--runner=...``);
``--engine direct|flink`` expands to the flags of :func:`pipelines.beam.runners.runner_options`.

Inputs
------
--edges GLOB      one or more files (a glob, e.g. ``part-*.csv``); ``.parquet``/``.pq`` files are Parquet, all
                  others text (``.gz``/``.bz2``/... are decompressed by Beam). Text: one edge ``src dst`` per line,
                  separated by a comma, a tab or spaces; ``#`` starts a comment (whole line or trailing); blank lines
                  are skipped; the first data line of each file is a header (skipped) when every field of it starts
                  with a letter or ``_`` (``src,dst``). Parquet: columns ``src`` and ``dst`` (else the first two).
                  A line (row) that is not exactly two integers is a *bad record*: reported as ``file:line: why``
                  and counted; more than ``--max-bad-records`` (default 0) of them fail the run.
                  Ids outside [0, N) fail the run. Self-loops and duplicate edges are dropped and counted.
--features PATH   ``.npy`` float array [N, F] (row i = vertex i), or Parquet: an optional integer id column
                  ``vertex`` (or ``node``, ``node_id``, ``id``; without one, row i = vertex i) and either one list
                  column (``features``, ``fixed_size_list<float32>[F]`` preferred, any numeric list accepted) or,
                  failing that, every other numeric column as one feature (wide format, in schema order).
                  NaN/inf, rows of another width, missing or repeated vertices fail the run.
--labels PATH     ``.npy`` int array [N], or Parquet with a ``label`` column (else the only non-id column) and
                  the optional id column; -1 or null = unlabelled.
--num-nodes N     default: the row count of --features (else of --labels), else max edge id + 1.

Outputs (``--out DIR``)
-----------------------
DIR/edges/part-XXXXX.parquet     (src int64, dst int64, weight float32): the nonzeros of
                                 Â = D^-1/2 (A + I) D^-1/2 whose *destination* (row) vertex the partition owns,
                                 self-loops included, sorted by (dst, src); weight = Â[dst, src]
                                 = 1/sqrt(deg_src) * 1/sqrt(deg_dst), deg counting the self-loop.
DIR/vertices/part-XXXXX.parquet  (vertex int64, partition int32, degree int32 [with self-loop],
                                 features fixed_size_list<float32>[F] [absent when F = 0], label int32 [-1 none],
                                 split string [train|val|test|null]), sorted by vertex.
DIR/manifest.json                sizes, files with row counts and sha256, counters, the flags used.

The run is atomic: everything is written into ``DIR.tmp-<uuid>`` next to DIR, the manifest is written last, and
the directory is renamed to DIR only when every check passed; on any error the temporary directory is removed,
so a DIR with a manifest.json is always complete. An existing DIR is replaced only with ``--overwrite``.

Scale notes: every step is a Beam shuffle/combine, except (a) a partition's shard is built in one worker's
memory (as a Dorylus graph server holds its partition), (b) ``--partitioner metis`` and ``--split`` collect the
whole edge list / label vector in one worker (METIS and the per-class permutation need them).
The output paths must be on a file system that the workers and this process share (local or mounted).
"""
from __future__ import annotations

import argparse
import array
import datetime
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.io import fileio
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.data.graph import DataError

log = logging.getLogger("dorylus.prepare")

FORMAT = "dorylus-prepared"
FORMAT_VERSION = 1
ID_LIMIT = 2**31 - 1          # CSR indices are int32 throughout the system
ID_COLUMNS = ("vertex", "node", "node_id", "id")
PARQUET_SUFFIXES = (".parquet", ".pq")
SAMPLES = 20                  # examples kept per counter (bad records, errors)
SPLIT_NAMES = ("train", "val", "test")
STATS_FILE = "_stats.json"

# --- Parquet schemas of the shards -------------------------------------------------------------------------------
# Defined here for now; schemas/files.py is getting the project-wide file schemas and these will move there.
EDGE_SCHEMA = pa.schema(
    [
        pa.field("src", pa.int64(), nullable=False),
        pa.field("dst", pa.int64(), nullable=False),
        pa.field("weight", pa.float32(), nullable=False),
    ],
    metadata={b"dorylus.kind": b"edges", b"dorylus.normalization": b"gcn-sym-self-loops"},
)


def vertex_schema(feature_dim: int) -> pa.Schema:
    fields = [
        pa.field("vertex", pa.int64(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("degree", pa.int32(), nullable=False),
    ]
    if feature_dim > 0:
        fields.append(pa.field("features", pa.list_(pa.float32(), feature_dim), nullable=False))
    fields += [pa.field("label", pa.int32(), nullable=False), pa.field("split", pa.string(), nullable=True)]
    return pa.schema(fields, metadata={b"dorylus.kind": b"vertices"})


def shard_name(partition: int) -> str:
    return f"part-{partition:05d}.parquet"


# --- statistics ----------------------------------------------------------------------------------------------------
# Every transform reports problems and counts as Stat elements on a tagged output "stats"; they are merged by
# StatsFn into one dict that the driver turns into errors and the manifest's counters.
#   name            count += n, keep up to SAMPLES samples
#   "max:<name>"    maximum of n
#   "list:<name>"   keep every sample (shard file records)


class Stat(NamedTuple):
    name: str
    n: int = 1
    sample: object = None


class StatsFn(beam.CombineFn):
    def create_accumulator(self):
        return {}

    def add_input(self, acc, stat):
        name, n, sample = stat
        entry = acc.get(name)
        if name.startswith("max:"):
            acc[name] = [n if entry is None else max(entry[0], n), []]
            return acc
        if entry is None:
            entry = acc[name] = [0, []]
        entry[0] += n
        if sample is not None and (name.startswith("list:") or len(entry[1]) < SAMPLES):
            entry[1].append(sample)
        return acc

    def merge_accumulators(self, accs):
        out = {}
        for acc in accs:
            for name, (n, samples) in acc.items():
                entry = out.get(name)
                if entry is None:
                    out[name] = [n, list(samples)]
                elif name.startswith("max:"):
                    entry[0] = max(entry[0], n)
                else:
                    entry[0] += n
                    room = len(samples) if name.startswith("list:") else max(0, SAMPLES - len(entry[1]))
                    entry[1].extend(samples[:room])
        return out

    def extract_output(self, acc):
        for name, entry in acc.items():
            if not name.startswith("list:"):
                entry[1] = sorted(entry[1], key=str)[:SAMPLES]
        return acc


class _CollectColumns(beam.CombineFn):
    """Gather tuples of ints into k numpy int64 columns (for the steps that need a whole vector in one place)."""

    def __init__(self, k: int):
        self.k = k

    def create_accumulator(self):
        return [array.array("q") for _ in range(self.k)]

    def add_input(self, acc, row):
        for col, value in zip(acc, row):
            col.append(value)
        return acc

    def merge_accumulators(self, accs):
        accs = list(accs)
        out = accs[0]
        for acc in accs[1:]:
            for col, more in zip(out, acc):
                col.extend(more)
        return out

    def extract_output(self, acc):
        return [np.frombuffer(col, dtype=np.int64).copy() if len(col) else np.zeros(0, np.int64) for col in acc]


# --- ReadEdges -----------------------------------------------------------------------------------------------------
_INT_RE = re.compile(r"[+-]?[0-9]+")
_HEADER_TOKEN_RE = re.compile(r"[A-Za-z_].*")


def _is_parquet(path: str) -> bool:
    return path.lower().endswith(PARQUET_SUFFIXES)


def _split_fields(body: str) -> tuple[str, ...]:
    if "," in body:
        return tuple(t.strip() for t in body.split(","))
    if "\t" in body:
        return tuple(t.strip() for t in body.split("\t"))
    return tuple(body.split())


class _ReadEdgeFile(beam.DoFn):
    """ReadableFile -> (path, line, fields) for every data line/row; fields are strings (text) or values (Parquet)."""

    def process(self, readable: fileio.ReadableFile):
        path = readable.metadata.path
        if _is_parquet(path):
            yield from self._parquet(readable, path)
            return
        first = True
        with readable.open() as f:   # Beam's CompressedFile (.gz, ...) has readline but no __iter__
            for lineno, raw in enumerate(iter(f.readline, b""), start=1):
                body = raw.decode("utf-8", errors="replace").split("#", 1)[0].strip()
                if not body:
                    continue
                fields = _split_fields(body)
                if first:
                    first = False
                    if fields and all(_HEADER_TOKEN_RE.fullmatch(t) for t in fields):
                        yield pvalue.TaggedOutput("stats", Stat("header_lines", 1, f"{path}:{lineno}"))
                        continue
                yield path, lineno, fields

    def _parquet(self, readable, path):
        with readable.open() as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            cols = ["src", "dst"] if {"src", "dst"} <= set(names) else names[:2]
            if len(cols) < 2:
                yield path, 0, tuple(cols)  # one bad record for the whole file: "expected 2 fields"
                return
            row = 0
            for batch in pf.iter_batches(columns=cols, batch_size=65536):
                a, b = batch.column(0).to_pylist(), batch.column(1).to_pylist()
                for x, y in zip(a, b):
                    row += 1
                    yield path, row, (x, y)


class ReadEdges(beam.PTransform):
    """PBegin -> {'records': (path, line, fields), 'stats': Stat}; every file matching ``pattern``."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern

    def expand(self, pbegin):
        out = (
            pbegin
            | "Match" >> fileio.MatchFiles(self.pattern, empty_match_treatment=fileio.EmptyMatchTreatment.DISALLOW)
            | "SpreadFiles" >> beam.Reshuffle()
            | "Open" >> fileio.ReadMatches()
            | "Parse" >> beam.ParDo(_ReadEdgeFile()).with_outputs("stats", main="records")
        )
        return {"records": out.records, "stats": out.stats}


# --- Validate ------------------------------------------------------------------------------------------------------
def _as_id(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INT_RE.fullmatch(value):
        return int(value)
    return None


class _ValidateRecord(beam.DoFn):
    def __init__(self, limit: int, limit_source: str):
        self.limit = limit
        self.limit_source = limit_source

    def process(self, record):
        path, line, fields = record
        where = f"{path}:{line}"
        yield pvalue.TaggedOutput("stats", Stat("input_records"))
        if len(fields) != 2:
            yield pvalue.TaggedOutput(
                "stats", Stat("bad_records", 1, f"{where}: expected 2 fields (src dst), got {len(fields)}"))
            return
        ids = []
        for value in fields:
            v = _as_id(value)
            if v is None:
                what = "empty field" if value is None or value == "" else f"non-integer field {value!r}"
                yield pvalue.TaggedOutput("stats", Stat("bad_records", 1, f"{where}: {what}"))
                return
            ids.append(v)
        for v in ids:
            if v < 0 or v >= self.limit:
                yield pvalue.TaggedOutput(
                    "stats",
                    Stat("ids_out_of_range", 1, f"{where}: vertex id {v} out of range [0, {self.limit}) "
                                                f"({self.limit_source})"))
                return
        src, dst = ids
        yield pvalue.TaggedOutput("max_id", max(src, dst))
        if src == dst:
            yield pvalue.TaggedOutput("stats", Stat("self_loops", 1, where))
            return
        yield src, dst


class Validate(beam.PTransform):
    """(path, line, fields) -> {'edges': (src, dst) valid non-loop edges, 'max_id': int, 'stats': Stat}.

    ``num_nodes``: ids must lie in [0, num_nodes); None = any id in [0, 2**31 - 1) (N is inferred afterwards).
    """

    def __init__(self, num_nodes: int | None, num_nodes_source: str = "--num-nodes"):
        super().__init__()
        self.limit = ID_LIMIT if num_nodes is None else int(num_nodes)
        self.source = "ids must fit int32" if num_nodes is None else num_nodes_source

    def expand(self, records):
        out = records | "Check" >> beam.ParDo(_ValidateRecord(self.limit, self.source)).with_outputs(
            "stats", "max_id", main="edges")
        return {"edges": out.edges, "max_id": out.max_id, "stats": out.stats}


# --- Symmetrize ----------------------------------------------------------------------------------------------------
def _pair_key(u: int, v: int) -> int:
    return (u << 32) | v


def _both_directions(edge):
    u, v = edge
    yield _pair_key(u, v), 1   # counts the records of this exact direction
    yield _pair_key(v, u), 0


def _emit_symmetric(kv):
    key, forward = kv
    yield (key >> 32, key & 0xFFFFFFFF)
    if forward > 1:
        yield pvalue.TaggedOutput("stats", Stat("duplicate_edges", forward - 1))


class Symmetrize(beam.PTransform):
    """(src, dst) records -> {'edges': every (u, v) of the symmetric closure once, 'stats': duplicate_edges}.

    One shuffle: each record is keyed by both of its directions; a record repeating an earlier one in the same
    direction counts as a duplicate (the reverse direction of an existing edge is not a duplicate).
    """

    def expand(self, edges):
        out = (
            edges
            | "BothDirections" >> beam.FlatMap(_both_directions)
            | "CountPerPair" >> beam.CombinePerKey(sum)
            | "Emit" >> beam.FlatMap(_emit_symmetric).with_outputs("stats", main="edges")
        )
        return {"edges": out.edges, "stats": out.stats}


# --- vertices, degrees, normalization ------------------------------------------------------------------------------
class Vertices(beam.PTransform):
    """PCollection[int] holding N -> PCollection of 0..N-1 (spread across workers)."""

    def expand(self, num_nodes):
        return num_nodes | "Range" >> beam.FlatMap(lambda n: range(int(n))) | "Spread" >> beam.Reshuffle()


class Degrees(beam.PTransform):
    """{'vertices': v, 'edges': symmetric (u, v)} -> (v, degree) for every vertex, degree counting the self-loop."""

    def expand(self, inputs):
        ones = inputs["vertices"] | "SelfLoop" >> beam.Map(lambda v: (v, 1))
        outs = inputs["edges"] | "OutEdge" >> beam.Map(lambda e: (e[0], 1))
        return (ones, outs) | "Flatten" >> beam.Flatten() | "Count" >> beam.CombinePerKey(sum)


def _dinv(degree: int) -> float:
    return 1.0 / math.sqrt(degree)


def _scale_by_source(kv):
    src, grouped = kv
    dinv = _dinv(next(iter(grouped["deg"])))
    yield src, (src, dinv)                   # the self-loop (src, src)
    for dst in grouped["dst"]:
        yield dst, (src, dinv)


def _scale_by_destination(kv):
    dst, grouped = kv
    dinv_dst = _dinv(next(iter(grouped["deg"])))
    for src, dinv_src in grouped["in"]:
        # the same float64 products, in the same order, as gcn_normalize's diags(dinv) @ (A+I) @ diags(dinv)
        yield src, dst, dinv_src * dinv_dst


class Normalize(beam.PTransform):
    """{'edges': symmetric (u, v), 'degrees': (v, deg)} -> (src, dst, weight) for every nonzero of
    Â = D^-1/2 (A + I) D^-1/2 (self-loops added), weight = Â[dst, src] as a float64."""

    def expand(self, inputs):
        by_src = inputs["edges"] | "BySource" >> beam.Map(lambda e: (e[0], e[1]))
        half = (
            {"deg": inputs["degrees"], "dst": by_src}
            | "JoinSource" >> beam.CoGroupByKey()
            | "ScaleSource" >> beam.FlatMap(_scale_by_source)
        )
        return (
            {"deg": inputs["degrees"], "in": half}
            | "JoinDestination" >> beam.CoGroupByKey()
            | "ScaleDestination" >> beam.FlatMap(_scale_by_destination)
        )


# --- AssignPartitions ----------------------------------------------------------------------------------------------
def _metis(columns, num_nodes: int, parts: int, seed: int):
    import pymetis

    src, dst = columns
    n = int(num_nodes)
    if parts == 1 or n == 0:
        membership = np.zeros(n, np.int64)
    else:
        order = np.lexsort((dst, src))          # deterministic CSR whatever order the edges arrived in
        src, dst = src[order], dst[order]
        xadj = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(src, minlength=n), out=xadj[1:])
        _, membership = pymetis.part_graph(
            parts, pymetis.CSRAdjacency(xadj, dst), options=pymetis.Options(seed=seed))
        membership = np.asarray(membership, np.int64)
    for v in range(n):
        yield v, int(membership[v])


class _ReadAssignment(beam.DoFn):
    def __init__(self, path: str, parts: int):
        self.path = path
        self.parts = parts

    def process(self, _, num_nodes):
        n = int(num_nodes)
        count = 0
        with FileSystems.open(self.path) as f:
            for lineno, raw in enumerate(f, start=1):
                body = raw.decode("utf-8", errors="replace").split("#", 1)[0].strip()
                if not body:
                    continue
                v = count
                count += 1
                if not _INT_RE.fullmatch(body):
                    yield pvalue.TaggedOutput(
                        "stats", Stat("assignment_errors", 1, f"{self.path}:{lineno}: not an integer: {body!r}"))
                    continue
                part = int(body)
                if not 0 <= part < self.parts:
                    yield pvalue.TaggedOutput(
                        "stats", Stat("assignment_errors", 1,
                                      f"{self.path}:{lineno}: partition {part} out of range [0, {self.parts})"))
                    continue
                if v < n:
                    yield v, part
        if count != n:
            yield pvalue.TaggedOutput(
                "stats", Stat("assignment_errors", 1,
                              f"{self.path}: {count} partition ids for {n} vertices (one line per vertex)"))


class AssignPartitions(beam.PTransform):
    """{'vertices', 'edges', 'num_nodes'} -> {'assignment': (v, partition), 'stats': Stat or None}.

    hash: ``v % P``; metis: pymetis on the whole symmetric graph (collected in one worker), seeded;
    file: a METIS-style assignment file, line i = the partition of vertex i.
    """

    def __init__(self, method: str, parts: int, assignment: str | None = None, seed: int = 0):
        super().__init__()
        if method not in ("hash", "metis", "file"):
            raise ValueError(f"unknown partitioner {method!r}")
        self.method, self.parts, self.assignment, self.seed = method, int(parts), assignment, int(seed)

    def expand(self, inputs):
        parts = self.parts
        if self.method == "hash":
            assignment = inputs["vertices"] | "Hash" >> beam.Map(lambda v: (v, v % parts))
            stats = None
        elif self.method == "metis":
            assignment = (
                inputs["edges"]
                | "Collect" >> beam.CombineGlobally(_CollectColumns(2))
                | "Metis" >> beam.FlatMap(_metis, num_nodes=pvalue.AsSingleton(inputs["num_nodes"]),
                                          parts=parts, seed=self.seed)
                | "Spread" >> beam.Reshuffle()
            )
            stats = None
        else:
            out = (
                inputs["vertices"].pipeline
                | "Impulse" >> beam.Impulse()
                | "Read" >> beam.ParDo(_ReadAssignment(self.assignment, parts),
                                       num_nodes=pvalue.AsSingleton(inputs["num_nodes"]))
                .with_outputs("stats", main="assignment")
            )
            assignment, stats = out.assignment, out.stats
        return {"assignment": assignment, "stats": stats}


# --- features and labels -------------------------------------------------------------------------------------------
class TableInfo(NamedTuple):
    """What the driver learns about a feature/label file before the pipeline runs (cheap: headers, metadata)."""

    path: str
    kind: str                 # "npy" | "parquet"
    rows: int
    dim: int                  # features: F; labels: 0
    id_column: str | None     # Parquet: the vertex-id column
    value_columns: tuple      # Parquet: the list column, or the wide feature columns, or the label column
    row_groups: tuple = ()    # Parquet: (index, first row) of each row group


def _npy_header(path: str):
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)  # reads the header only
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a readable .npy file ({e})") from None
    return arr.shape, arr.dtype


def _is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _parquet_meta(path: str):
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    id_col = next((c for c in ID_COLUMNS if c in schema.names), None)
    if id_col is not None and not pa.types.is_integer(schema.field(id_col).type):
        raise DataError(f"{path}: id column {id_col!r} must be integer, got {schema.field(id_col).type}")
    groups, start = [], 0
    for i in range(pf.metadata.num_row_groups):
        groups.append((i, start))
        start += pf.metadata.row_group(i).num_rows
    return pf, schema, id_col, tuple(groups)


def inspect_features(path: str) -> TableInfo:
    if not os.path.isfile(path):
        raise DataError(f"feature file {path} does not exist")
    if path.endswith(".npy"):
        shape, dtype = _npy_header(path)
        if len(shape) != 2:
            raise DataError(f"{path}: features must be a 2-D array [nodes, features], got shape {shape}")
        if dtype.kind not in "iuf":
            raise DataError(f"{path}: features must be numeric, got dtype {dtype}")
        return TableInfo(path, "npy", int(shape[0]), int(shape[1]), None, ())
    if not path.lower().endswith(PARQUET_SUFFIXES):
        raise DataError(f"{path}: feature files must be .npy or .parquet")
    pf, schema, id_col, groups = _parquet_meta(path)
    others = [f for f in schema if f.name != id_col]
    lists = [f for f in others if _is_list_type(f.type)]
    if any(f.name == "features" for f in lists):
        lists = [f for f in lists if f.name == "features"]
    if lists:
        if len(lists) > 1:
            raise DataError(f"{path}: several list columns {[f.name for f in lists]}; name the features 'features'")
        field = lists[0]
        if not _is_number(field.type.value_type):
            raise DataError(f"{path}: feature column {field.name!r} holds {field.type.value_type}, not numbers")
        if pa.types.is_fixed_size_list(field.type):
            dim = field.type.list_size
        else:  # width of the first non-null row; the pipeline checks every other row against it
            dim = 0
            for batch in pf.iter_batches(columns=[field.name], batch_size=1024):
                col = batch.column(0)
                valid = col.drop_null() if col.null_count else col
                if len(valid):
                    dim = len(valid[0])
                    break
        return TableInfo(path, "parquet", pf.metadata.num_rows, int(dim), id_col, (field.name,), groups)
    bad = [f"{f.name} ({f.type})" for f in others if not _is_number(f.type)]
    if bad:
        raise DataError(f"{path}: non-numeric feature columns: {', '.join(bad)}")
    if not others:
        raise DataError(f"{path}: no feature columns")
    return TableInfo(path, "parquet", pf.metadata.num_rows, len(others), id_col,
                     tuple(f.name for f in others), groups)


def inspect_labels(path: str) -> TableInfo:
    if not os.path.isfile(path):
        raise DataError(f"label file {path} does not exist")
    if path.endswith(".npy"):
        shape, dtype = _npy_header(path)
        if len(shape) != 1:
            raise DataError(f"{path}: labels must be a 1-D array [nodes], got shape {shape}")
        if dtype.kind not in "iu":
            raise DataError(f"{path}: labels must be integers, got dtype {dtype}")
        return TableInfo(path, "npy", int(shape[0]), 0, None, ())
    if not path.lower().endswith(PARQUET_SUFFIXES):
        raise DataError(f"{path}: label files must be .npy or .parquet")
    pf, schema, id_col, groups = _parquet_meta(path)
    others = [f for f in schema if f.name != id_col]
    if "label" in schema.names:
        col = schema.field("label")
    elif len(others) == 1:
        col = others[0]
    else:
        raise DataError(f"{path}: no 'label' column among {schema.names}")
    if not pa.types.is_integer(col.type):
        raise DataError(f"{path}: labels must be integers, column {col.name!r} is {col.type}")
    return TableInfo(path, "parquet", pf.metadata.num_rows, 0, id_col, (col.name,), groups)


NPY_CHUNK = 8192


def _plan_chunks(_, info: TableInfo):
    if info.kind == "npy":
        for start in range(0, info.rows, NPY_CHUNK):
            yield start, min(start + NPY_CHUNK, info.rows)
    else:
        yield from info.row_groups


class _ReadRows(beam.DoFn):
    """A chunk of a feature/label file -> (vertex, value) (+ stats). value: float32 [F] array or int label."""

    def __init__(self, info: TableInfo, what: str, num_nodes: int):
        self.info, self.what, self.num_nodes = info, what, num_nodes

    def _values(self, chunk):
        info = self.info
        if info.kind == "npy":
            start, stop = chunk
            arr = np.load(info.path, mmap_mode="r", allow_pickle=False)[start:stop]
            return np.arange(start, stop, dtype=np.int64), np.asarray(arr), None
        index, first = chunk
        table = pq.ParquetFile(info.path).read_row_group(index)
        ids = (table.column(info.id_column).to_numpy(zero_copy_only=False) if info.id_column is not None
               else np.arange(first, first + table.num_rows, dtype=np.int64))
        if self.what == "labels":
            col = table.column(info.value_columns[0])
            values = col.fill_null(-1).to_numpy(zero_copy_only=False)
            return ids, values, None
        if len(info.value_columns) == 1 and _is_list_type(table.schema.field(info.value_columns[0]).type):
            col = table.column(info.value_columns[0]).combine_chunks()
            lengths = (np.full(len(col), col.type.list_size) if pa.types.is_fixed_size_list(col.type)
                       else col.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False))
            nulls = col.is_null().to_numpy(zero_copy_only=False)
            rows = col.to_pylist()
            return ids, rows, (lengths, nulls)
        cols = [table.column(c) for c in info.value_columns]
        nulls = np.zeros(table.num_rows, bool)
        for c in cols:
            if c.null_count:
                nulls |= c.is_null().to_numpy(zero_copy_only=False)
        mat = np.column_stack([c.fill_null(0).to_numpy(zero_copy_only=False) for c in cols]).astype(np.float64)
        return ids, mat, (np.full(table.num_rows, len(cols)), nulls)

    def process(self, chunk):
        ids, values, shape = self._values(chunk)
        what, n, path = self.what, self.num_nodes, self.info.path
        for i, v in enumerate(ids.tolist()):
            where = f"{path}: row {i + (chunk[0] if self.info.kind == 'npy' else chunk[1])}"
            if not 0 <= v < n:
                yield pvalue.TaggedOutput("stats", Stat(f"{what}_vertex_out_of_range", 1,
                                                        f"{where}: vertex {v} out of range [0, {n})"))
                continue
            if what == "labels":
                label = int(values[i])
                if label < -1:
                    yield pvalue.TaggedOutput("stats", Stat("bad_labels", 1, f"{where}: label {label} < -1"))
                    continue
                yield v, label
                continue
            if shape is not None:
                lengths, nulls = shape
                if nulls[i]:
                    yield pvalue.TaggedOutput("stats", Stat("bad_feature_rows", 1, f"{where}: null features"))
                    continue
                if lengths[i] != self.info.dim:
                    yield pvalue.TaggedOutput(
                        "stats", Stat("bad_feature_rows", 1,
                                      f"{where}: {lengths[i]} features, expected {self.info.dim}"))
                    continue
            row = np.asarray(values[i], dtype=np.float64)
            if not np.isfinite(row).all():
                bad = "NaN" if np.isnan(row).any() else "inf"
                yield pvalue.TaggedOutput("stats", Stat("nan_features", 1, f"{where} (vertex {v}): {bad}"))
                continue
            yield v, row.astype(np.float32)


class ReadTable(beam.PTransform):
    """PBegin -> {'rows': (vertex, value), 'stats'} from a file described by :class:`TableInfo`."""

    def __init__(self, info: TableInfo, what: str, num_nodes: int):
        super().__init__()
        assert what in ("features", "labels")
        self.info, self.what, self.num_nodes = info, what, num_nodes

    def expand(self, pbegin):
        out = (
            pbegin
            | "Impulse" >> beam.Impulse()
            | "Plan" >> beam.FlatMap(_plan_chunks, info=self.info)
            | "Spread" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(_ReadRows(self.info, self.what, self.num_nodes)).with_outputs(
                "stats", main="rows")
        )
        return {"rows": out.rows, "stats": out.stats}


def ReadFeatures(info: TableInfo, num_nodes: int) -> ReadTable:
    return ReadTable(info, "features", num_nodes)


def ReadLabels(info: TableInfo, num_nodes: int) -> ReadTable:
    return ReadTable(info, "labels", num_nodes)


# --- Split ---------------------------------------------------------------------------------------------------------
def _split(columns, seed: int, train_per_class: int, val_per_class: int):
    from pipelines.data.splits import per_class_split

    vertices, labels = columns
    if vertices.size == 0:
        return
    n = int(vertices.max()) + 1
    y = np.full(n, -1, np.int64)
    y[vertices] = labels
    num_classes = int(y.max()) + 1 if (y >= 0).any() else 0
    masks = per_class_split(y, num_classes, train_per_class, val_per_class, seed)
    for name, mask in zip(SPLIT_NAMES, masks):
        for v in np.flatnonzero(mask).tolist():
            yield v, name


class Split(beam.PTransform):
    """(vertex, label) -> (vertex, 'train'|'val'|'test') for labelled vertices: ``train_per_class`` train and
    ``val_per_class`` val vertices of every class, the other labelled vertices test — the same seeded split as
    ``pipelines.data.splits.per_class_split`` computes in memory (the labels are collected in one worker)."""

    def __init__(self, seed: int, train_per_class: int = 20, val_per_class: int = 30):
        super().__init__()
        self.seed, self.train, self.val = int(seed), int(train_per_class), int(val_per_class)

    def expand(self, labels):
        return (
            labels
            | "Labelled" >> beam.Filter(lambda kv: kv[1] >= 0)
            | "Collect" >> beam.CombineGlobally(_CollectColumns(2))
            | "PerClass" >> beam.FlatMap(_split, seed=self.seed, train_per_class=self.train,
                                         val_per_class=self.val)
            | "Spread" >> beam.Reshuffle()
        )


# --- vertex table --------------------------------------------------------------------------------------------------
class VertexRow(NamedTuple):
    vertex: int
    partition: int
    degree: int
    features: object          # float32 [F] or None
    label: int
    split: str | None


def _vertex_row(kv, has_features: bool, has_labels: bool):
    v, g = kv
    g = {k: list(vals) for k, vals in g.items()}
    deg, part = g["deg"], g["part"]
    if not deg:   # only a feature/label row for a vertex outside the graph; reported by the reader
        return
    if len(part) != 1:
        yield pvalue.TaggedOutput("stats", Stat("assignment_errors", 1, f"vertex {v}: {len(part)} partitions"))
        return
    feats = g.get("feat", [])
    if has_features and len(feats) != 1:
        name = "missing_features" if not feats else "duplicate_features"
        yield pvalue.TaggedOutput("stats", Stat(name, 1, f"vertex {v}"))
        return
    labels = g.get("label", [])
    if has_labels and len(labels) != 1:
        name = "missing_labels" if not labels else "duplicate_labels"
        yield pvalue.TaggedOutput("stats", Stat(name, 1, f"vertex {v}"))
        return
    label = labels[0] if labels else -1
    split = g.get("split", [None])
    split = split[0] if split else None
    if label >= 0:
        yield pvalue.TaggedOutput("stats", Stat("max:label", label))
    if split is not None:
        yield pvalue.TaggedOutput("stats", Stat(f"split_{split}", 1))
    yield VertexRow(v, part[0], deg[0], feats[0] if feats else None, label, split)


class JoinVertices(beam.PTransform):
    """{'degrees', 'assignment', ['features'], ['labels'], ['split']} keyed by vertex -> VertexRow (+ stats)."""

    def expand(self, inputs):
        tagged = {"deg": inputs["degrees"], "part": inputs["assignment"]}
        for key, name in (("feat", "features"), ("label", "labels"), ("split", "split")):
            if inputs.get(name) is not None:
                tagged[key] = inputs[name]
        out = (
            tagged
            | "Join" >> beam.CoGroupByKey()
            | "Row" >> beam.FlatMap(_vertex_row, has_features="feat" in tagged, has_labels="label" in tagged)
            .with_outputs("stats", main="rows")
        )
        return {"rows": out.rows, "stats": out.stats}


# --- WriteShards ---------------------------------------------------------------------------------------------------
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_table(table: pa.Table, path: str) -> dict:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
    return {"rows": table.num_rows, "bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _edge_by_destination_partition(kv):
    dst, g = kv
    part = list(g["part"])
    if len(part) != 1:
        return
    part = part[0]
    for src, w in g["in"]:
        yield part, (src, dst, w)


class _WritePartition(beam.DoFn):
    def __init__(self, root: str, feature_dim: int):
        self.root, self.feature_dim = root, feature_dim

    def process(self, kv):
        part, g = kv
        name = shard_name(part)
        # edges: sorted by (dst, src) so a graph server can build its CSR rows directly
        e = sorted(g["edges"], key=lambda t: (t[1], t[0]))
        edges = pa.table(
            {
                "src": pa.array([t[0] for t in e], pa.int64()),
                "dst": pa.array([t[1] for t in e], pa.int64()),
                "weight": pa.array(np.array([t[2] for t in e], np.float64).astype(np.float32), pa.float32()),
            },
            schema=EDGE_SCHEMA,
        )
        rows = sorted(g["vertices"], key=lambda r: r.vertex)
        cols = {
            "vertex": pa.array([r.vertex for r in rows], pa.int64()),
            "partition": pa.array([r.partition for r in rows], pa.int32()),
            "degree": pa.array([r.degree for r in rows], pa.int32()),
        }
        if self.feature_dim > 0:
            flat = (np.concatenate([r.features for r in rows]).astype(np.float32) if rows
                    else np.zeros(0, np.float32))
            cols["features"] = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), self.feature_dim)
        cols["label"] = pa.array([r.label for r in rows], pa.int32())
        cols["split"] = pa.array([r.split for r in rows], pa.string())
        vertices = pa.table(cols, schema=vertex_schema(self.feature_dim))
        for kind, table in (("edges", edges), ("vertices", vertices)):
            rel = f"{kind}/{name}"
            meta = _write_table(table, os.path.join(self.root, kind, name))
            yield Stat("list:files", 1, {"kind": kind, "partition": part, "path": rel, **meta})


class WriteShards(beam.PTransform):
    """{'vertices': VertexRow, 'edges': (src, dst, w), 'assignment': (v, p)} -> Stat records of the files written:
    ``root/edges/part-XXXXX.parquet`` (edges whose destination the partition owns) and
    ``root/vertices/part-XXXXX.parquet``, for every partition 0..P-1 (empty ones included)."""

    def __init__(self, root: str, partitions: int, feature_dim: int):
        super().__init__()
        self.root, self.partitions, self.feature_dim = root, int(partitions), int(feature_dim)

    def expand(self, inputs):
        for kind in ("edges", "vertices"):
            os.makedirs(os.path.join(self.root, kind), exist_ok=True)
        edges = (
            {"in": inputs["edges"] | "ByDestination" >> beam.Map(lambda e: (e[1], (e[0], e[2]))),
             "part": inputs["assignment"]}
            | "JoinPartition" >> beam.CoGroupByKey()
            | "ByPartition" >> beam.FlatMap(_edge_by_destination_partition)
        )
        vertices = inputs["vertices"] | "VertexByPartition" >> beam.Map(lambda r: (r.partition, r))
        every = inputs["vertices"].pipeline | "Partitions" >> beam.Create([(p, None) for p in range(self.partitions)])
        return (
            {"edges": edges, "vertices": vertices, "all": every}
            | "GroupByPartition" >> beam.CoGroupByKey()
            | "Write" >> beam.ParDo(_WritePartition(self.root, self.feature_dim))
        )


def _write_stats(stats: dict, root: str):
    tmp = os.path.join(root, STATS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(stats, f, default=str)
    os.replace(tmp, os.path.join(root, STATS_FILE))


# --- the pipeline --------------------------------------------------------------------------------------------------
class Config(NamedTuple):
    edges: str
    out: str
    features: TableInfo | None
    labels: TableInfo | None
    num_nodes: int | None          # static N (flag or file rows); None = max id + 1
    num_nodes_source: str
    partitions: int
    partitioner: str
    assignment: str | None
    max_bad_records: int
    split: bool
    seed: int
    train_per_class: int
    val_per_class: int


def build(p: beam.Pipeline, cfg: Config, root: str) -> None:
    """Add the prepare transforms to ``p``; shards and ``_stats.json`` are written under ``root``."""
    read = p | "ReadEdges" >> ReadEdges(cfg.edges)
    valid = read["records"] | "Validate" >> Validate(cfg.num_nodes, cfg.num_nodes_source)
    sym = valid["edges"] | "Symmetrize" >> Symmetrize()
    edges = sym["edges"]

    if cfg.num_nodes is not None:
        num_nodes = p | "NumNodes" >> beam.Create([cfg.num_nodes])
    else:
        num_nodes = (
            valid["max_id"]
            | "MaxId" >> beam.CombineGlobally(lambda ids: max(ids, default=-1))
            | "PlusOne" >> beam.Map(lambda m: m + 1)
        )
    vertices = num_nodes | "Vertices" >> Vertices()
    degrees = {"vertices": vertices, "edges": edges} | "Degrees" >> Degrees()
    weighted = {"edges": edges, "degrees": degrees} | "Normalize" >> Normalize()
    parts = {"vertices": vertices, "edges": edges, "num_nodes": num_nodes} | "AssignPartitions" >> AssignPartitions(
        cfg.partitioner, cfg.partitions, cfg.assignment, cfg.seed)

    stats = [read["stats"], valid["stats"], sym["stats"],
             num_nodes | "NumNodesStat" >> beam.Map(lambda n: Stat("max:num_nodes", int(n)))]
    if parts["stats"] is not None:
        stats.append(parts["stats"])
    joined = {"degrees": degrees, "assignment": parts["assignment"]}
    feature_dim = 0
    if cfg.features is not None:
        feats = p | "ReadFeatures" >> ReadFeatures(cfg.features, cfg.num_nodes)
        joined["features"] = feats["rows"]
        stats.append(feats["stats"])
        feature_dim = cfg.features.dim
    if cfg.labels is not None:
        labels = p | "ReadLabels" >> ReadLabels(cfg.labels, cfg.num_nodes)
        joined["labels"] = labels["rows"]
        stats.append(labels["stats"])
        if cfg.split:
            joined["split"] = labels["rows"] | "Split" >> Split(cfg.seed, cfg.train_per_class, cfg.val_per_class)
    rows = joined | "JoinVertices" >> JoinVertices()
    stats.append(rows["stats"])
    files = {"vertices": rows["rows"], "edges": weighted, "assignment": parts["assignment"]} | "WriteShards" >> \
        WriteShards(root, cfg.partitions, feature_dim)
    stats.append(files)
    (
        stats
        | "AllStats" >> beam.Flatten()
        | "MergeStats" >> beam.CombineGlobally(StatsFn())
        | "WriteStats" >> beam.Map(_write_stats, root=root)
    )


# --- driver --------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pipelines.prepare",
        description="Validate, symmetrize, GCN-normalize, partition and shard a graph (Apache Beam). "
                    "Flags not listed here go to Beam's PipelineOptions (e.g. --runner=FlinkRunner).")
    ap.add_argument("--edges", required=True, metavar="GLOB", help="edge files: CSV/TSV/whitespace text or Parquet")
    ap.add_argument("--features", metavar="PATH", help="node features: .npy [N, F] or Parquet")
    ap.add_argument("--labels", metavar="PATH", help="node labels: .npy [N] or Parquet (-1 = unlabelled)")
    ap.add_argument("--num-nodes", type=int, metavar="N", help="vertex count (default: feature/label rows, "
                                                               "else max edge id + 1)")
    ap.add_argument("--partitions", type=int, default=1, metavar="P")
    ap.add_argument("--partitioner", choices=("hash", "metis", "file"), default="hash",
                    help="hash: v %% P; metis: pymetis (whole graph in one worker); file: --assignment")
    ap.add_argument("--assignment", metavar="FILE", help="METIS partition file: line i = partition of vertex i")
    ap.add_argument("--max-bad-records", type=int, default=0, metavar="N",
                    help="fail when more edge lines than this are malformed (default 0)")
    ap.add_argument("--split", action="store_true",
                    help="seeded per-class split of the labelled vertices (needs --labels)")
    ap.add_argument("--train-per-class", type=int, default=20)
    ap.add_argument("--val-per-class", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="seed of the split and of METIS (default 0)")
    ap.add_argument("--out", required=True, metavar="DIR")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    ap.add_argument("--engine", choices=("direct", "flink"),
                    help="shorthand for the runner flags of pipelines.beam.runners.runner_options")
    return ap


def make_config(args: argparse.Namespace) -> Config:
    """Check the flags and the feature/label files' shapes before any pipeline runs (cheap, clear errors)."""
    if args.partitions < 1:
        raise DataError(f"--partitions must be >= 1, got {args.partitions}")
    if args.partitioner == "file" and not args.assignment:
        raise DataError("--partitioner file needs --assignment FILE")
    if args.assignment and args.partitioner != "file":
        raise DataError("--assignment is only used with --partitioner file")
    if args.assignment and not FileSystems.exists(args.assignment):
        raise DataError(f"assignment file {args.assignment} does not exist")
    if args.max_bad_records < 0:
        raise DataError("--max-bad-records must be >= 0")
    if args.split and not args.labels:
        raise DataError("--split needs --labels")
    if args.num_nodes is not None and not 0 <= args.num_nodes <= ID_LIMIT:
        raise DataError(f"--num-nodes must lie in [0, {ID_LIMIT}]")
    try:
        matched = FileSystems.match([args.edges])[0].metadata_list
    except Exception as e:  # BeamIOError for a missing non-glob path on some file systems
        raise DataError(f"--edges {args.edges!r}: {e}") from None
    if not matched:
        raise DataError(f"--edges {args.edges!r} matches no file")
    feats = inspect_features(args.features) if args.features else None
    labels = inspect_labels(args.labels) if args.labels else None
    n, source = args.num_nodes, "--num-nodes"
    for info, what in ((feats, "--features"), (labels, "--labels")):
        if info is None:
            continue
        if n is None:
            n, source = info.rows, f"from the {info.rows} rows of {what} {info.path}"
        elif info.rows != n:
            raise DataError(f"{what} {info.path} has {info.rows} rows but the graph has {n} vertices ({source})")
    if feats is not None and feats.kind == "npy" and feats.dim == 0:
        feats = None   # [N, 0]: no features
    return Config(args.edges, args.out, feats, labels, n, source, args.partitions, args.partitioner,
                  args.assignment, args.max_bad_records, args.split, args.seed, args.train_per_class,
                  args.val_per_class)


ERROR_COUNTERS = (
    ("ids_out_of_range", "edge ids out of range"),
    ("features_vertex_out_of_range", "feature rows for vertices outside the graph"),
    ("nan_features", "feature rows with NaN/inf"),
    ("bad_feature_rows", "feature rows of the wrong width or null"),
    ("missing_features", "vertices without a feature row"),
    ("duplicate_features", "vertices with several feature rows"),
    ("labels_vertex_out_of_range", "label rows for vertices outside the graph"),
    ("bad_labels", "invalid labels"),
    ("missing_labels", "vertices without a label row"),
    ("duplicate_labels", "vertices with several label rows"),
    ("assignment_errors", "partition assignment problems"),
)


def check_stats(stats: dict, cfg: Config) -> None:
    """Raise DataError naming every problem the pipeline found (with examples)."""
    problems = []
    for name, what in ERROR_COUNTERS:
        n, samples = stats.get(name, (0, []))
        if n:
            problems.append(f"{n} {what}, e.g. " + "; ".join(map(str, samples[:3])))
    n_bad, samples = stats.get("bad_records", (0, []))
    if n_bad > cfg.max_bad_records:
        problems.append(f"{n_bad} bad edge records exceed --max-bad-records={cfg.max_bad_records}: "
                        + "; ".join(map(str, samples[:5])))
    if problems:
        raise DataError("prepare failed: " + " | ".join(problems))


COUNTERS = ("input_records", "bad_records", "header_lines", "self_loops", "duplicate_edges")


def make_manifest(stats: dict, cfg: Config, args: argparse.Namespace, pipeline_args: list[str]) -> dict:
    files = sorted(stats.get("list:files", (0, []))[1], key=lambda f: (f["kind"], f["partition"]))
    by_kind = {k: [f for f in files if f["kind"] == k] for k in ("edges", "vertices")}
    for kind, lst in by_kind.items():
        got = [f["partition"] for f in lst]
        if got != list(range(cfg.partitions)):
            raise RuntimeError(f"internal error: {kind} shards {got} written for {cfg.partitions} partitions")
    n = int(stats.get("max:num_nodes", (0,))[0])
    edge_rows = sum(f["rows"] for f in by_kind["edges"])
    vertex_rows = sum(f["rows"] for f in by_kind["vertices"])
    if vertex_rows != n:
        raise RuntimeError(f"internal error: {vertex_rows} vertex rows for {n} vertices")
    max_label = stats.get("max:label")
    counters = {c: int(stats.get(c, (0,))[0]) for c in COUNTERS}
    counters["valid_edges"] = (counters["input_records"] - counters["bad_records"] - counters["self_loops"])
    split = None
    if cfg.split:
        split = {name: int(stats.get(f"split_{name}", (0,))[0]) for name in SPLIT_NAMES}
        split.update(seed=cfg.seed, train_per_class=cfg.train_per_class, val_per_class=cfg.val_per_class)
    flags = {k: v for k, v in vars(args).items()}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "num_nodes": n,
        "num_edges": edge_rows - n,            # directed, both directions, without the self-loops (= adj.nnz)
        "num_edge_rows": edge_rows,            # rows in the edge shards: num_edges + one self-loop per vertex
        "feature_dim": cfg.features.dim if cfg.features is not None else 0,
        "num_classes": int(max_label[0]) + 1 if max_label else 0,
        "partitions": cfg.partitions,
        "partitioner": cfg.partitioner,
        "normalization": "gcn: edge rows hold A_hat[dst, src] = 1/sqrt(deg(src)) * 1/sqrt(deg(dst)) of "
                         "A_hat = D^-1/2 (A + I) D^-1/2; degree counts the self-loop",
        "split": split,
        "files": {"edges": [{k: f[k] for k in ("path", "partition", "rows", "bytes", "sha256")}
                            for f in by_kind["edges"]],
                  "vertices": [{k: f[k] for k in ("path", "partition", "rows", "bytes", "sha256")}
                               for f in by_kind["vertices"]]},
        "counters": counters,
        "bad_record_samples": list(stats.get("bad_records", (0, []))[1]),
        "flags": flags,
        "pipeline_args": list(pipeline_args),
        "schemas": {"edges": EDGE_SCHEMA.to_string(show_schema_metadata=False),
                    "vertices": vertex_schema(cfg.features.dim if cfg.features else 0)
                    .to_string(show_schema_metadata=False)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _commit(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif not overwrite:
            raise DataError(f"--out {out} exists; pass --overwrite to replace it")
        else:
            old = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.replace(tmp, out)


def run(argv: list[str] | None = None) -> dict:
    """Run the prepare pipeline; returns the manifest. Raises DataError on bad input (no manifest is left)."""
    parser = build_parser()
    args, pipeline_args = parser.parse_known_args(argv)
    cfg = make_config(args)
    out = Path(args.out).absolute()
    if out.exists() and not args.overwrite and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists; pass --overwrite to replace it")
    if args.engine:
        from pipelines.beam.runners import runner_options

        pipeline_args = runner_options(args.engine, pipeline_args)
    options = PipelineOptions(pipeline_args)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        with beam.Pipeline(options=options) as p:
            build(p, cfg, str(tmp))
        stats_path = tmp / STATS_FILE
        if not stats_path.is_file():
            raise RuntimeError(f"the pipeline finished without writing {stats_path}")
        stats = json.loads(stats_path.read_text())
        check_stats(stats, cfg)
        manifest = make_manifest(stats, cfg, args, pipeline_args)
        stats_path.unlink()
        mtmp = tmp / "manifest.json.tmp"
        mtmp.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
        os.replace(mtmp, tmp / "manifest.json")
        _commit(tmp, out, args.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    c = manifest["counters"]
    if c["bad_records"]:
        log.warning("skipped %d bad edge records, e.g. %s", c["bad_records"], manifest["bad_record_samples"][:3])
    log.info("prepared %s: %d vertices, %d edges, %d partitions (%d self-loops, %d duplicates dropped)", out,
             manifest["num_nodes"], manifest["num_edges"], manifest["partitions"], c["self_loops"],
             c["duplicate_edges"])
    return manifest


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pipelines.beam.runners import RunnerUnavailable

    try:
        manifest = run(argv)
    except (DataError, RunnerUnavailable) as e:   # one line, exit 2: the convention of the `dorylus` CLI
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("num_nodes", "num_edges", "feature_dim", "num_classes",
                                               "partitions")} | {"out": str(Path(manifest["flags"]["out"]))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
