"""ReadEdges: edge files (text or Parquet, any number, any compression Beam knows) -> chunks of int64 edges.

Text: one edge ``src dst`` per line, separated by a comma, a tab or spaces; ``#`` starts a comment; blank lines
are skipped; the first data line of a file is a header when every field starts with a letter or ``_``. A reader
parses ~16 MiB of text with Arrow's CSV parser; a block with a comment, a bad line or odd spacing is halved and
the failing lines parsed one by one, so bad records keep their file and line. Parquet: columns ``src``/``dst``
(else the first two), one record batch per chunk.
"""
from __future__ import annotations

import array
import re
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

import apache_beam as beam
from apache_beam.io import fileio

from pipelines.beam.combiners import SAMPLES, stat_outputs

PARQUET_SUFFIXES = (".parquet", ".pq")
BLOCK_BYTES = 16 << 20        # text is parsed in blocks of about this many bytes
MIN_FAST_LINES = 4096         # a failing block is halved down to this size before lines are parsed one by one
PARQUET_BATCH = 1 << 20       # rows per Parquet record batch
INT_RE = re.compile(r"[+-]?[0-9]+")
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


def is_parquet(path: str) -> bool:
    """Whether ``path`` names a Parquet file (by its suffix)."""
    return path.lower().endswith(PARQUET_SUFFIXES)


def split_fields(body: str) -> tuple[str, ...]:
    """The fields of a line without its comment: split at commas, else tabs, else runs of spaces."""
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
    if isinstance(value, str) and INT_RE.fullmatch(value):
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
        yield from stat_outputs("input_records", self.inputs)
        yield from stat_outputs("bad_records", self.bad, self.samples)
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
        yield from stat_outputs("input_records", n_lines)
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
            rec.add(line0 + i + 1, split_fields(body))
    yield from rec.emit()


def _first_data(data: bytes, line0: int) -> tuple[int, int, bool, int | None]:
    """Where the data of a file's first lines start, skipping comments, blank lines and a header:
    (byte offset, lines before it, whether a data line was seen, the header's line number or None)."""
    pos, line = 0, line0
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end + 1
        body = _line_body(data[pos:end])
        if body:
            fields = split_fields(body)
            if fields and all(_HEADER_TOKEN_RE.fullmatch(t) for t in fields):
                return end, line + 1, True, line + 1
            return pos, line, True, None
        pos, line = end, line + 1
    return pos, line, False, None


def read_text(f, path: str, block_bytes: int = BLOCK_BYTES):
    """EdgeChunk and tagged Stat outputs of a text edge file (a Beam file object: plain or decompressed)."""
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
            pos, line, seen_data, header = _first_data(data, line0)
            if header is not None:
                yield from stat_outputs("header_lines", 1, [f"{path}:{header}"])
            if data[pos:]:
                yield from _parse_block(path, data[pos:], line)
        else:
            yield from _parse_block(path, data, line0)
        line0 += n
        if not block:
            return


def _parquet_batch(path: str, batch, row: int):
    """EdgeChunk and Stat outputs of one Parquet record batch whose first row is ``row + 1``."""
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
        return
    n = len(batch)
    yield from stat_outputs("input_records", n)
    if a64.null_count or b64.null_count:
        valid = ~(a64.is_null().to_numpy(zero_copy_only=False) | b64.is_null().to_numpy(zero_copy_only=False))
        bad = np.flatnonzero(~valid)
        yield from stat_outputs("bad_records", bad.size,
                                [f"{path}:{row + i + 1}: empty field" for i in bad[:SAMPLES]])
        lines = np.flatnonzero(valid).astype(np.int64) + row + 1
        src = a64.fill_null(0).to_numpy(zero_copy_only=False)[valid]
        dst = b64.fill_null(0).to_numpy(zero_copy_only=False)[valid]
        if src.size:
            yield EdgeChunk(path, lines, src, dst)
    elif n:
        yield EdgeChunk(path, row + 1, a64.to_numpy(zero_copy_only=False), b64.to_numpy(zero_copy_only=False))


def read_parquet(f, path: str):
    """EdgeChunk and tagged Stat outputs of a Parquet edge file, one record batch at a time."""
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
        yield from _parquet_batch(path, batch, row)
        row += len(batch)


class _ReadEdgeFile(beam.DoFn):
    """ReadableFile -> EdgeChunk (+ stats: input_records, bad_records, header_lines)."""

    def process(self, readable: fileio.ReadableFile):
        path = readable.metadata.path
        with readable.open() as f:   # Beam's CompressedFile (.gz, ...) supports read(n)
            if is_parquet(path):
                yield from read_parquet(f, path)
            else:
                yield from read_text(f, path)


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
