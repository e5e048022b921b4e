"""Graph-change events: the Arrow schema of the event stream that drives continuous training.

Wire format
-----------
One Kafka message is one Arrow IPC *stream* holding one record batch of many events (any Arrow reader decodes
it with ``pyarrow.ipc.open_stream(value).read_all()``). The schema metadata carries
``dorylus.schema_version = "1"`` and ``dorylus.type = "graph_events"``. Columns (:data:`EVENT_SCHEMA`):

``event_id``    ``string``, not null, non-empty: assigned by the producer, unique over the stream. Consumers
                drop a second event with an id they already took (a producer retry, a replayed batch).
``event_time``  ``timestamp[ms, UTC]``, not null: when the change happened (event time, not arrival time).
``op``          ``string``, not null: one of :class:`EventOp`:
                ``add_edge`` / ``remove_edge`` (``vertex`` -- ``dst``, undirected),
                ``add_vertex`` (``vertex`` with ``features``), ``update_features`` (``vertex``, ``features``),
                ``set_label`` (``vertex``, ``label``: a class id, or -1 to unlabel; ``split``).
``vertex``      ``int64``, not null, >= 0: the vertex the event is about (an edge's first endpoint).
``dst``         ``int64``, nullable: the edge's other endpoint (edge events only).
``features``    ``list<float32>``, nullable: the vertex's feature row (add_vertex, update_features); finite.
``label``       ``int32``, nullable: the class (set_label), -1 = no label.
``split``       ``string``, nullable: ``train``, ``val``, ``test`` or ``none`` (set_label; null = ``none``).
                A vertex without a label (-1) must be in no split.

Columns that do not apply to an event's op are ignored. The optional columns (``dst``, ``features``,
``label``, ``split``) may be left out of a batch entirely (a batch of edge events needs no ``features``);
:func:`decode_events` adds them back as nulls. Any other column, a missing required column or a wrong type
is a :class:`SchemaError` of the whole message. :func:`validate_rows` checks each event on its own (op,
required fields for the op, ids, feature width, label range, split) and returns a reason per bad row, so a
consumer can dead-letter single events and keep the rest.

Dead letters (:func:`dead_letter_batch`): the rejected events with the same columns plus ``reason: string``;
``dorylus.type = "graph_events_dead_letter"``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .messages import SCHEMA_VERSION, SUPPORTED_SCHEMA_VERSIONS, SchemaError

__all__ = [
    "EVENT_SCHEMA",
    "DEAD_LETTER_SCHEMA",
    "EVENTS_TYPE",
    "DEAD_LETTER_TYPE",
    "EventOp",
    "OP_RANK",
    "SPLITS",
    "events_batch",
    "encode_events",
    "decode_events",
    "validate_rows",
    "validate_batch",
    "op_codes",
    "split_codes",
    "dead_letter_batch",
    "events_table",
]

EVENTS_TYPE = "graph_events"
DEAD_LETTER_TYPE = "graph_events_dead_letter"


class EventOp(str, Enum):
    ADD_VERTEX = "add_vertex"
    UPDATE_FEATURES = "update_features"
    ADD_EDGE = "add_edge"
    REMOVE_EDGE = "remove_edge"
    SET_LABEL = "set_label"

    def __str__(self) -> str:
        return self.value


#: the order in which events with the same event time are applied: vertices exist before their edges
OP_RANK = {EventOp.ADD_VERTEX.value: 0, EventOp.UPDATE_FEATURES.value: 1, EventOp.ADD_EDGE.value: 2,
           EventOp.REMOVE_EDGE.value: 3, EventOp.SET_LABEL.value: 4}
#: split codes: index in this tuple (``none`` = 0)
SPLITS = ("none", "train", "val", "test")
_OP_VALUES = pa.array(list(OP_RANK), pa.string())
_SPLIT_VALUES = pa.array(list(SPLITS), pa.string())

_TS = pa.timestamp("ms", tz="UTC")
_FIELDS = [
    pa.field("event_id", pa.string(), nullable=False),
    pa.field("event_time", _TS, nullable=False),
    pa.field("op", pa.string(), nullable=False),
    pa.field("vertex", pa.int64(), nullable=False),
    pa.field("dst", pa.int64()),
    pa.field("features", pa.list_(pa.float32())),
    pa.field("label", pa.int32()),
    pa.field("split", pa.string()),
]
_REQUIRED = ("event_id", "event_time", "op", "vertex")


def _metadata(kind: str) -> dict[bytes, bytes]:
    return {b"dorylus.schema_version": str(SCHEMA_VERSION).encode(), b"dorylus.type": kind.encode()}


EVENT_SCHEMA = pa.schema(_FIELDS, metadata=_metadata(EVENTS_TYPE))
DEAD_LETTER_SCHEMA = pa.schema(_FIELDS + [pa.field("reason", pa.string(), nullable=False)],
                               metadata=_metadata(DEAD_LETTER_TYPE))


# ------------------------------------------------------------------------------------------------------ building
def _column(values: Any, n: int, typ: pa.DataType, name: str) -> pa.Array:
    if values is None:
        return pa.nulls(n, typ)
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
        return arr.cast(typ) if arr.type != typ else arr
    if np.isscalar(values) or isinstance(values, str):
        values = [values] * n
    try:
        if isinstance(values, np.ndarray) and values.dtype.kind in "iuf" and typ in (pa.int64(), pa.int32()):
            return pa.array(values.astype(np.int64 if typ == pa.int64() else np.int32), type=typ)
        return pa.array(list(values) if not isinstance(values, np.ndarray) else values, type=typ)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise SchemaError(f"events column {name!r}: {e}") from None


def _features_column(features: Any, n: int) -> pa.Array:
    typ = pa.list_(pa.float32())
    if features is None:
        return pa.nulls(n, typ)
    if isinstance(features, np.ndarray) and features.ndim == 2:
        f = np.ascontiguousarray(features, dtype=np.float32)
        if f.shape[0] != n:
            raise SchemaError(f"events column 'features': {f.shape[0]} rows for {n} events")
        offsets = np.arange(0, f.size + 1, f.shape[1], dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(f.ravel()))
    rows = list(features)
    if len(rows) != n:
        raise SchemaError(f"events column 'features': {len(rows)} rows for {n} events")
    lengths = np.array([0 if r is None else len(r) for r in rows], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([np.asarray(r, np.float32).ravel() for r in rows if r is not None] or
                          [np.zeros(0, np.float32)])
    mask = pa.array(np.array([r is None for r in rows]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32()), mask=mask)


def events_batch(event_id: Sequence[str], event_time_ms: Any, op: Any, vertex: Any, dst: Any = None,
                 features: Any = None, label: Any = None, split: Any = None) -> pa.RecordBatch:
    """A batch of events with :data:`EVENT_SCHEMA`.

    ``event_time_ms``: integer milliseconds since the Unix epoch (array or scalar). ``op``/``split``: strings
    (array or scalar). ``features``: a 2-D array (every row has features) or a sequence of rows/None.
    Optional columns left as None are all-null. Only the column types are checked here; rows are checked
    by :func:`validate_rows`.
    """
    ids = _column(event_id, len(event_id), pa.string(), "event_id")
    n = len(ids)
    t = event_time_ms
    if isinstance(t, (pa.Array, pa.ChunkedArray)):
        times = _column(t, n, _TS, "event_time")
    else:
        t = np.broadcast_to(np.asarray(t, dtype=np.int64), (n,))
        times = pa.array(t, pa.int64()).cast(_TS)
    cols = [ids, times, _column(op, n, pa.string(), "op"), _column(vertex, n, pa.int64(), "vertex"),
            _column(dst, n, pa.int64(), "dst"), _features_column(features, n),
            _column(label, n, pa.int32(), "label"), _column(split, n, pa.string(), "split")]
    for f, c in zip(_FIELDS, cols):
        if len(c) != n:
            raise SchemaError(f"events column {f.name!r} has {len(c)} rows, expected {n}")
    return pa.RecordBatch.from_arrays(cols, schema=EVENT_SCHEMA)


def encode_events(batch: pa.RecordBatch | pa.Table, compression: str | None = None) -> bytes:
    """One Kafka message value: the events as one Arrow IPC stream with one record batch."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else _empty(batch.schema)
    if batch.schema.metadata is None or b"dorylus.type" not in batch.schema.metadata:
        batch = batch.replace_schema_metadata(_metadata(EVENTS_TYPE))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)


# ------------------------------------------------------------------------------------------------------ decoding
def _read(data: Any) -> pa.Table:
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = pa.py_buffer(data)
    if not isinstance(data, pa.Buffer):
        raise SchemaError(f"expected bytes (an Arrow IPC stream), got {type(data).__name__}")
    try:
        return pa.ipc.open_stream(data).read_all()
    except (pa.ArrowException, OSError) as e:
        raise SchemaError(f"not an Arrow IPC stream: {e}") from None


def decode_events(data: Any) -> pa.RecordBatch:
    """Decode and check one events message; returns a batch with exactly :data:`EVENT_SCHEMA`.

    Raises :class:`SchemaError` when the message is not an Arrow IPC stream, declares another type or an
    unsupported schema version, lacks a required column, has an unknown column, a column of the wrong type, or
    nulls in a required column.
    """
    table = _read(data)
    md = table.schema.metadata or {}
    kind = md.get(b"dorylus.type")
    if kind is not None and kind.decode(errors="replace") != EVENTS_TYPE:
        raise SchemaError(f"expected a {EVENTS_TYPE} message, got {kind.decode(errors='replace')!r}")
    sv = md.get(b"dorylus.schema_version")
    if sv is not None:
        try:
            version = int(sv)
        except ValueError:
            raise SchemaError(f"schema version {sv!r} is not an integer") from None
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise SchemaError(f"unsupported schema version {version} (supported: {sorted(SUPPORTED_SCHEMA_VERSIONS)})")
    names = table.schema.names
    unknown = [c for c in names if c not in EVENT_SCHEMA.names]
    if unknown:
        raise SchemaError(f"unknown events column(s) {unknown}")
    if len(set(names)) != len(names):
        raise SchemaError("duplicate events column names")
    n = table.num_rows
    cols = []
    for f in _FIELDS:
        if f.name not in names:
            if f.name in _REQUIRED:
                raise SchemaError(f"events column {f.name!r} is missing")
            cols.append(pa.nulls(n, f.type))
            continue
        col = table.column(f.name)
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()  # one batch a message: no copy
        if isinstance(col.type, pa.DictionaryType):
            col = col.dictionary_decode()
        if col.type != f.type:
            ok = ((f.name == "event_time" and pa.types.is_timestamp(col.type))
                  or (f.name in ("op", "split", "event_id") and pa.types.is_large_string(col.type))
                  or (f.name == "features" and (pa.types.is_list(col.type) or pa.types.is_large_list(col.type))
                      and pa.types.is_floating(col.type.value_type))
                  or (f.name in ("vertex", "dst", "label") and pa.types.is_integer(col.type)))
            if not ok:
                raise SchemaError(f"events column {f.name!r} has type {col.type}, expected {f.type}")
            if pa.types.is_timestamp(col.type) and col.type.tz is None:
                raise SchemaError("events column 'event_time' must be a UTC timestamp (timezone missing)")
            try:
                col = col.cast(f.type)
            except pa.ArrowException as e:
                raise SchemaError(f"events column {f.name!r}: cannot convert to {f.type}: {e}") from None
        if f.name in _REQUIRED and col.null_count:
            raise SchemaError(f"events column {f.name!r} has {col.null_count} null(s)")
        cols.append(col)
    return pa.RecordBatch.from_arrays(cols, schema=EVENT_SCHEMA)


def op_codes(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    """int8 per event: its op's :data:`OP_RANK` (-1 for an unknown op), without a Python loop per event."""
    return _filled(pc.index_in(batch.column("op"), value_set=_OP_VALUES), -1).astype(np.int8)


def split_codes(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    """int8 per event: the index of its split in :data:`SPLITS` (null = ``none`` = 0; -1 for an unknown one)."""
    col = batch.column("split")
    # nulls looked up as nulls (no filled copy of the strings), then told from unknown splits by validity
    codes = _filled(pc.index_in(col, value_set=_SPLIT_VALUES, skip_nulls=True), -1).astype(np.int8)
    if col.null_count:
        codes[_filled(col.is_null(), True)] = 0
    return codes


def _filled(arr, value) -> np.ndarray:
    """The array as numpy, its nulls as `value` (no fill_null pass when it has none)."""
    return np.asarray(arr if arr.null_count == 0 else pc.fill_null(arr, value))


def validate_rows(batch: pa.RecordBatch, feature_dim: int | None = None,
                  num_classes: int | None = None) -> list[str | None]:
    """A reason per event that breaks the per-op rules, None for a good one (see the module docstring).

    ``feature_dim``/``num_classes``: when given, feature rows must have that width and labels lie in
    [-1, num_classes)."""
    _, bad = validate_batch(batch, feature_dim, num_classes)
    return [bad.get(i) for i in range(batch.num_rows)]


def validate_batch(batch: pa.RecordBatch, feature_dim: int | None = None,
                   num_classes: int | None = None) -> tuple[np.ndarray, dict[int, str]]:
    """As :func:`validate_rows`, as a mask of good events and the reasons of the bad ones (position -> text).

    The checks run column-wise (Arrow compute and numpy); only the reasons of bad rows are formatted one by
    one, so a clean batch costs no Python work per event."""
    n = batch.num_rows
    reasons: dict[int, str] = {}
    ok = np.ones(n, bool)
    if n == 0:
        return ok, reasons

    def flag(mask: np.ndarray, reason) -> None:
        for i in np.flatnonzero(mask & ok):
            reasons[int(i)] = reason(i) if callable(reason) else reason
        ok[mask] = False

    def op_at(i):
        return batch.column("op")[int(i)].as_py()

    code = op_codes(batch)
    ids = batch.column("event_id")
    flag(_filled(pc.equal(pc.binary_length(ids), 0), True), "empty event_id")
    flag(code < 0, lambda i: f"unknown op {op_at(i)!r}")
    vertex = np.asarray(batch.column("vertex"))
    flag(vertex < 0, lambda i: f"negative vertex id {vertex[i]}")
    edge = (code == OP_RANK[EventOp.ADD_EDGE.value]) | (code == OP_RANK[EventOp.REMOVE_EDGE.value])
    dst_col = batch.column("dst")
    dst_null = np.asarray(dst_col.is_null())
    dst = _filled(dst_col, -1)
    flag(edge & dst_null, "edge event without dst")
    flag(edge & ~dst_null & (dst < 0), lambda i: f"negative vertex id {dst[i]}")
    flag(edge & (dst == vertex), lambda i: f"self-loop {vertex[i]}-{dst[i]} (self-loops are not stored)")
    feat = (code == OP_RANK[EventOp.ADD_VERTEX.value]) | (code == OP_RANK[EventOp.UPDATE_FEATURES.value])
    fcol = batch.column("features")
    fnull = np.asarray(fcol.is_null())
    if feat.any():
        flag(feat & fnull, lambda i: f"{op_at(i)} without features")
        lengths = _filled(pc.list_value_length(fcol), 0)
        if feature_dim is not None:
            flag(feat & ~fnull & (lengths != feature_dim),
                 lambda i: f"feature row has {lengths[i]} values, expected {feature_dim}")
        else:
            flag(feat & ~fnull & (lengths == 0), "empty feature row")
        if fcol.null_count < n:
            offsets = np.asarray(fcol.offsets)       # absolute positions into fcol.values (slices included)
            flat = np.asarray(fcol.values)
            bad = np.flatnonzero(~np.isfinite(flat))
            if bad.size:
                rows = np.searchsorted(offsets, bad, side="right") - 1
                rows = rows[(rows >= 0) & (rows < n)]
                m = np.zeros(n, bool)
                m[rows] = True
                flag(feat & ~fnull & m, "features contain NaN or inf")
    lab = code == OP_RANK[EventOp.SET_LABEL.value]
    if lab.any():
        lcol = batch.column("label")
        lnull = np.asarray(lcol.is_null())
        label = _filled(lcol, -1)
        flag(lab & lnull, "set_label without label")
        hi = num_classes if num_classes is not None else np.iinfo(np.int32).max
        flag(lab & ~lnull & ((label < -1) | (label >= hi)),
             lambda i: f"label {label[i]} out of range [-1, {num_classes})")
        split = split_codes(batch)
        flag(lab & (split < 0),
             lambda i: f"unknown split {batch.column('split')[int(i)].as_py()!r} (train, val, test, none)")
        flag(lab & (label == -1) & (split > 0), "an unlabelled vertex (label -1) cannot be in a split")
    return ok, reasons


def dead_letter_batch(batch: pa.RecordBatch, reasons: Sequence[str]) -> pa.RecordBatch:
    """The rejected events of ``batch`` (an :data:`EVENT_SCHEMA` batch) with a ``reason`` column."""
    if len(reasons) != batch.num_rows:
        raise SchemaError(f"{len(reasons)} reasons for {batch.num_rows} events")
    cols = [batch.column(f.name) for f in _FIELDS] + [pa.array(list(reasons), pa.string())]
    return pa.RecordBatch.from_arrays(cols, schema=DEAD_LETTER_SCHEMA)


def events_table(batches: Iterable[pa.RecordBatch]) -> pa.Table:
    """Concatenate event batches (an empty table with :data:`EVENT_SCHEMA` when there are none)."""
    batches = [b for b in batches]
    if not batches:
        return EVENT_SCHEMA.empty_table()
    return pa.Table.from_batches(batches, schema=EVENT_SCHEMA)
