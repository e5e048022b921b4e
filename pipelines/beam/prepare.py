"""Prepare a graph for Dorylus: validate, symmetrize, normalize, partition and shard it (an Apache Beam pipeline).

    python -m pipelines.prepare --edges 'data/g/edges-*.csv' --features data/g/x.npy --labels data/g/y.npy \\
        --partitions 4 --partitioner metis --split --out runs/g-prepared            # DirectRunner
    python -m pipelines.prepare ... --engine direct --workers 2                     # DirectRunner, 2 processes
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
--split           a seeded per-class split of the labelled vertices (``--train-per-class``, ``--val-per-class``);
--split-file PATH or a given one: ``.npy`` int array [N] (or Parquet ``split`` column + optional id column) of the
                  codes of :data:`schemas.files.SPLIT_CODES`: -1 none, 0 train, 1 val, 2 test.
--num-nodes N     default: the row count of --features (else of --labels), else max edge id + 1.

Outputs (``--out DIR``)
-----------------------
DIR/edges/part-XXXXX.parquet     :data:`schemas.files.EDGE_SHARD_SCHEMA` (src int64, dst int64, weight float32):
                                 the nonzeros of Â = D^-1/2 (A + I) D^-1/2 whose *destination* (row) vertex the
                                 partition owns, self-loops included, sorted by (dst, src); weight = Â[dst, src]
                                 = 1/sqrt(deg_src) * 1/sqrt(deg_dst), deg counting the self-loop.
DIR/vertices/part-XXXXX.parquet  :func:`schemas.files.vertex_shard_schema` (vertex int64, partition int32,
                                 degree int32 [with self-loop], features fixed_size_list<float32>[F] [absent
                                 when F = 0], label int32 [-1 none], split int8 [SPLIT_CODES]), sorted by vertex.
DIR/manifest.json                passes :func:`schemas.files.validate_manifest`: sizes, one entry per partition
                                 (paths, row counts, sha256), counters, the flags used.

The run is atomic: everything is written into ``DIR.tmp-<uuid>`` next to DIR, the manifest is written last, and
the directory is renamed to DIR only when every check passed; on any error the temporary directory is removed,
so a DIR with a manifest.json is always complete. An existing DIR is replaced only with ``--overwrite``.

How it scales
-------------
Elements are numpy *chunks*, never single edges: a reader parses ~16 MiB of text (Arrow's CSV parser; a block
with a comment, a bad line or odd spacing is re-split and the failing lines parsed one by one, so bad records
keep their file and line) or one Parquet record batch into one chunk of edges; validation, symmetrization and
routing are vectorized per chunk. One shuffle moves every directed edge entry to the partition that owns its
destination (the graph server that will gather over it); there the entries are sorted and deduplicated
(``np.sort`` of packed uint64 keys), degrees counted and the vertex shard written. Degrees are then broadcast as
a side input (8 bytes per vertex) so that each partition can weight its edges and write its edge shard.
A partition's shard is built in one worker's memory (as a Dorylus graph server holds its partition);
``--partitioner metis`` and ``--split`` collect the whole edge list / label vector in one worker (METIS and the
per-class permutation need them); the partition assignment of ``metis``/``file`` is broadcast (4 bytes/vertex).
The output paths must be on a file system that the workers and this process share (local or mounted).
"""
from __future__ import annotations

import argparse
import array
import datetime
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.io import fileio
from apache_beam.io.filesystems import FileSystems

from pipelines.beam.runners import CommandParser, pipeline_options
from pipelines.data.graph import DataError
from schemas import files as file_schemas
from schemas.messages import SCHEMA_VERSION

log = logging.getLogger("dorylus.prepare")

FORMAT = "dorylus-prepared"
FORMAT_VERSION = 2
ID_LIMIT = 2**31 - 1          # CSR indices are int32 throughout the system
ID_COLUMNS = ("vertex", "node", "node_id", "id")
PARQUET_SUFFIXES = (".parquet", ".pq")
SAMPLES = 20                  # examples kept per counter (bad records, errors)
SPLIT_NAMES = ("train", "val", "test")
SPLIT_CODES = file_schemas.SPLIT_CODES          # none -1, train 0, val 1, test 2
STATS_FILE = "_stats.json"
BLOCK_BYTES = 16 << 20        # text is parsed in blocks of about this many bytes
MIN_FAST_LINES = 4096         # a failing block is halved down to this size before lines are parsed one by one
PARQUET_BATCH = 1 << 20       # rows per Parquet record batch
TABLE_CHUNK_BYTES = 16 << 20  # feature/label .npy files are read in chunks of about this many bytes

# --- Parquet schemas of the shards (schemas/files.py) ------------------------------------------------------------
EDGE_SCHEMA = file_schemas.EDGE_SHARD_SCHEMA.with_metadata(
    {**file_schemas.EDGE_SHARD_SCHEMA.metadata, b"dorylus.normalization": b"gcn-sym-self-loops"})


def vertex_schema(feature_dim: int) -> pa.Schema:
    """schemas.files.vertex_shard_schema(F); without the features column when F = 0."""
    if feature_dim > 0:
        return file_schemas.vertex_shard_schema(feature_dim)
    schema = file_schemas.vertex_shard_schema(1)
    return schema.remove(schema.get_field_index("features"))


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


def _stats(name: str, n: int, samples=()):
    """Tagged Stat outputs: the count, then up to SAMPLES samples (count 0 each)."""
    if n:
        yield pvalue.TaggedOutput("stats", Stat(name, int(n)))
    for s in list(samples)[:SAMPLES]:
        yield pvalue.TaggedOutput("stats", Stat(name, 0, s))


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


class ConcatArrays(beam.CombineFn):
    """Tuples of k numpy arrays -> one tuple of k concatenated arrays (for the steps that need a whole vector in
    one place: METIS, the per-class split, the degree vector)."""

    def __init__(self, dtypes: tuple):
        self.dtypes = tuple(np.dtype(d).str for d in dtypes)

    def create_accumulator(self):
        return [[] for _ in self.dtypes]

    def add_input(self, acc, row):
        for parts, a in zip(acc, row):
            parts.append(np.asarray(a))
        return acc

    def merge_accumulators(self, accs):
        out = self.create_accumulator()
        for acc in accs:
            for o, parts in zip(out, acc):
                o.extend(parts)
        return [[np.concatenate(o)] if len(o) > 1 else o for o in out]

    def extract_output(self, acc):
        return tuple(np.concatenate(parts).astype(dt, copy=False) if parts else np.zeros(0, dt)
                     for parts, dt in zip(acc, self.dtypes))


# --- ReadEdges -----------------------------------------------------------------------------------------------------
_INT_RE = re.compile(r"[+-]?[0-9]+")
_HEADER_TOKEN_RE = re.compile(r"[A-Za-z_].*")
_INT64_MAX = 2**63 - 1


class EdgeChunk(NamedTuple):
    """Edges read from one file: ``src``/``dst`` int64 arrays; ``lines`` is the line (row) of the first edge when
    the edges sit on consecutive lines, else an int64 array with the line of every edge."""

    path: str
    lines: object
    src: np.ndarray
    dst: np.ndarray

    def line(self, i: int) -> int:
        return self.lines + int(i) if isinstance(self.lines, int) else int(self.lines[i])


def _is_parquet(path: str) -> bool:
    return path.lower().endswith(PARQUET_SUFFIXES)


def _split_fields(body: str) -> tuple[str, ...]:
    if "," in body:
        return tuple(t.strip() for t in body.split(","))
    if "\t" in body:
        return tuple(t.strip() for t in body.split("\t"))
    return tuple(body.split())


def _line_body(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").split("#", 1)[0].strip()


def _as_id(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INT_RE.fullmatch(value):
        return int(value)
    return None


class _Records:
    """Accumulates parsed records of the slow (one line at a time) path into arrays and bad-record stats."""

    def __init__(self, path: str):
        self.path = path
        self.lines, self.src, self.dst = array.array("q"), array.array("q"), array.array("q")
        self.inputs = 0
        self.bad = 0
        self.samples: list[str] = []

    def add(self, line: int, fields) -> None:
        self.inputs += 1
        where = f"{self.path}:{line}"
        if len(fields) != 2:
            return self._bad(f"{where}: expected 2 fields (src dst), got {len(fields)}")
        ids = []
        for value in fields:
            v = _as_id(value)
            if v is None:
                what = "empty field" if value is None or value == "" else f"non-integer field {value!r}"
                return self._bad(f"{where}: {what}")
            if not -_INT64_MAX <= v <= _INT64_MAX:
                return self._bad(f"{where}: integer {v} does not fit int64")
            ids.append(v)
        self.lines.append(line)
        self.src.append(ids[0])
        self.dst.append(ids[1])

    def _bad(self, sample: str) -> None:
        self.bad += 1
        if len(self.samples) < SAMPLES:
            self.samples.append(sample)

    def emit(self):
        yield from _stats("input_records", self.inputs)
        yield from _stats("bad_records", self.bad, self.samples)
        if len(self.src):
            yield EdgeChunk(self.path, np.frombuffer(self.lines, np.int64).copy(),
                            np.frombuffer(self.src, np.int64).copy(), np.frombuffer(self.dst, np.int64).copy())


def _fast_parse(data: bytes, n_lines: int):
    """(src, dst) int64 arrays when every line of ``data`` is exactly two integers (Arrow's CSV parser); else None."""
    if b"#" in data:
        return None
    delim = "," if b"," in data else "\t" if b"\t" in data else " "
    try:
        table = pacsv.read_csv(
            pa.py_buffer(data),
            read_options=pacsv.ReadOptions(column_names=["src", "dst"]),
            parse_options=pacsv.ParseOptions(delimiter=delim, quote_char=False, escape_char=False,
                                             ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(column_types={"src": pa.int64(), "dst": pa.int64()}))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != n_lines or table.column(0).null_count or table.column(1).null_count:
        return None   # blank lines come back as rows of nulls
    return (table.column(0).to_numpy().astype(np.int64, copy=False),
            table.column(1).to_numpy().astype(np.int64, copy=False))


def _parse_block(path: str, data: bytes, line0: int):
    """Edges of a block of whole lines whose first line is ``line0 + 1``: the fast path, else halves, else the
    slow path that reports every bad line."""
    n_lines = data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
    arrays = _fast_parse(data, n_lines)
    if arrays is not None:
        yield from _stats("input_records", n_lines)
        yield EdgeChunk(path, line0 + 1, *arrays)
        return
    if n_lines > 2 * MIN_FAST_LINES:
        cut = data.find(b"\n", len(data) // 2)
        if 0 <= cut < len(data) - 1:
            head = data[:cut + 1]
            yield from _parse_block(path, head, line0)
            yield from _parse_block(path, data[cut + 1:], line0 + head.count(b"\n"))
            return
    rec = _Records(path)
    pieces = data.split(b"\n")
    if data.endswith(b"\n"):
        pieces.pop()
    for i, raw in enumerate(pieces):
        body = _line_body(raw)
        if body:
            rec.add(line0 + i + 1, _split_fields(body))
    yield from rec.emit()


def _read_text(f, path: str, block_bytes: int = BLOCK_BYTES):
    """Chunks of a text edge file (a Beam file object: plain or decompressed)."""
    line0 = 0
    seen_data = False
    pending = b""
    while True:
        block = f.read(block_bytes)
        data = pending + block if pending else block
        if block:
            cut = data.rfind(b"\n")
            if cut < 0:
                pending = data
                continue
            pending, data = data[cut + 1:], data[:cut + 1]
        else:
            pending = b""
        if not data:
            return
        n = data.count(b"\n")
        if not seen_data:
            # Up to the first data line: comments, blank lines and the optional header, one line at a time.
            pos, line = 0, line0
            while pos < len(data):
                end = data.find(b"\n", pos)
                end = len(data) if end < 0 else end + 1
                body = _line_body(data[pos:end])
                if body:
                    seen_data = True
                    fields = _split_fields(body)
                    if fields and all(_HEADER_TOKEN_RE.fullmatch(t) for t in fields):
                        yield from _stats("header_lines", 1, [f"{path}:{line + 1}"])
                        pos, line = end, line + 1
                    break
                pos, line = end, line + 1
            if data[pos:]:
                yield from _parse_block(path, data[pos:], line)
        else:
            yield from _parse_block(path, data, line0)
        line0 += n
        if not block:
            return


class _ReadEdgeFile(beam.DoFn):
    """ReadableFile -> EdgeChunk (+ stats: input_records, bad_records, header_lines)."""

    def process(self, readable: fileio.ReadableFile):
        path = readable.metadata.path
        with readable.open() as f:   # Beam's CompressedFile (.gz, ...) supports read(n)
            if _is_parquet(path):
                yield from self._parquet(f, path)
            else:
                yield from _read_text(f, path)

    def _parquet(self, f, path):
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        cols = ["src", "dst"] if {"src", "dst"} <= set(names) else names[:2]
        if len(cols) < 2:   # one bad record for the whole file
            rec = _Records(path)
            rec.add(0, tuple(cols))
            yield from rec.emit()
            return
        row = 0
        for batch in pf.iter_batches(columns=cols, batch_size=PARQUET_BATCH):
            a, b = batch.column(0), batch.column(1)
            try:
                if not (pa.types.is_integer(a.type) and pa.types.is_integer(b.type)):
                    raise pa.ArrowInvalid("not integer columns")
                a64, b64 = a.cast(pa.int64()), b.cast(pa.int64())   # uint64 beyond int64 raises
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                rec = _Records(path)
                for i, (x, y) in enumerate(zip(a.to_pylist(), b.to_pylist())):
                    rec.add(row + i + 1, (x, y))
                yield from rec.emit()
                row += len(batch)
                continue
            n = len(batch)
            yield from _stats("input_records", n)
            if a64.null_count or b64.null_count:
                valid = ~(a64.is_null().to_numpy(zero_copy_only=False) | b64.is_null().to_numpy(zero_copy_only=False))
                bad = np.flatnonzero(~valid)
                yield from _stats("bad_records", bad.size,
                                  [f"{path}:{row + i + 1}: empty field" for i in bad[:SAMPLES]])
                lines = np.flatnonzero(valid).astype(np.int64) + row + 1
                src = a64.fill_null(0).to_numpy(zero_copy_only=False)[valid]
                dst = b64.fill_null(0).to_numpy(zero_copy_only=False)[valid]
                if src.size:
                    yield EdgeChunk(path, lines, src, dst)
            elif n:
                yield EdgeChunk(path, row + 1, a64.to_numpy(zero_copy_only=False),
                                b64.to_numpy(zero_copy_only=False))
            row += n


class ReadEdges(beam.PTransform):
    """PBegin -> {'chunks': EdgeChunk, 'stats': Stat}; every file matching ``pattern``."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern

    def expand(self, pbegin):
        out = (
            pbegin
            | "Match" >> fileio.MatchFiles(self.pattern, empty_match_treatment=fileio.EmptyMatchTreatment.DISALLOW)
            | "SpreadFiles" >> beam.Reshuffle()
            | "Open" >> fileio.ReadMatches()
            | "Parse" >> beam.ParDo(_ReadEdgeFile()).with_outputs("stats", main="chunks")
        )
        return {"chunks": out.chunks, "stats": out.stats}


# --- Validate ------------------------------------------------------------------------------------------------------
class _ValidateChunk(beam.DoFn):
    def __init__(self, limit: int, limit_source: str):
        self.limit = limit
        self.limit_source = limit_source

    def process(self, chunk: EdgeChunk):
        src, dst, limit = chunk.src, chunk.dst, self.limit
        src_bad = (src < 0) | (src >= limit)
        bad = src_bad | (dst < 0) | (dst >= limit)
        if bad.any():
            idx = np.flatnonzero(bad)
            samples = []
            for i in idx[:SAMPLES]:
                v = int(src[i] if src_bad[i] else dst[i])
                samples.append(f"{chunk.path}:{chunk.line(i)}: vertex id {v} out of range [0, {limit}) "
                               f"({self.limit_source})")
            yield from _stats("ids_out_of_range", idx.size, samples)
            keep = ~bad
            src, dst = src[keep], dst[keep]
            chunk = EdgeChunk(chunk.path, _kept_lines(chunk, keep), src, dst)
        if not src.size:
            return
        yield pvalue.TaggedOutput("max_id", int(max(src.max(), dst.max())))
        loops = src == dst
        if loops.any():
            idx = np.flatnonzero(loops)
            yield from _stats("self_loops", idx.size, [f"{chunk.path}:{chunk.line(i)}" for i in idx[:SAMPLES]])
            src, dst = src[~loops], dst[~loops]
        if src.size:
            yield src.astype(np.int32), dst.astype(np.int32)


def _kept_lines(chunk: EdgeChunk, keep: np.ndarray):
    if isinstance(chunk.lines, int):
        return np.flatnonzero(keep).astype(np.int64) + chunk.lines
    return chunk.lines[keep]


class Validate(beam.PTransform):
    """EdgeChunk -> {'edges': (src, dst) int32 arrays of valid non-loop edges, 'max_id': int, 'stats': Stat}.

    ``num_nodes``: ids must lie in [0, num_nodes); None = any id in [0, 2**31 - 1) (N is inferred afterwards).
    """

    def __init__(self, num_nodes: int | None, num_nodes_source: str = "--num-nodes"):
        super().__init__()
        self.limit = ID_LIMIT if num_nodes is None else int(num_nodes)
        self.source = "ids must fit int32" if num_nodes is None else num_nodes_source

    def expand(self, chunks):
        out = chunks | "Check" >> beam.ParDo(_ValidateChunk(self.limit, self.source)).with_outputs(
            "stats", "max_id", main="edges")
        return {"edges": out.edges, "max_id": out.max_id, "stats": out.stats}


# --- AssignPartitions ----------------------------------------------------------------------------------------------
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


class _Metis(beam.DoFn):
    """All valid edges (collected) -> Assignment by METIS on the symmetric graph: the same call, on the same CSR,
    as the engine's ``pipelines.engine.partition.assign(..., "metis", seed)``, so both agree for a seed."""

    def __init__(self, parts: int, seed: int):
        self.parts, self.seed = parts, seed

    def process(self, columns, num_nodes):
        from pipelines.data.graph import clean_adjacency

        src, dst = columns
        n = int(num_nodes)
        if self.parts == 1 or n == 0:
            yield Assignment(self.parts, np.zeros(n, np.int32), "metis")
            return
        if self.parts > n:
            yield from _stats("assignment_errors", 1, [f"--partitions {self.parts} exceeds the {n} vertices"])
            yield Assignment(self.parts, np.zeros(n, np.int32), "metis")
            return
        from pipelines.engine.partition import assign

        adj = clean_adjacency(src, dst, n)
        yield Assignment(self.parts, assign(adj, self.parts, "metis", self.seed), "metis")


class _ReadAssignment(beam.DoFn):
    def __init__(self, path: str, parts: int):
        self.path = path
        self.parts = parts

    def process(self, _, num_nodes):
        n = int(num_nodes)
        values = array.array("q")
        errors, samples = 0, []

        def error(msg):
            nonlocal errors
            errors += 1
            if len(samples) < SAMPLES:
                samples.append(msg)

        with FileSystems.open(self.path) as f:
            for lineno, raw in enumerate(f, start=1):
                body = raw.decode("utf-8", errors="replace").split("#", 1)[0].strip()
                if not body:
                    continue
                if not _INT_RE.fullmatch(body):
                    error(f"{self.path}:{lineno}: not an integer: {body!r}")
                    values.append(0)
                    continue
                part = int(body)
                if not 0 <= part < self.parts:
                    error(f"{self.path}:{lineno}: partition {part} out of range [0, {self.parts})")
                    part = 0
                values.append(part)
        if len(values) != n:
            error(f"{self.path}: {len(values)} partition ids for {n} vertices (one line per vertex)")
        vec = np.zeros(n, np.int32)
        got = np.frombuffer(values, np.int64)[:n]
        vec[:got.size] = got
        yield from _stats("assignment_errors", errors, samples)
        yield Assignment(self.parts, vec, "file")


class AssignPartitions(beam.PTransform):
    """{'edges': (src, dst) arrays, 'num_nodes'} -> {'assignment': one Assignment, 'stats': Stat or None}.

    hash: ``v % P``; metis: METIS on the whole symmetric graph (collected in one worker), seeded;
    file: a METIS-style assignment file, line i = the partition of vertex i.
    """

    def __init__(self, method: str, parts: int, assignment: str | None = None, seed: int = 0):
        super().__init__()
        if method not in ("hash", "metis", "file"):
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


def _by_partition(parts: np.ndarray, num_parts: int, *arrays):
    """(p, arrays restricted to partition p) for every partition with rows."""
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


# --- Symmetrize ----------------------------------------------------------------------------------------------------
_ONE = np.uint64(1)
_SHIFT_DST = np.uint64(33)
_LOW32 = np.uint64(0xFFFFFFFF)


def _entry_keys(dst: np.ndarray, src: np.ndarray, forward: int) -> np.ndarray:
    """Packed uint64 entries: dst << 33 | src << 1 | forward (ids < 2**31). Sorting them sorts by (dst, src)."""
    keys = (dst.astype(np.uint64) << _SHIFT_DST) | (src.astype(np.uint64) << _ONE)
    if forward:
        keys |= _ONE
    return keys


class _Route(beam.DoFn):
    def process(self, edges, assignment):
        src, dst = edges
        # the record's own direction (forward bit set: repeats of it are duplicates) and its reverse
        keys = np.concatenate([_entry_keys(dst, src, 1), _entry_keys(src, dst, 0)])
        heads = np.concatenate([dst, src])
        yield from _stats("routed:entries", keys.size)
        yield from _by_partition(assignment.of(heads), assignment.parts, keys)


class Symmetrize(beam.PTransform):
    """(src, dst) edge arrays -> {'entries': (partition, uint64 entry keys), 'stats'}: both directions of every
    edge, routed to the partition that owns the entry's destination. Deduplication happens there
    (:class:`BuildPartitions`): a record repeating an earlier one in the same direction counts as a duplicate
    (its reverse does not)."""

    def __init__(self, assignment):
        super().__init__()
        self.assignment = assignment

    def expand(self, edges):
        out = edges | "BothDirections" >> beam.ParDo(
            _Route(), assignment=pvalue.AsSingleton(self.assignment)).with_outputs("stats", main="entries")
        return {"entries": out.entries, "stats": out.stats}


# --- features, labels and split files ------------------------------------------------------------------------------
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


def inspect_labels(path: str, what: str = "label", column: str = "label") -> TableInfo:
    """Labels (or, with what="split", split codes): .npy int [N], or Parquet with ``column`` (else the only
    non-id column) and the optional id column."""
    if not os.path.isfile(path):
        raise DataError(f"{what} file {path} does not exist")
    if path.endswith(".npy"):
        shape, dtype = _npy_header(path)
        if len(shape) != 1:
            raise DataError(f"{path}: {what}s must be a 1-D array [nodes], got shape {shape}")
        if dtype.kind not in "iu":
            raise DataError(f"{path}: {what}s must be integers, got dtype {dtype}")
        return TableInfo(path, "npy", int(shape[0]), 0, None, ())
    if not path.lower().endswith(PARQUET_SUFFIXES):
        raise DataError(f"{path}: {what} files must be .npy or .parquet")
    pf, schema, id_col, groups = _parquet_meta(path)
    others = [f for f in schema if f.name != id_col]
    if column in schema.names:
        col = schema.field(column)
    elif len(others) == 1:
        col = others[0]
    else:
        raise DataError(f"{path}: no {column!r} column among {schema.names}")
    if not pa.types.is_integer(col.type):
        raise DataError(f"{path}: {what}s must be integers, column {col.name!r} is {col.type}")
    return TableInfo(path, "parquet", pf.metadata.num_rows, 0, id_col, (col.name,), groups)


def _plan_chunks(_, info: TableInfo):
    if info.kind == "npy":
        step = max(1, TABLE_CHUNK_BYTES // (8 * max(info.dim, 1)))
        for start in range(0, info.rows, step):
            yield start, min(start + step, info.rows)
    else:
        yield from info.row_groups


class _ReadRows(beam.DoFn):
    """A chunk of a feature/label/split file -> (partition, (vertex ids, values)) (+ stats), vectorized.
    values: float32 [k, F] (features) or int64 [k] (labels, split codes)."""

    def __init__(self, info: TableInfo, what: str, num_nodes: int):
        self.info, self.what, self.num_nodes = info, what, num_nodes

    def _read(self, chunk):
        """(ids, first row, values, bad-row mask, bad-row messages)."""
        info = self.info
        if info.kind == "npy":
            start, stop = chunk
            arr = np.asarray(np.load(info.path, mmap_mode="r", allow_pickle=False)[start:stop])
            return np.arange(start, stop, dtype=np.int64), start, arr, None
        index, first = chunk
        table = pq.ParquetFile(info.path).read_row_group(index)
        k = table.num_rows
        ids = (table.column(info.id_column).to_numpy(zero_copy_only=False).astype(np.int64) if info.id_column
               else np.arange(first, first + k, dtype=np.int64))
        if self.what != "features":
            col = table.column(info.value_columns[0])
            return ids, first, col.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64), None
        dim = info.dim
        if len(info.value_columns) == 1 and _is_list_type(table.schema.field(info.value_columns[0]).type):
            col = table.column(info.value_columns[0]).combine_chunks()
            nulls = col.is_null().to_numpy(zero_copy_only=False)
            lengths = (np.full(k, col.type.list_size) if pa.types.is_fixed_size_list(col.type)
                       else col.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False))
            good = ~nulls & (lengths == dim)
            mat = np.zeros((k, dim), np.float64)
            if good.any():
                flat = col.filter(pa.array(good)).flatten().cast(pa.float64())
                mat[good] = flat.to_numpy(zero_copy_only=False).reshape(-1, dim)   # null values -> NaN
            why = np.where(nulls, "null features", "")
            msgs = {i: (why[i] or f"{lengths[i]} features, expected {dim}") for i in np.flatnonzero(~good)[:SAMPLES]}
            return ids, first, mat, (~good, msgs)
        cols = [table.column(c) for c in info.value_columns]
        nulls = np.zeros(k, bool)
        for c in cols:
            if c.null_count:
                nulls |= c.is_null().to_numpy(zero_copy_only=False)
        mat = np.column_stack([c.fill_null(0).to_numpy(zero_copy_only=False) for c in cols]).astype(np.float64)
        return ids, first, mat, (nulls, {i: "null features" for i in np.flatnonzero(nulls)[:SAMPLES]})

    def process(self, chunk, assignment):
        ids, first, values, shape_problems = self._read(chunk)
        what, n, path = self.what, self.num_nodes, self.info.path

        def where(i):
            return f"{path}: row {first + int(i)}"

        keep = (ids >= 0) & (ids < n)
        if not keep.all():
            bad = np.flatnonzero(~keep)
            yield from _stats(f"{what}_vertex_out_of_range", bad.size,
                              [f"{where(i)}: vertex {ids[i]} out of range [0, {n})" for i in bad[:SAMPLES]])
        if what == "labels":
            bad = keep & (values < -1)
            if bad.any():
                idx = np.flatnonzero(bad)
                yield from _stats("bad_labels", idx.size,
                                  [f"{where(i)}: label {values[i]} < -1" for i in idx[:SAMPLES]])
                keep &= ~bad
        elif what == "splits":
            bad = keep & ((values < -1) | (values > max(SPLIT_CODES.values())))
            if bad.any():
                idx = np.flatnonzero(bad)
                yield from _stats("bad_splits", idx.size,
                                  [f"{where(i)}: split code {values[i]} not in -1..2" for i in idx[:SAMPLES]])
                keep &= ~bad
        else:
            if shape_problems is not None:
                mask, msgs = shape_problems
                bad = keep & mask
                if bad.any():
                    idx = np.flatnonzero(bad)
                    yield from _stats("bad_feature_rows", idx.size,
                                      [f"{where(i)}: {msgs.get(int(i), 'bad row')}" for i in idx[:SAMPLES]])
                    keep &= ~bad
            values = np.asarray(values, np.float64) if values.dtype != np.float64 else values
            finite = np.isfinite(values).all(axis=1) if values.size else np.ones(len(values), bool)
            bad = keep & ~finite
            if bad.any():
                idx = np.flatnonzero(bad)
                yield from _stats("nan_features", idx.size, [
                    f"{where(i)} (vertex {ids[i]}): {'NaN' if np.isnan(values[i]).any() else 'inf'}"
                    for i in idx[:SAMPLES]])
                keep &= ~bad
            values = values.astype(np.float32)
        if not keep.all():
            ids, values = ids[keep], values[keep]
        yield from _stats(f"routed:{what}", ids.size)
        yield from _by_partition(assignment.of(ids), assignment.parts, ids, values)


class ReadTable(beam.PTransform):
    """PBegin -> {'rows': (partition, (ids, values)), 'stats'} from a file described by :class:`TableInfo`;
    rows are routed to the partition that owns their vertex (``assignment``: a singleton PCollection)."""

    def __init__(self, info: TableInfo, what: str, num_nodes: int, assignment):
        super().__init__()
        assert what in ("features", "labels", "splits")
        self.info, self.what, self.num_nodes, self.assignment = info, what, num_nodes, assignment

    def expand(self, pbegin):
        out = (
            pbegin
            | "Impulse" >> beam.Impulse()
            | "Plan" >> beam.FlatMap(_plan_chunks, info=self.info)
            | "Spread" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(_ReadRows(self.info, self.what, self.num_nodes),
                                   assignment=pvalue.AsSingleton(self.assignment)).with_outputs("stats", main="rows")
        )
        return {"rows": out.rows, "stats": out.stats}


# --- Split ---------------------------------------------------------------------------------------------------------
def _split_codes(columns, num_nodes: int, seed: int, train_per_class: int, val_per_class: int) -> np.ndarray:
    from pipelines.data.splits import per_class_split

    ids, labels = columns
    n = int(num_nodes)
    y = np.full(n, -1, np.int64)
    y[ids] = labels
    num_classes = int(y.max()) + 1 if (y >= 0).any() else 0
    codes = np.full(n, SPLIT_CODES["none"], np.int8)
    for name, mask in zip(SPLIT_NAMES, per_class_split(y, num_classes, train_per_class, val_per_class, seed)):
        codes[mask] = SPLIT_CODES[name]
    return codes


class Split(beam.PTransform):
    """{'labels': (partition, (ids, labels)), 'num_nodes'} -> one int8 vector [N] of split codes:
    ``train_per_class`` train and ``val_per_class`` val vertices of every class, the other labelled vertices test
    — the same seeded split as ``pipelines.data.splits.per_class_split`` (the labels are collected in one worker)."""

    def __init__(self, seed: int, train_per_class: int = 20, val_per_class: int = 30):
        super().__init__()
        self.seed, self.train, self.val = int(seed), int(train_per_class), int(val_per_class)

    def expand(self, inputs):
        return (
            inputs["labels"]
            | "Values" >> beam.Map(lambda kv: kv[1])
            | "Collect" >> beam.CombineGlobally(ConcatArrays((np.int64, np.int64)))
            | "PerClass" >> beam.Map(_split_codes, num_nodes=pvalue.AsSingleton(inputs["num_nodes"]),
                                     seed=self.seed, train_per_class=self.train, val_per_class=self.val)
        )


# --- BuildPartitions -----------------------------------------------------------------------------------------------
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


def _dedupe(chunks, owned: np.ndarray):
    """Sorted unique (dst, src) int32 entries of a partition with one self-loop per owned vertex, the degree of
    every owned vertex (self-loop included) and the number of duplicate records."""
    loops = _entry_keys(owned, owned, 0)
    keys = np.concatenate([np.asarray(c, np.uint64) for c in chunks] + [loops])
    keys.sort()
    if not keys.size:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(owned.size, np.int32), 0
    pair = keys >> _ONE
    first = np.empty(keys.size, bool)
    first[0] = True
    np.not_equal(pair[1:], pair[:-1], out=first[1:])
    forward = np.add.reduceat((keys & _ONE).astype(np.int64), np.flatnonzero(first))
    duplicates = int(np.maximum(forward - 1, 0).sum())
    del keys
    pair = pair[first]
    dst = (pair >> np.uint64(32)).astype(np.int32)
    src = (pair & _LOW32).astype(np.int32)
    deg = (np.searchsorted(dst, owned, "right") - np.searchsorted(dst, owned, "left")).astype(np.int32)
    return dst, src, deg, duplicates


def _place(chunks, owned: np.ndarray, default, dtype, width: int | None = None):
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


class _BuildPartition(beam.DoFn):
    """One partition's edge entries and vertex rows -> its vertex shard (written here), its sorted unique edge
    entries (main output) and the degrees of its vertices (tagged 'degrees')."""

    def __init__(self, root: str, feature_dim: int, tables: tuple):
        self.root, self.feature_dim, self.tables = root, feature_dim, tables

    def process(self, kv, assignment, num_nodes, split):
        p, g = kv
        n = int(num_nodes)
        owned = assignment.owned(p, n)
        chunks = list(g["edges"])
        yield from _stats("grouped:entries", sum(int(np.asarray(c).size) for c in chunks))
        dst, src, deg, duplicates = _dedupe(chunks, owned)
        yield from _stats("duplicate_edges", duplicates)
        yield from _stats("deduped:entries", dst.size)
        tables = {t: list(g[t]) for t in self.tables}
        for t, rows in tables.items():
            yield from _stats(f"grouped:{t}", sum(int(c[0].size) for c in rows))
        if int(deg.sum()) != dst.size:
            yield from _stats("assignment_errors", 1, [f"partition {p}: edge entries of vertices it does not own"])
        f = self.feature_dim
        cols = [pa.array(owned), pa.array(np.full(owned.size, p, np.int32)), pa.array(deg)]
        if f > 0:
            feats, missing, dup = _place(tables["features"], owned, 0.0, np.float32, f)
            yield from _stats("missing_features", missing.size, [f"vertex {v}" for v in missing[:SAMPLES]])
            yield from _stats("duplicate_features", dup.size, [f"vertex {v}" for v in dup[:SAMPLES]])
            cols.append(pa.FixedSizeListArray.from_arrays(pa.array(feats.reshape(-1), pa.float32()),
                                                          type=vertex_schema(f).field("features").type))
        labels = np.full(owned.size, -1, np.int32)
        if "labels" in self.tables:
            labels, missing, dup = _place(tables["labels"], owned, -1, np.int32)
            yield from _stats("missing_labels", missing.size, [f"vertex {v}" for v in missing[:SAMPLES]])
            yield from _stats("duplicate_labels", dup.size, [f"vertex {v}" for v in dup[:SAMPLES]])
            if (labels >= 0).any():
                yield pvalue.TaggedOutput("stats", Stat("max:label", int(labels.max())))
        if "splits" in self.tables:
            codes, _, dup = _place(tables["splits"], owned, SPLIT_CODES["none"], np.int8)   # no row: in no split
            yield from _stats("duplicate_splits", dup.size, [f"vertex {v}" for v in dup[:SAMPLES]])
        elif split is not None:
            codes = split[owned]
        else:
            codes = np.full(owned.size, SPLIT_CODES["none"], np.int8)
        unlabelled = (codes >= 0) & (labels < 0)
        if unlabelled.any():
            bad = owned[unlabelled]
            yield from _stats("split_unlabelled", bad.size, [f"vertex {v}" for v in bad[:SAMPLES]])
        for name in SPLIT_NAMES:
            yield from _stats(f"split_{name}", int((codes == SPLIT_CODES[name]).sum()))
        cols += [pa.array(labels), pa.array(codes.astype(np.int8))]
        table = pa.Table.from_arrays(cols, schema=vertex_schema(f))
        name = shard_name(p)
        meta = _write_table(table, os.path.join(self.root, "vertices", name))
        yield pvalue.TaggedOutput("stats", Stat("list:files", 1, {"kind": "vertices", "partition": p,
                                                                 "path": f"vertices/{name}", **meta}))
        yield pvalue.TaggedOutput("degrees", (owned, deg))
        yield p, (dst, src)


class BuildPartitions(beam.PTransform):
    """{'edges': (p, entry keys), ['features' | 'labels' | 'splits']: (p, (ids, values)), 'assignment',
    'num_nodes', ['split']} -> {'entries': (p, (dst, src)) sorted unique, self-loops included,
    'degrees': (ids, degrees), 'stats': Stat (vertex shard files included)}.

    One CoGroupByKey by partition (every partition 0..P-1 appears, empty ones included); each partition's vertex
    shard is written by the worker that holds it."""

    TABLES = ("features", "labels", "splits")

    def __init__(self, root: str, partitions: int, feature_dim: int):
        super().__init__()
        self.root, self.partitions, self.feature_dim = root, int(partitions), int(feature_dim)

    def expand(self, inputs):
        os.makedirs(os.path.join(self.root, "vertices"), exist_ok=True)
        pipeline = inputs["edges"].pipeline
        tables = tuple(t for t in self.TABLES if inputs.get(t) is not None)
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


# --- WriteEdgeShards -----------------------------------------------------------------------------------------------
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
        meta = _write_table(table, os.path.join(self.root, "edges", name))
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
    split_file: TableInfo | None = None


def build(p: beam.Pipeline, cfg: Config, root: str) -> None:
    """Add the prepare transforms to ``p``; shards and ``_stats.json`` are written under ``root``."""
    read = p | "ReadEdges" >> ReadEdges(cfg.edges)
    valid = read["chunks"] | "Validate" >> Validate(cfg.num_nodes, cfg.num_nodes_source)
    if cfg.num_nodes is not None:
        num_nodes = p | "NumNodes" >> beam.Create([cfg.num_nodes])
    else:
        num_nodes = (
            valid["max_id"]
            | "MaxId" >> beam.CombineGlobally(lambda ids: max(ids, default=-1))
            | "PlusOne" >> beam.Map(lambda m: m + 1)
        )
    parts = {"edges": valid["edges"], "num_nodes": num_nodes} | "AssignPartitions" >> AssignPartitions(
        cfg.partitioner, cfg.partitions, cfg.assignment, cfg.seed)
    assignment = parts["assignment"]
    sym = valid["edges"] | "Symmetrize" >> Symmetrize(assignment)
    entries = sym["entries"]

    stats = [read["stats"], valid["stats"], sym["stats"],
             num_nodes | "NumNodesStat" >> beam.Map(lambda n: Stat("max:num_nodes", int(n)))]
    if parts["stats"] is not None:
        stats.append(parts["stats"])
    inputs = {"edges": entries, "assignment": assignment, "num_nodes": num_nodes}
    feature_dim = 0
    if cfg.features is not None:
        feats = p | "ReadFeatures" >> ReadTable(cfg.features, "features", cfg.num_nodes, assignment)
        inputs["features"] = feats["rows"]
        stats.append(feats["stats"])
        feature_dim = cfg.features.dim
    if cfg.labels is not None:
        labels = p | "ReadLabels" >> ReadTable(cfg.labels, "labels", cfg.num_nodes, assignment)
        inputs["labels"] = labels["rows"]
        stats.append(labels["stats"])
        if cfg.split:
            inputs["split"] = {"labels": labels["rows"], "num_nodes": num_nodes} | "Split" >> Split(
                cfg.seed, cfg.train_per_class, cfg.val_per_class)
    if cfg.split_file is not None:
        splits = p | "ReadSplits" >> ReadTable(cfg.split_file, "splits", cfg.num_nodes, assignment)
        inputs["splits"] = splits["rows"]
        stats.append(splits["stats"])
    built = inputs | "BuildPartitions" >> BuildPartitions(root, cfg.partitions, feature_dim)
    stats.append(built["stats"])
    files = {"entries": built["entries"], "degrees": built["degrees"], "num_nodes": num_nodes} | \
        "WriteEdgeShards" >> WriteEdgeShards(root)
    stats.append(files)
    (
        stats
        | "AllStats" >> beam.Flatten()
        | "MergeStats" >> beam.CombineGlobally(StatsFn())
        | "WriteStats" >> beam.Map(_write_stats, root=root)
    )


# --- driver --------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(
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
    ap.add_argument("--split-file", metavar="PATH",
                    help="a given split: .npy int [N] (or Parquet 'split' column) of codes -1 none, 0 train, "
                         "1 val, 2 test")
    ap.add_argument("--train-per-class", type=int, default=20)
    ap.add_argument("--val-per-class", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="seed of the split and of METIS (default 0)")
    ap.add_argument("--out", required=True, metavar="DIR")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    ap.add_argument("--engine", choices=("direct", "flink"),
                    help="shorthand for the runner flags of pipelines.beam.runners.runner_options")
    ap.add_argument("--workers", type=int, metavar="N",
                    help="with --engine direct: N worker processes (multi-processing mode); with --engine flink: "
                         "the parallelism")
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
    if args.split and args.split_file:
        raise DataError("--split and --split-file exclude each other")
    if args.split_file and not args.labels:
        raise DataError("--split-file needs --labels")
    if args.num_nodes is not None and not 0 <= args.num_nodes <= ID_LIMIT:
        raise DataError(f"--num-nodes must lie in [0, {ID_LIMIT}]")
    if args.workers is not None and args.workers < 1:
        raise DataError(f"--workers must be >= 1, got {args.workers}")
    try:
        matched = FileSystems.match([args.edges])[0].metadata_list
    except Exception as e:  # BeamIOError for a missing non-glob path on some file systems
        raise DataError(f"--edges {args.edges!r}: {e}") from None
    if not matched:
        raise DataError(f"--edges {args.edges!r} matches no file")
    feats = inspect_features(args.features) if args.features else None
    labels = inspect_labels(args.labels) if args.labels else None
    splits = inspect_labels(args.split_file, "split", "split") if args.split_file else None
    n, source = args.num_nodes, "--num-nodes"
    for info, what in ((feats, "--features"), (labels, "--labels"), (splits, "--split-file")):
        if info is None:
            continue
        if n is None:
            n, source = info.rows, f"from the {info.rows} rows of {what} {info.path}"
        elif info.rows != n and not (what == "--split-file" and info.id_column):
            raise DataError(f"{what} {info.path} has {info.rows} rows but the graph has {n} vertices ({source})")
    if feats is not None and feats.kind == "npy" and feats.dim == 0:
        feats = None   # [N, 0]: no features
    return Config(args.edges, args.out, feats, labels, n, source, args.partitions, args.partitioner,
                  args.assignment, args.max_bad_records, args.split, args.seed, args.train_per_class,
                  args.val_per_class, splits)


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
    ("splits_vertex_out_of_range", "split rows for vertices outside the graph"),
    ("bad_splits", "invalid split codes"),
    ("duplicate_splits", "vertices with several split rows"),
    ("split_unlabelled", "vertices in a split without a label"),
    ("assignment_errors", "partition assignment problems"),
)


def check_flow(stats: dict) -> None:
    """Every element that left a stage arrived at the next one: RuntimeError if not. Counted pairs:
    routed:X / grouped:X (edge entries, feature/label/split rows into the partition groups) and
    deduped:entries / written:entries (unique entries into the edge shards)."""
    count = {k: int(v[0]) for k, v in stats.items() if k.split(":", 1)[0] in ("routed", "grouped", "deduped",
                                                                               "written")}
    pairs = [(f"routed:{x}", f"grouped:{x}") for x in ("entries", "features", "labels", "splits")]
    pairs.append(("deduped:entries", "written:entries"))
    lost = [f"{a}={count.get(a, 0)} but {b}={count.get(b, 0)}"
            for a, b in pairs if count.get(a, 0) != count.get(b, 0)]
    if lost:
        raise RuntimeError("internal error: the runner lost or duplicated elements between stages (" +
                           "; ".join(lost) + "); with the DirectRunner, --workers > 1 is known to drop elements "
                           "at scale in Beam 2.77: run with one worker or another runner")


def check_stats(stats: dict, cfg: Config) -> None:
    """Raise DataError naming every problem the pipeline found (with examples)."""
    check_flow(stats)
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


def make_manifest(stats: dict, cfg: Config, args: argparse.Namespace, pipeline_args: list[str], name: str) -> dict:
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
    if cfg.split or cfg.split_file is not None:
        split = {s: int(stats.get(f"split_{s}", (0,))[0]) for s in SPLIT_NAMES}
        if cfg.split:
            split.update(source="per-class", seed=cfg.seed, train_per_class=cfg.train_per_class,
                         val_per_class=cfg.val_per_class)
        else:
            split.update(source=cfg.split_file.path)
    partitions = []
    for e, v in zip(by_kind["edges"], by_kind["vertices"]):
        partitions.append({"partition": e["partition"], "vertices": v["path"], "edges": e["path"],
                           "num_vertices": v["rows"], "num_edges": e["rows"],
                           "vertices_sha256": v["sha256"], "edges_sha256": e["sha256"],
                           "vertices_bytes": v["bytes"], "edges_bytes": e["bytes"]})
    f = cfg.features.dim if cfg.features is not None else 0
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "num_vertices": n,
        "num_edges": edge_rows - n,            # directed, both directions, without the self-loops (= adj.nnz)
        "num_edge_rows": edge_rows,            # rows in the edge shards: num_edges + one self-loop per vertex
        "num_partitions": cfg.partitions,
        "feature_dim": f,
        "num_classes": int(max_label[0]) + 1 if max_label else 0,
        "directed": False,
        "partitioner": cfg.partitioner,
        "normalization": "gcn: edge rows hold A_hat[dst, src] = 1/sqrt(deg(src)) * 1/sqrt(deg(dst)) of "
                         "A_hat = D^-1/2 (A + I) D^-1/2; degree counts the self-loop",
        "partitions": partitions,              # num_edges of a partition = its edge-shard rows (self-loops too)
        "split": split,
        "counters": counters,
        "bad_record_samples": list(stats.get("bad_records", (0, []))[1]),
        "flags": dict(vars(args)),
        "pipeline_args": list(pipeline_args),
        "schemas": {"edges": EDGE_SCHEMA.to_string(show_schema_metadata=False),
                    "vertices": vertex_schema(f).to_string(show_schema_metadata=False)},
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return file_schemas.validate_manifest(manifest)


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


def engine_flags(engine: str | None, workers: int | None, pipeline_args: list[str]) -> list[str]:
    """--engine/--workers -> Beam flags (pipelines.beam.runners.runner_options), then the caller's Beam flags."""
    if not engine:
        if workers:
            engine = "direct"
        else:
            return list(pipeline_args)
    from pipelines.beam.runners import runner_options

    if engine == "direct":
        return runner_options("direct", pipeline_args, num_workers=workers)
    return runner_options(engine, pipeline_args, parallelism=workers)


def run(argv: list[str] | None = None) -> dict:
    """Run the prepare pipeline; returns the manifest. Raises DataError on bad input (no manifest is left)."""
    parser = build_parser()
    args, pipeline_args = parser.parse_known_args(argv)
    cfg = make_config(args)
    out = Path(args.out).absolute()
    if out.exists() and not args.overwrite and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists; pass --overwrite to replace it")
    pipeline_args = engine_flags(args.engine, args.workers, pipeline_args)
    options = pipeline_options(pipeline_args)
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
        manifest = make_manifest(stats, cfg, args, pipeline_args, out.name)
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
             manifest["num_vertices"], manifest["num_edges"], manifest["num_partitions"], c["self_loops"],
             c["duplicate_edges"])
    return manifest


def summary_line(manifest: dict) -> dict:
    return {k: manifest[k] for k in ("num_vertices", "num_edges", "feature_dim", "num_classes", "num_partitions")} | \
        {"out": str(Path(manifest["flags"]["out"]))}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pipelines.beam.runners import RunnerUnavailable

    try:
        manifest = run(argv)
    except (DataError, RunnerUnavailable) as e:   # one line, exit 2: the convention of the `dorylus` CLI
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary_line(manifest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
