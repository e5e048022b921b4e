"""Schemas of the files the project writes, with validate helpers.

- ``metrics.jsonl``: one JSON object per epoch (:data:`METRICS_REQUIRED`, optional :data:`METRICS_OPTIONAL`,
  any further JSON scalar fields are kept). :func:`validate_metrics_row`, :func:`read_metrics_jsonl`,
  :func:`metrics_table` (Arrow table with :data:`METRICS_SCHEMA` plus the extra columns).
- predictions / embeddings Parquet: ``vertex int64``, ``prediction int32`` and an optional
  ``embedding fixed_size_list<float32>[d]``. :func:`predictions_schema`, :func:`predictions_table`,
  :func:`validate_predictions`.
- per-partition graph shards written by the Beam prepare pipeline:
  edges ``src int64, dst int64, weight float32`` (:data:`EDGE_SHARD_SCHEMA`);
  vertices ``vertex int64, partition int32, degree int32, features fixed_size_list<float32>[F], label int32,
  split int8`` (:func:`vertex_shard_schema`; label ``-1`` = unlabelled, split codes in :data:`SPLIT_CODES`).
- the prepared-graph manifest JSON (:data:`MANIFEST_FILE`, :data:`PREPARED_FORMAT`, :data:`MANIFEST_REQUIRED`,
  :func:`validate_manifest`).

Every file schema carries ``dorylus.schema_version`` in its Arrow schema metadata; files in Parquet keep it.
The validators accept tables that come back from Parquet with ``list<float32>`` where a
``fixed_size_list`` was written by another writer, and :func:`normalize_table` turns such columns back into
``fixed_size_list`` (checking that every row has the same length).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .messages import SCHEMA_VERSION, SUPPORTED_SCHEMA_VERSIONS, SchemaError

__all__ = [
    "METRICS_REQUIRED",
    "METRICS_OPTIONAL",
    "METRICS_SCHEMA",
    "validate_metrics_row",
    "metrics_line",
    "read_metrics_jsonl",
    "metrics_table",
    "predictions_schema",
    "predictions_table",
    "validate_predictions",
    "EDGE_SHARD_SCHEMA",
    "vertex_shard_schema",
    "edge_shard_table",
    "vertex_shard_table",
    "validate_edge_shard",
    "validate_vertex_shard",
    "SPLIT_CODES",
    "SPLIT_NAMES",
    "PREPARED_FORMAT",
    "PREPARED_FORMAT_VERSION",
    "PREPARED_FORMAT_VERSIONS",
    "MANIFEST_FILE",
    "MANIFEST_REQUIRED",
    "MANIFEST_PARTITION_REQUIRED",
    "validate_manifest",
    "normalize_table",
    "file_metadata",
]

_SV = {b"dorylus.schema_version": str(SCHEMA_VERSION).encode()}


def file_metadata(kind: str, **extra: Any) -> dict[bytes, bytes]:
    """Schema metadata for a file: schema version, file kind and any extra JSON-able fields."""
    md = dict(_SV)
    md[b"dorylus.file"] = kind.encode()
    for k, v in extra.items():
        md[f"dorylus.{k}".encode()] = (v if isinstance(v, str) else json.dumps(v)).encode()
    return md


def _check_schema_version(md: Mapping[bytes, bytes] | None, what: str) -> None:
    """A file schema without metadata is accepted (foreign writers); a present but unknown version is not."""
    if not md or b"dorylus.schema_version" not in md:
        return
    raw = md[b"dorylus.schema_version"].decode(errors="replace")
    try:
        sv = int(raw)
    except ValueError:
        raise SchemaError(f"{what}: schema version {raw!r} is not an integer") from None
    if sv not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaError(f"{what}: unsupported schema version {sv}; this reader knows "
                          f"{sorted(SUPPORTED_SCHEMA_VERSIONS)}")


# ----------------------------------------------------------------------------------------------------- metrics
#: name -> (accepted Python types, may be null)
METRICS_REQUIRED: dict[str, tuple[tuple[type, ...], bool]] = {
    "epoch": ((int,), False),
    "loss": ((int, float), False),
    "train_acc": ((int, float), True),
    "val_acc": ((int, float), True),
    "test_acc": ((int, float), True),
    "epoch_s": ((int, float), False),
}
#: common optional fields and their types; other fields are allowed when they are JSON scalars
METRICS_OPTIONAL: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "time_s": (int, float),  # wall time since the start of training
    "cpu_s": (int, float),   # this process's CPU time in the epoch (on 2 cores the engine is CPU-bound)
    "lr": (int, float),
    "staleness": (int,),
    "weight_version": (int,),
    "train_loss": (int, float),
    "val_loss": (int, float),
    "test_loss": (int, float),
    "ga_s": (int, float),
    "av_s": (int, float),
    "sc_s": (int, float),
    "ae_s": (int, float),
    "wu_s": (int, float),
    "bytes_sent": (int,),
    "lambda_invocations": (int,),
    "lambda_gb_s": (int, float),
    "cost_usd": (int, float),
    "transport": (str,),
    "backend": (str,),
}
METRICS_SCHEMA = pa.schema([
    pa.field("epoch", pa.int64(), nullable=False),
    pa.field("loss", pa.float64(), nullable=False),
    pa.field("train_acc", pa.float64()),
    pa.field("val_acc", pa.float64()),
    pa.field("test_acc", pa.float64()),
    pa.field("epoch_s", pa.float64(), nullable=False),
], metadata=file_metadata("metrics"))

_ACC = ("train_acc", "val_acc", "test_acc")


def _is(v: Any, types: tuple[type, ...]) -> bool:
    if isinstance(v, bool):
        return bool in types
    return isinstance(v, types)


def _object_with(obj: Any, required: Mapping[str, Any], what: str) -> dict:
    """obj as a dict, when it is a JSON object holding every key of `required`; SchemaError otherwise."""
    if not isinstance(obj, Mapping):
        raise SchemaError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise SchemaError(f"{what} is missing {missing}")
    return dict(obj)


def validate_metrics_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Check one ``metrics.jsonl`` row; returns it as a dict. Raises :class:`SchemaError`."""
    row = _object_with(row, METRICS_REQUIRED, "metrics row")
    for k, (types, nullable) in METRICS_REQUIRED.items():
        v = row[k]
        if v is None and nullable:
            continue
        if not _is(v, types):
            raise SchemaError(f"metrics field {k!r} must be {'/'.join(t.__name__ for t in types)}"
                              f"{' or null' if nullable else ''}, got {type(v).__name__} {v!r}")
    if row["epoch"] < 0:
        raise SchemaError(f"metrics field 'epoch' must be >= 0, got {row['epoch']}")
    if not math.isfinite(row["epoch_s"]) or row["epoch_s"] < 0:
        raise SchemaError(f"metrics field 'epoch_s' must be a finite number >= 0, got {row['epoch_s']}")
    for k in _ACC:
        v = row[k]
        if v is not None and not (0.0 <= v <= 1.0):
            raise SchemaError(f"metrics field {k!r} must lie in [0, 1], got {v}")
    for k, v in row.items():
        if k in METRICS_REQUIRED:
            continue
        if not isinstance(k, str) or not k:
            raise SchemaError(f"metrics field name {k!r} is not a non-empty string")
        if k in METRICS_OPTIONAL:
            if v is not None and not _is(v, METRICS_OPTIONAL[k]):
                raise SchemaError(f"metrics field {k!r} must be "
                                  f"{'/'.join(t.__name__ for t in METRICS_OPTIONAL[k])}, got {type(v).__name__}")
        elif v is not None and not isinstance(v, (bool, int, float, str)):
            raise SchemaError(f"metrics field {k!r} must be a JSON scalar, got {type(v).__name__}")
    return row


def metrics_line(row: Mapping[str, Any]) -> str:
    """One validated ``metrics.jsonl`` line (with the trailing newline). NaN loss is written as NaN."""
    return json.dumps(validate_metrics_row(row), separators=(",", ":")) + "\n"


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a ``metrics.jsonl`` file (blank lines are skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise SchemaError(f"{path}:{lineno}: not JSON: {e}") from None
            try:
                rows.append(validate_metrics_row(obj))
            except SchemaError as e:
                raise SchemaError(f"{path}:{lineno}: {e}") from None
    return rows


def metrics_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Validated rows as an Arrow table: :data:`METRICS_SCHEMA` columns first, then the extras (inferred)."""
    rows = [validate_metrics_row(r) for r in rows]
    cols = {f.name: pa.array([r[f.name] for r in rows], f.type) for f in METRICS_SCHEMA}
    extras: list[str] = []
    for r in rows:
        extras += [k for k in r if k not in cols and k not in extras]
    fields = list(METRICS_SCHEMA)
    arrays = list(cols.values())
    for k in extras:
        a = pa.array([r.get(k) for r in rows])
        fields.append(pa.field(k, a.type))
        arrays.append(a)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=METRICS_SCHEMA.metadata))


# --------------------------------------------------------------------------------------- predictions / embeddings
def _fsl(width: int) -> pa.DataType:
    if not isinstance(width, (int, np.integer)) or width <= 0:
        raise SchemaError(f"embedding/feature width must be a positive integer, got {width!r}")
    return pa.list_(pa.field("item", pa.float32(), nullable=False), int(width))


def predictions_schema(embedding_dim: int | None = None) -> pa.Schema:
    """``vertex int64``, ``prediction int32`` (+ ``embedding fixed_size_list<float32>[embedding_dim]``)."""
    fields = [pa.field("vertex", pa.int64(), nullable=False), pa.field("prediction", pa.int32(), nullable=False)]
    if embedding_dim is not None:
        fields.append(pa.field("embedding", _fsl(embedding_dim), nullable=False))
    return pa.schema(fields, metadata=file_metadata("predictions"))


def _fsl_array(name: str, x: Any, n: int) -> pa.Array:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] != n:
        raise SchemaError(f"{name} must have shape ({n}, d), got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise SchemaError(f"{name} must be float32, got dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), pa.float32()), type=_fsl(int(x.shape[1])))


def _int_array(name: str, x: Any, dtype: Any, n: int | None = None) -> pa.Array:
    x = np.asarray(x)
    if x.ndim != 1 or (n is not None and x.shape[0] != n):
        raise SchemaError(f"{name} must be a 1-D array{'' if n is None else f' of length {n}'}, got {x.shape}")
    if not (np.issubdtype(x.dtype, np.integer) or x.size == 0):
        raise SchemaError(f"{name} must be integers, got dtype {x.dtype}")
    info = np.iinfo(dtype)
    if x.size and (x.min() < info.min or x.max() > info.max):
        raise SchemaError(f"{name} values do not fit {np.dtype(dtype).name}")
    return pa.array(x.astype(dtype, copy=False))


def predictions_table(vertex: Any, prediction: Any, embedding: Any | None = None) -> pa.Table:
    """Build a validated predictions/embeddings table (write it with ``pyarrow.parquet.write_table``)."""
    v = _int_array("vertex", vertex, np.int64)
    n = len(v)
    arrays = [v, _int_array("prediction", prediction, np.int32, n)]
    dim = None
    if embedding is not None:
        e = _fsl_array("embedding", embedding, n)
        dim = e.type.list_size
        arrays.append(e)
    return pa.Table.from_arrays(arrays, schema=predictions_schema(dim))


def normalize_table(table: pa.Table, fixed_width_columns: Iterable[str]) -> pa.Table:
    """Turn ``list<float32>`` columns (e.g. from another Parquet writer) into ``fixed_size_list<float32>``."""
    for name in fixed_width_columns:
        i = table.schema.get_field_index(name)
        if i < 0 or not pa.types.is_list(table.schema.field(i).type) and not pa.types.is_large_list(
                table.schema.field(i).type):
            continue
        col = table.column(i).combine_chunks()
        lengths = col.value_lengths().to_numpy(zero_copy_only=False)
        if col.null_count:
            raise SchemaError(f"column {name!r} has {col.null_count} nulls")
        if len(lengths) and (lengths != lengths[0]).any():
            raise SchemaError(f"column {name!r} has rows of different lengths ({lengths.min()}..{lengths.max()})")
        width = int(lengths[0]) if len(lengths) else 1
        values = col.flatten().cast(pa.float32())
        fsl = pa.FixedSizeListArray.from_arrays(values, type=_fsl(width))
        table = table.set_column(i, pa.field(name, _fsl(width), nullable=False), fsl)
    return table


def _validate_columns(table: pa.Table | pa.RecordBatch, what: str,
                      want: list[tuple[str, Any, bool]]) -> None:
    """``want``: (name, type or "fsl", required)."""
    schema = table.schema
    _check_schema_version(schema.metadata, what)
    for name, typ, required in want:
        i = schema.get_field_index(name)
        if i < 0:
            if required:
                raise SchemaError(f"{what} is missing column {name!r}")
            continue
        got = schema.field(i).type
        if typ == "fsl":
            if not (pa.types.is_fixed_size_list(got) and pa.types.is_float32(got.value_type)):
                raise SchemaError(f"{what} column {name!r} has type {got}, expected fixed_size_list<float32>")
        elif not got.equals(typ):
            raise SchemaError(f"{what} column {name!r} has type {got}, expected {typ}")
        col = table.column(i)
        if col.null_count:
            raise SchemaError(f"{what} column {name!r} has {col.null_count} nulls")
    names = [w[0] for w in want]
    extra = [n for n in schema.names if n not in names]
    if extra:
        raise SchemaError(f"{what} has unexpected columns {extra}")


def validate_predictions(table: pa.Table, embedding_dim: int | None = None) -> pa.Table:
    """Check a predictions/embeddings table; ``embedding_dim`` (if given) must match the embedding width."""
    _validate_columns(table, "predictions", [("vertex", pa.int64(), True), ("prediction", pa.int32(), True),
                                             ("embedding", "fsl", embedding_dim is not None)])
    if embedding_dim is not None:
        width = table.schema.field("embedding").type.list_size
        if width != embedding_dim:
            raise SchemaError(f"predictions: embedding width is {width}, expected {embedding_dim}")
    return table


# ------------------------------------------------------------------------------------------------- graph shards
#: split codes of the vertex shard's ``split`` column
SPLIT_CODES = {"none": -1, "train": 0, "val": 1, "test": 2}
#: the named splits, in the order of their codes (train, val, test masks)
SPLIT_NAMES = ("train", "val", "test")

EDGE_SHARD_SCHEMA = pa.schema([
    pa.field("src", pa.int64(), nullable=False),
    pa.field("dst", pa.int64(), nullable=False),
    pa.field("weight", pa.float32(), nullable=False),
], metadata=file_metadata("edge_shard"))


def vertex_shard_schema(feature_dim: int) -> pa.Schema:
    return pa.schema([
        pa.field("vertex", pa.int64(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("degree", pa.int32(), nullable=False),
        pa.field("features", _fsl(feature_dim), nullable=False),
        pa.field("label", pa.int32(), nullable=False),
        pa.field("split", pa.int8(), nullable=False),
    ], metadata=file_metadata("vertex_shard"))


def edge_shard_table(src: Any, dst: Any, weight: Any | None = None) -> pa.Table:
    s = _int_array("src", src, np.int64)
    d = _int_array("dst", dst, np.int64, len(s))
    if weight is None:
        w = pa.array(np.ones(len(s), np.float32))
    else:
        wa = np.asarray(weight)
        if wa.shape != (len(s),) or not (np.issubdtype(wa.dtype, np.number) or wa.size == 0):
            raise SchemaError(f"weight must be {len(s)} numbers, got shape {wa.shape} dtype {wa.dtype}")
        w = pa.array(wa.astype(np.float32, copy=False))
    return pa.Table.from_arrays([s, d, w], schema=EDGE_SHARD_SCHEMA)


def vertex_shard_table(vertex: Any, partition: Any, degree: Any, features: Any, label: Any,
                       split: Any) -> pa.Table:
    v = _int_array("vertex", vertex, np.int64)
    n = len(v)
    p = np.asarray(partition)
    p = np.full(n, int(p)) if p.ndim == 0 else p
    f = _fsl_array("features", features, n)
    t = pa.Table.from_arrays([v, _int_array("partition", p, np.int32, n), _int_array("degree", degree, np.int32, n),
                              f, _int_array("label", label, np.int32, n), _int_array("split", split, np.int8, n)],
                             schema=vertex_shard_schema(f.type.list_size))
    return validate_vertex_shard(t)


def validate_edge_shard(table: pa.Table) -> pa.Table:
    _validate_columns(table, "edge shard", [("src", pa.int64(), True), ("dst", pa.int64(), True),
                                            ("weight", pa.float32(), True)])
    for name in ("src", "dst"):
        col = table.column(name)
        if len(col) and pc.min(col).as_py() < 0:
            raise SchemaError(f"edge shard column {name!r} has negative vertex ids")
    return table


def validate_vertex_shard(table: pa.Table, feature_dim: int | None = None) -> pa.Table:
    _validate_columns(table, "vertex shard", [
        ("vertex", pa.int64(), True), ("partition", pa.int32(), True), ("degree", pa.int32(), True),
        ("features", "fsl", True), ("label", pa.int32(), True), ("split", pa.int8(), True)])
    width = table.schema.field("features").type.list_size
    if feature_dim is not None and width != feature_dim:
        raise SchemaError(f"vertex shard: feature width is {width}, expected {feature_dim}")
    if len(table):
        checks = [("vertex", 0, None), ("partition", 0, None), ("degree", 0, None), ("label", -1, None),
                  ("split", min(SPLIT_CODES.values()), max(SPLIT_CODES.values()))]
        for name, lo, hi in checks:
            mm = pc.min_max(table.column(name)).as_py()
            if mm["min"] < lo or (hi is not None and mm["max"] > hi):
                raise SchemaError(f"vertex shard column {name!r} has values in [{mm['min']}, {mm['max']}], "
                                  f"allowed [{lo}, {'inf' if hi is None else hi}]")
    return table


# ----------------------------------------------------------------------------------------------------- manifest
#: ``format`` of a prepared graph's manifest, the version the prepare pipeline writes and the versions readers know
PREPARED_FORMAT = "dorylus-prepared"
PREPARED_FORMAT_VERSION = 2
PREPARED_FORMAT_VERSIONS = (2,)
#: the manifest's file name in a prepared directory (written last: a directory with one is complete)
MANIFEST_FILE = "manifest.json"
#: required keys of a prepared graph's ``manifest.json`` and their JSON types
MANIFEST_REQUIRED: dict[str, tuple[type, ...]] = {
    "schema_version": (int,),
    "name": (str,),
    "num_vertices": (int,),
    "num_edges": (int,),
    "num_partitions": (int,),
    "feature_dim": (int,),
    "num_classes": (int,),
    "partitions": (list,),
}
#: required keys of every entry of ``partitions`` (paths are relative to the manifest's directory)
MANIFEST_PARTITION_REQUIRED: dict[str, tuple[type, ...]] = {
    "partition": (int,),
    "vertices": (str,),
    "edges": (str,),
    "num_vertices": (int,),
    "num_edges": (int,),
}


def validate_manifest(obj: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """Check a manifest (a dict, or the path of a JSON file). Optional keys (``directed``, ``normalization``,
    ``source``, ``created_at``, ``partitioner``, ...) are kept as they are."""
    if isinstance(obj, (str, Path)):
        try:
            obj = json.loads(Path(obj).read_text(encoding="utf-8"))
        except ValueError as e:
            raise SchemaError(f"manifest {obj}: not JSON: {e}") from None
    m = _object_with(obj, MANIFEST_REQUIRED, "manifest")
    for k, types in MANIFEST_REQUIRED.items():
        if not _is(m[k], types):
            raise SchemaError(f"manifest key {k!r} must be {types[0].__name__}, got {type(m[k]).__name__}")
    if m["schema_version"] not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaError(f"manifest: unsupported schema version {m['schema_version']}; this reader knows "
                          f"{sorted(SUPPORTED_SCHEMA_VERSIONS)}")
    for k in ("num_vertices", "num_edges", "feature_dim", "num_classes"):
        if m[k] < 0:
            raise SchemaError(f"manifest key {k!r} must be >= 0, got {m[k]}")
    if m["num_partitions"] < 1:
        raise SchemaError(f"manifest key 'num_partitions' must be >= 1, got {m['num_partitions']}")
    parts = m["partitions"]
    if len(parts) != m["num_partitions"]:
        raise SchemaError(f"manifest lists {len(parts)} partitions but num_partitions is {m['num_partitions']}")
    seen = set()
    for j, p in enumerate(parts):
        if not isinstance(p, Mapping):
            raise SchemaError(f"manifest partitions[{j}] must be an object, got {type(p).__name__}")
        miss = [k for k in MANIFEST_PARTITION_REQUIRED if k not in p]
        if miss:
            raise SchemaError(f"manifest partitions[{j}] is missing {miss}")
        for k, types in MANIFEST_PARTITION_REQUIRED.items():
            if not _is(p[k], types):
                raise SchemaError(f"manifest partitions[{j}].{k} must be {types[0].__name__}, "
                                  f"got {type(p[k]).__name__}")
        if not 0 <= p["partition"] < m["num_partitions"] or p["partition"] in seen:
            raise SchemaError(f"manifest partitions[{j}].partition = {p['partition']} is out of range or repeated")
        seen.add(p["partition"])
    if sum(p["num_vertices"] for p in parts) != m["num_vertices"]:
        raise SchemaError(f"manifest: partition vertex counts sum to {sum(p['num_vertices'] for p in parts)}, "
                          f"num_vertices is {m['num_vertices']}")
    return m
