"""ReadTable: feature, label and split files (.npy or Parquet) -> rows routed to the partition of their vertex.

:func:`inspect_features` and :func:`inspect_labels` read only headers and metadata, before the pipeline runs (the
driver's cheap checks and the vertex count); :class:`ReadTable` reads the rows in chunks (.npy: ~16 MiB; Parquet:
one row group), checks them (ids in range, NaN/inf, widths, label and split codes) and routes them.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import apache_beam as beam
from apache_beam import pvalue

from pipelines.beam.combiners import SAMPLES, stat_outputs
from pipelines.beam.prepare.partition import by_partition
from pipelines.beam.prepare.read_edges import is_parquet
from pipelines.beam.prepare.spill import spill
from pipelines.data.graph import DataError
from schemas.files import SPLIT_CODES

ID_COLUMNS = ("vertex", "node", "node_id", "id")
TABLE_CHUNK_BYTES = 16 << 20  # feature/label .npy files are read in chunks of about this many bytes
TABLES = ("features", "labels", "splits")


class TableInfo(NamedTuple):
    """What the driver learns about a feature/label file before the pipeline runs (cheap: headers, metadata)."""

    path: str
    kind: str                 # "npy" | "parquet"
    rows: int
    dim: int                  # features: F; labels: 0
    id_column: str | None     # Parquet: the vertex-id column
    value_columns: tuple      # Parquet: the list column, or the wide feature columns, or the label column
    row_groups: tuple = ()    # Parquet: (index, first row) of each row group


def _check_file(path: str, what: str) -> bool:
    """Whether ``path`` is a .npy file (else Parquet); DataError when it is missing or of another kind."""
    if not os.path.isfile(path):
        raise DataError(f"{what} file {path} does not exist")
    if not path.endswith(".npy") and not is_parquet(path):
        raise DataError(f"{path}: {what} files must be .npy or .parquet")
    return path.endswith(".npy")


def _npy_info(path: str, shape_want: str, ndim: int, kinds: str, dtype_want: str) -> TableInfo:
    """A .npy file's TableInfo from its header; DataError unless it has ``ndim`` dims and a dtype kind in
    ``kinds``."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)  # reads the header only
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a readable .npy file ({e})") from None
    if len(arr.shape) != ndim:
        raise DataError(f"{path}: {shape_want}, got shape {arr.shape}")
    if arr.dtype.kind not in kinds:
        raise DataError(f"{path}: {dtype_want}, got dtype {arr.dtype}")
    return TableInfo(path, "npy", int(arr.shape[0]), int(arr.shape[1]) if ndim == 2 else 0, None, ())


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
    """Features: .npy numeric [N, F], or Parquet with an optional id column and one list column (``features``
    preferred) or, failing that, every other numeric column as one feature."""
    if _check_file(path, "feature"):
        return _npy_info(path, "features must be a 2-D array [nodes, features]", 2, "iuf",
                         "features must be numeric")
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
    if _check_file(path, what):
        return _npy_info(path, f"{what}s must be a 1-D array [nodes]", 1, "iu", f"{what}s must be integers")
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


def _read_chunk(info: TableInfo, what: str, chunk):
    """(ids, first row, values, None or (bad-row mask, {row: message})) of one chunk of a table file."""
    if info.kind == "npy":
        start, stop = chunk
        arr = np.asarray(np.load(info.path, mmap_mode="r", allow_pickle=False)[start:stop])
        return np.arange(start, stop, dtype=np.int64), start, arr, None
    index, first = chunk
    table = pq.ParquetFile(info.path).read_row_group(index)
    k = table.num_rows
    ids = (table.column(info.id_column).to_numpy(zero_copy_only=False).astype(np.int64) if info.id_column
           else np.arange(first, first + k, dtype=np.int64))
    if what != "features":
        col = table.column(info.value_columns[0])
        return ids, first, col.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64), None
    if len(info.value_columns) == 1 and _is_list_type(table.schema.field(info.value_columns[0]).type):
        return (ids, first, *_list_features(table.column(info.value_columns[0]).combine_chunks(), k, info.dim))
    cols = [table.column(c) for c in info.value_columns]
    nulls = np.zeros(k, bool)
    for c in cols:
        if c.null_count:
            nulls |= c.is_null().to_numpy(zero_copy_only=False)
    mat = np.column_stack([c.fill_null(0).to_numpy(zero_copy_only=False) for c in cols]).astype(np.float64)
    return ids, first, mat, (nulls, {i: "null features" for i in np.flatnonzero(nulls)[:SAMPLES]})


def _list_features(col, k: int, dim: int):
    """float64 [k, dim] of a list column, and its rows that are null or of another width (mask, messages)."""
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
    return mat, (~good, msgs)


def _drop(name: str, keep: np.ndarray, bad: np.ndarray, message):
    """Stat outputs ``name`` for the kept rows that are ``bad`` (``message(row)`` for each sample); those rows
    are cleared from ``keep`` in place."""
    bad = keep & bad
    if bad.any():
        idx = np.flatnonzero(bad)
        yield from stat_outputs(name, idx.size, [message(i) for i in idx[:SAMPLES]])
        keep &= ~bad


class _ReadRows(beam.DoFn):
    """A chunk of a feature/label/split file -> (partition, (vertex ids, values)) (+ stats), vectorized.
    values: float32 [k, F] (features) or int64 [k] (labels, split codes)."""

    def __init__(self, info: TableInfo, what: str, num_nodes: int, spill_root: str | None = None):
        self.info, self.what, self.num_nodes, self.spill_root = info, what, num_nodes, spill_root

    def process(self, chunk, assignment):
        ids, first, values, shape_problems = _read_chunk(self.info, self.what, chunk)
        what, n, path = self.what, self.num_nodes, self.info.path

        def where(i):
            return f"{path}: row {first + int(i)}"

        keep = (ids >= 0) & (ids < n)
        if not keep.all():
            bad = np.flatnonzero(~keep)
            yield from stat_outputs(f"{what}_vertex_out_of_range", bad.size,
                                    [f"{where(i)}: vertex {ids[i]} out of range [0, {n})" for i in bad[:SAMPLES]])
        if what == "labels":
            yield from _drop("bad_labels", keep, values < -1, lambda i: f"{where(i)}: label {values[i]} < -1")
        elif what == "splits":
            yield from _drop("bad_splits", keep, (values < -1) | (values > max(SPLIT_CODES.values())),
                             lambda i: f"{where(i)}: split code {values[i]} not in -1..2")
        else:
            if shape_problems is not None:
                mask, msgs = shape_problems
                yield from _drop("bad_feature_rows", keep, mask,
                                 lambda i: f"{where(i)}: {msgs.get(int(i), 'bad row')}")
            values = np.asarray(values, np.float64) if values.dtype != np.float64 else values
            finite = np.isfinite(values).all(axis=1) if values.size else np.ones(len(values), bool)
            yield from _drop("nan_features", keep, ~finite, lambda i: (
                f"{where(i)} (vertex {ids[i]}): {'NaN' if np.isnan(values[i]).any() else 'inf'}"))
            values = values.astype(np.float32)
        if not keep.all():
            ids, values = ids[keep], values[keep]
        yield from stat_outputs(f"routed:{what}", ids.size)
        for p, rows in by_partition(assignment.of(ids), assignment.parts, ids, values):
            yield p, rows if self.spill_root is None else (spill(self.spill_root, what, p, *rows), rows[0].size)


class ReadTable(beam.PTransform):
    """PBegin -> {'rows': (partition, (ids, values)), 'stats'} from a file described by :class:`TableInfo`;
    rows are routed to the partition that owns their vertex (``assignment``: a singleton PCollection). With
    ``spill_root`` each chunk's rows of a partition are spilled there and the element is (partition, (spill
    path, rows)) (:mod:`pipelines.beam.prepare.spill`: for the features, the bulk of the vertex data)."""

    def __init__(self, info: TableInfo, what: str, num_nodes: int, assignment, spill_root: str | None = None):
        super().__init__()
        assert what in TABLES
        self.info, self.what, self.num_nodes, self.assignment = info, what, num_nodes, assignment
        self.spill_root = spill_root

    def expand(self, pbegin):
        out = (
            pbegin
            | "Impulse" >> beam.Impulse()
            | "Plan" >> beam.FlatMap(_plan_chunks, info=self.info)
            | "Spread" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(_ReadRows(self.info, self.what, self.num_nodes, self.spill_root),
                                   assignment=pvalue.AsSingleton(self.assignment)).with_outputs("stats", main="rows")
        )
        return {"rows": out.rows, "stats": out.stats}
