"""Arrow schemas of the messages between graph servers, tensor workers and the parameter server.

Wire format
-----------
One message is one Arrow IPC *stream* (``pa.ipc.new_stream``) holding exactly one record batch. Any Arrow
reader decodes it with ``pyarrow.ipc.open_stream(value).read_all()``; nothing but standard Arrow types and
schema metadata is used, so a Kafka consumer that knows nothing of this project can read every topic.

Message types (schema metadata ``dorylus.type``) and their columns:

``vertex_block``  ``vertex: int64`` + one column per named tensor, ``fixed_size_list<float32>[d]``;
                  a tensor of shape ``(n, *row_shape)`` is stored row-major with ``d = prod(row_shape)``
                  and the field metadata ``dorylus.row_shape`` (JSON list) when it is not ``[d]``.
                  Carries H, AH, Z, gradients of rows ... (``h``, ``ah``, ``grad`` ...).
``edge_block``    ``src: int64``, ``dst: int64`` + per-edge tensors as above (e.g. GAT attention logits per head).
``gradients``     one row per parameter: ``name: string``, ``shape: list<int64>``, ``data: list<float32>``
                  (row-major, ``len(data) == prod(shape)``); the weight version is the routing ``version``.
``weights``       a weight version: the same columns as ``gradients``.
``watermark``     one row per mark: ``producer: string``, ``partition: int32``, ``epoch: int64``,
                  ``stage: int32``, ``channel: string`` (version 1: ``layer`` for ``stage``).
``control``       one row: ``command: string``, ``args: string`` (a JSON object).
``tensor_batch``  named tensors of any shape and numeric/bool dtype (a tensor task's inputs or results, e.g.
                  features, CSR block arrays, labels and masks together): exactly one row, one column per
                  tensor of type ``large_list<T>`` holding the row-major values (``T`` the tensor's Arrow type:
                  float16/32/64, int8..64, uint8..64, bool) and the field metadata ``dorylus.shape`` (JSON list;
                  ``[]`` for a scalar). Decoded arrays keep their dtype (zero-copy except bool). An empty
                  batch (no tensor) has no columns and no rows.

Routing fields live in the schema metadata (all values are UTF-8 strings):

``dorylus.schema_version`` (``"2"``), ``dorylus.type``, ``dorylus.run_id``, ``dorylus.kind`` (task kind, a
`schemas.tasks.TaskKind` word), ``dorylus.epoch``, ``dorylus.stage`` (the index in the model's stage list),
``dorylus.interval``, ``dorylus.partition``, ``dorylus.version``
(decimal integers, ``-1`` where a field does not apply) and ``dorylus.meta`` (a JSON object). Version 1
messages (``dorylus.schema_version`` ``"1"``) named the stage index ``dorylus.layer`` (and the watermark column
``layer``); they decode to the same objects.

Why metadata and not columns: a message is one record batch for one (task, epoch, stage, interval), so the
routing fields are constants of the message, not of its rows. As columns they would be repeated on every row
and every reader would have to check that they are constant. In the metadata they are stated once, and they
are in the stream's first (schema) message: a router can read them with :func:`peek_header` without touching
the tensor data. The price is that concatenating messages into one table drops the per-message routing, which
is why the files in :mod:`schemas.files` carry such fields as columns instead.

Decoded arrays are zero-copy, read-only views into the message buffer wherever Arrow allows (always for
uncompressed messages; with compression, views into the decompressed Arrow buffers). Copy before writing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np
import pyarrow as pa

from .tasks import TaskKind

__all__ = [
    "SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "MESSAGE_SCHEMA_VERSION",
    "SUPPORTED_MESSAGE_SCHEMA_VERSIONS",
    "WireMessage",
    "ROUTING_FIELDS",
    "COMPRESSIONS",
    "SchemaError",
    "MessageType",
    "TaskKind",
    "Header",
    "Envelope",
    "Watermark",
    "Control",
    "vertex_block",
    "edge_block",
    "gradients",
    "weights",
    "tensor_batch",
    "TENSOR_BATCH_DTYPES",
    "encode",
    "encode_buffer",
    "decode",
    "decode_message",
    "decode_watermarks",
    "decode_control",
    "peek_header",
    "arrow_schema",
    "to_record_batch",
    "WATERMARK_SCHEMA",
    "CONTROL_SCHEMA",
    "PARAMS_SCHEMA",
]

#: version of the files (`schemas.files`) and event streams (`schemas.events`)
SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
#: version of the messages: 2 names the stage index ``stage`` (version 1 called it ``layer``; still decoded)
MESSAGE_SCHEMA_VERSION = 2
SUPPORTED_MESSAGE_SCHEMA_VERSIONS = frozenset({1, 2})

K_SCHEMA_VERSION = "dorylus.schema_version"
K_TYPE = "dorylus.type"
K_META = "dorylus.meta"
K_ROW_SHAPE = "dorylus.row_shape"
K_SHAPE = "dorylus.shape"
ROUTING_FIELDS = ("run_id", "kind", "epoch", "stage", "interval", "partition", "version")
_INT_ROUTING = ("epoch", "stage", "interval", "partition", "version")
_V1_NAMES = {"stage": "layer"}  # version-1 names of the fields version 2 renamed (metadata keys and columns)

#: accepted values of ``compression``; ``lz4`` is the LZ4 frame format of the Arrow IPC spec
COMPRESSIONS = (None, "lz4", "zstd")

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*$")


class SchemaError(ValueError):
    """A message or file does not match its schema; the message names the problem."""


class MessageType(str, Enum):
    VERTEX_BLOCK = "vertex_block"
    EDGE_BLOCK = "edge_block"
    GRADIENTS = "gradients"
    WEIGHTS = "weights"
    WATERMARK = "watermark"
    CONTROL = "control"
    TENSOR_BATCH = "tensor_batch"

    def __str__(self) -> str:  # "vertex_block", not "MessageType.VERTEX_BLOCK"
        return self.value


_ID_COLUMNS = {
    MessageType.VERTEX_BLOCK: ("vertex",),
    MessageType.EDGE_BLOCK: ("src", "dst"),
}

PARAMS_SCHEMA = pa.schema([
    pa.field("name", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.field("item", pa.int64(), nullable=False)), nullable=False),
    pa.field("data", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=False),
])
WATERMARK_SCHEMA = pa.schema([
    pa.field("producer", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("epoch", pa.int64(), nullable=False),
    pa.field("stage", pa.int32(), nullable=False),
    pa.field("channel", pa.string(), nullable=False),
])
_WATERMARK_SCHEMA_V1 = pa.schema([pa.field(_V1_NAMES.get(f.name, f.name), f.type, nullable=False)
                                  for f in WATERMARK_SCHEMA])
CONTROL_SCHEMA = pa.schema([
    pa.field("command", pa.string(), nullable=False),
    pa.field("args", pa.string(), nullable=False),
])
_FIXED_SCHEMAS = {
    MessageType.GRADIENTS: PARAMS_SCHEMA,
    MessageType.WEIGHTS: PARAMS_SCHEMA,
    MessageType.WATERMARK: WATERMARK_SCHEMA,
    MessageType.CONTROL: CONTROL_SCHEMA,
}


# ------------------------------------------------------------------------------------------------ message objects
@dataclasses.dataclass(frozen=True)
class Header:
    """The routing fields of a message, readable without decoding its data (see :func:`peek_header`)."""

    type: MessageType
    kind: str
    run_id: str
    epoch: int
    stage: int
    interval: int
    partition: int
    version: int
    meta: Mapping[str, Any]
    schema_version: int = MESSAGE_SCHEMA_VERSION


@dataclasses.dataclass(frozen=True, eq=False)
class Envelope:
    """One data message: a vertex block, an edge block, gradients or a weight version.

    ``tensors`` maps names to float32 arrays: ``(n, *row_shape)`` for vertex blocks (``n == len(vertex)``)
    and edge blocks (``n == len(src)``), any shape for gradients and weights. ``vertex`` (vertex blocks),
    ``src`` and ``dst`` (edge blocks) are int64 id arrays. ``version`` is the weight version the data was
    computed with (weight stashing); ``-1`` where none applies. ``meta`` is any JSON object.
    """

    kind: str
    run_id: str
    epoch: int
    stage: int
    interval: int
    partition: int
    version: int
    tensors: Mapping[str, np.ndarray]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    type: MessageType = MessageType.VERTEX_BLOCK
    vertex: np.ndarray | None = None
    src: np.ndarray | None = None
    dst: np.ndarray | None = None

    @property
    def header(self) -> Header:
        return Header(MessageType(self.type), self.kind, self.run_id, self.epoch, self.stage, self.interval,
                      self.partition, self.version, dict(self.meta))

    @property
    def num_rows(self) -> int:
        """Vertices of a vertex block, edges of an edge block, parameters of gradients/weights."""
        t = MessageType(self.type)
        if t is MessageType.VERTEX_BLOCK:
            return 0 if self.vertex is None else int(len(self.vertex))
        if t is MessageType.EDGE_BLOCK:
            return 0 if self.src is None else int(len(self.src))
        return len(self.tensors)

    def replace(self, **changes) -> "Envelope":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Watermark:
    """Producer ``producer`` has completed (epoch, stage) for ``partition`` on ``channel``."""

    run_id: str
    producer: str
    partition: int
    epoch: int
    stage: int
    channel: str


@dataclasses.dataclass(frozen=True)
class Control:
    """A control command (start, stop, checkpoint, ...) with JSON arguments."""

    run_id: str
    command: str
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)


#: anything `encode` writes
WireMessage = Union[Envelope, Watermark, Sequence[Watermark], Control]


def vertex_block(kind: str, run_id: str, epoch: int, stage: int, interval: int, partition: int,
                 vertex: np.ndarray, tensors: Mapping[str, np.ndarray], version: int = -1,
                 meta: Mapping[str, Any] | None = None) -> Envelope:
    """An :class:`Envelope` for rows of vertices (``tensors[name].shape[0] == len(vertex)``)."""
    return Envelope(kind, run_id, epoch, stage, interval, partition, version, dict(tensors), dict(meta or {}),
                    MessageType.VERTEX_BLOCK, vertex=vertex)


def edge_block(kind: str, run_id: str, epoch: int, stage: int, interval: int, partition: int,
               src: np.ndarray, dst: np.ndarray, tensors: Mapping[str, np.ndarray] | None = None,
               version: int = -1, meta: Mapping[str, Any] | None = None) -> Envelope:
    """An :class:`Envelope` for per-edge values (``tensors[name].shape[0] == len(src) == len(dst)``)."""
    return Envelope(kind, run_id, epoch, stage, interval, partition, version, dict(tensors or {}),
                    dict(meta or {}), MessageType.EDGE_BLOCK, src=src, dst=dst)


def gradients(run_id: str, epoch: int, version: int, grads: Mapping[str, np.ndarray], *,
              kind: str = TaskKind.AV_BWD.value, stage: int = -1, interval: int = -1, partition: int = -1,
              meta: Mapping[str, Any] | None = None) -> Envelope:
    """Parameter gradients computed with weight ``version`` (for the WU task)."""
    return Envelope(kind, run_id, epoch, stage, interval, partition, version, dict(grads), dict(meta or {}),
                    MessageType.GRADIENTS)


def weights(run_id: str, version: int, params: Mapping[str, np.ndarray], *, epoch: int = -1,
            kind: str = TaskKind.WU.value, meta: Mapping[str, Any] | None = None) -> Envelope:
    """A weight version published by the parameter server."""
    return Envelope(kind, run_id, epoch, -1, -1, -1, version, dict(params), dict(meta or {}),
                    MessageType.WEIGHTS)


def tensor_batch(kind: str, run_id: str, epoch: int, stage: int, interval: int, partition: int,
                 tensors: Mapping[str, np.ndarray], version: int = -1,
                 meta: Mapping[str, Any] | None = None) -> Envelope:
    """An :class:`Envelope` of named tensors of any shape and dtype (see ``TENSOR_BATCH_DTYPES``)."""
    return Envelope(kind, run_id, epoch, stage, interval, partition, version, dict(tensors), dict(meta or {}),
                    MessageType.TENSOR_BATCH)


#: numpy dtypes a tensor_batch carries, by the name used in errors
TENSOR_BATCH_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                       "uint32", "uint64", "bool")


# ------------------------------------------------------------------------------------------------------ encoding
def _check_name(what: str, name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SchemaError(f"{what} {name!r} is not a valid name (letters, digits, _ . : / -; non-empty)")
    return name


def _check_int(what: str, v: Any) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise SchemaError(f"routing field {what} must be an integer, got {type(v).__name__} {v!r}")
    v = int(v)
    if not -(2**63) <= v < 2**63:
        raise SchemaError(f"routing field {what} = {v} does not fit int64")
    return v


def _metadata(mtype: MessageType, kind: str, run_id: str, epoch: int, stage: int, interval: int,
              partition: int, version: int, meta: Mapping[str, Any] | None) -> dict[str, str]:
    if not isinstance(run_id, str) or not run_id:
        raise SchemaError(f"run_id must be a non-empty string, got {run_id!r}")
    _check_name("task kind", str(kind) if isinstance(kind, Enum) else kind)
    md = {K_SCHEMA_VERSION: str(MESSAGE_SCHEMA_VERSION), K_TYPE: mtype.value, "dorylus.run_id": run_id,
          "dorylus.kind": str(kind)}
    for name, v in zip(_INT_ROUTING, (epoch, stage, interval, partition, version)):
        md[f"dorylus.{name}"] = str(_check_int(name, v))
    meta = {} if meta is None else meta
    if not isinstance(meta, Mapping):
        raise SchemaError(f"meta must be a mapping, got {type(meta).__name__}")
    try:
        # A tensor_batch's meta may hold a diverged run's statistics (NaN loss): Python's JSON reads NaN back.
        md[K_META] = json.dumps(dict(meta), separators=(",", ":"), sort_keys=True,
                                allow_nan=mtype is MessageType.TENSOR_BATCH, default=_json_scalar)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"meta is not a JSON object: {e}") from None
    return md


def _json_scalar(o: Any) -> Any:
    """numpy scalars in meta are written as the Python numbers they hold."""
    if isinstance(o, (np.integer, np.floating, np.bool_)):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _ids(what: str, a: Any) -> np.ndarray:
    if a is None:
        raise SchemaError(f"{what} ids are missing")
    a = np.asarray(a)
    if a.ndim != 1:
        raise SchemaError(f"{what} ids must be 1-D, got shape {a.shape}")
    if a.dtype != np.int64:
        if not (np.issubdtype(a.dtype, np.integer) and (a.size == 0 or np.can_cast(a.dtype, np.int64))):
            raise SchemaError(f"{what} ids must be int64, got dtype {a.dtype}")
        a = a.astype(np.int64)
    return np.ascontiguousarray(a)


def _float32(what: str, x: Any) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        if not np.issubdtype(x.dtype, np.floating):
            raise SchemaError(f"tensor {what!r} must be float32, got dtype {x.dtype}")
        x = x.astype(np.float32)  # float16/float64 are converted; integer/bool/object arrays are refused
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)  # (ascontiguousarray makes 0-d arrays 1-d)


def _row_tensor_field(name: str, x: np.ndarray, n: int, rows_of: str) -> tuple[pa.Field, pa.Array]:
    if x.ndim < 2:
        raise SchemaError(f"tensor {name!r} must have shape ({rows_of}, d, ...), got shape {x.shape}")
    if x.shape[0] != n:
        raise SchemaError(f"tensor {name!r} has {x.shape[0]} rows but the block has {n} {rows_of}")
    row_shape = tuple(int(s) for s in x.shape[1:])
    width = math.prod(row_shape)
    if width <= 0:
        raise SchemaError(f"tensor {name!r} has an empty row shape {row_shape}")
    typ = pa.list_(pa.field("item", pa.float32(), nullable=False), width)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), type=pa.float32()), type=typ)
    fmeta = {K_ROW_SHAPE: json.dumps(list(row_shape))} if len(row_shape) != 1 else None
    field = pa.field(name, typ, nullable=False, metadata=fmeta)
    return field, arr


def _params_batch(tensors: Mapping[str, np.ndarray]) -> pa.RecordBatch:
    names, shapes, flats = [], [], []
    for name, x in tensors.items():
        _check_name("parameter", name)
        x = _float32(name, x)
        names.append(name)
        shapes.append([int(s) for s in x.shape])
        flats.append(x.reshape(-1))
    flat = np.concatenate(flats) if flats else np.zeros(0, np.float32)
    offsets = np.zeros(len(flats) + 1, np.int64)
    np.cumsum([f.size for f in flats], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise SchemaError(f"parameters hold {offsets[-1]} values, more than one message can carry (2^31 - 1)")
    data = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat, type=pa.float32()),
                                    type=PARAMS_SCHEMA.field("data").type)
    shape_off = np.zeros(len(shapes) + 1, np.int32)
    np.cumsum([len(s) for s in shapes], out=shape_off[1:])
    shape_vals = np.array([d for s in shapes for d in s], dtype=np.int64)
    shape = pa.ListArray.from_arrays(pa.array(shape_off), pa.array(shape_vals, type=pa.int64()),
                                     type=PARAMS_SCHEMA.field("shape").type)
    return pa.RecordBatch.from_arrays([pa.array(names, type=pa.string()), shape, data], schema=PARAMS_SCHEMA)

_ARROW_TO_DTYPE = {str(pa.from_numpy_dtype(np.dtype(d))): np.dtype(d) for d in TENSOR_BATCH_DTYPES}


def _tensor_batch_batch(tensors: Mapping[str, np.ndarray], md: dict[str, str]) -> pa.RecordBatch:
    fields, arrays = [], []
    for name, x in tensors.items():
        _check_name("tensor", name)
        x = np.asarray(x)
        if x.dtype.name not in TENSOR_BATCH_DTYPES:
            raise SchemaError(f"tensor {name!r} has dtype {x.dtype}, a tensor_batch carries {TENSOR_BATCH_DTYPES}")
        flat = np.ascontiguousarray(x).reshape(-1)
        if flat.dtype.byteorder == ">":
            flat = flat.astype(flat.dtype.newbyteorder("<"))
        values = pa.array(flat, type=pa.from_numpy_dtype(flat.dtype))
        offsets = pa.array(np.array([0, flat.size], np.int64))
        typ = pa.large_list(pa.field("item", values.type, nullable=False))
        arrays.append(pa.LargeListArray.from_arrays(offsets, values, type=typ))
        fields.append(pa.field(name, typ, nullable=False,
                               metadata={K_SHAPE: json.dumps([int(s) for s in x.shape])}))
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=md))


def _tensor_batch_tensors(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    if batch.num_rows != (1 if batch.num_columns else 0):
        raise SchemaError(f"a tensor_batch has exactly one row (none when it holds no tensor), got "
                          f"{batch.num_rows}")
    out = {}
    for i, field in enumerate(batch.schema):
        name, col = field.name, batch.column(i)
        t = col.type
        if not (pa.types.is_large_list(t) or pa.types.is_list(t)):
            raise SchemaError(f"tensor_batch column {name!r} has type {t}, expected large_list<T>")
        dtype = _ARROW_TO_DTYPE.get(str(t.value_type))
        if dtype is None:
            raise SchemaError(f"tensor_batch column {name!r} has element type {t.value_type}, expected one of "
                              f"{TENSOR_BATCH_DTYPES}")
        fmeta = field.metadata or {}
        if K_SHAPE.encode() not in fmeta:
            raise SchemaError(f"tensor_batch column {name!r} has no {K_SHAPE} field metadata")
        try:
            shape = json.loads(fmeta[K_SHAPE.encode()])
            ok = isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                 for s in shape)
        except ValueError:
            ok = False
        if not ok:
            raise SchemaError(f"tensor_batch column {name!r}: {K_SHAPE} must be a JSON list of non-negative ints, "
                              f"got {fmeta[K_SHAPE.encode()]!r}")
        _no_nulls(name, col)
        values = col.flatten()
        if values.null_count:
            raise SchemaError(f"tensor_batch column {name!r} has {values.null_count} null elements")
        if len(values) != math.prod(shape):
            raise SchemaError(f"tensor {name!r}: declared shape {shape} needs {math.prod(shape)} values, "
                              f"the column has {len(values)}")
        arr = values.to_numpy(zero_copy_only=not pa.types.is_boolean(values.type))
        out[name] = arr.reshape(shape)
    return out


def _envelope_batch(env: Envelope) -> pa.RecordBatch:
    try:
        mtype = MessageType(env.type)
    except ValueError:
        raise SchemaError(f"unknown message type {env.type!r}; known: {[t.value for t in MessageType]}") from None
    if mtype in (MessageType.WATERMARK, MessageType.CONTROL):
        raise SchemaError(f"an Envelope cannot be a {mtype.value} message; use Watermark / Control")
    md = _metadata(mtype, env.kind, env.run_id, env.epoch, env.stage, env.interval, env.partition, env.version,
                   env.meta)
    if not isinstance(env.tensors, Mapping):
        raise SchemaError(f"tensors must be a mapping of name -> array, got {type(env.tensors).__name__}")
    if mtype in (MessageType.GRADIENTS, MessageType.WEIGHTS):
        return _params_batch(env.tensors).replace_schema_metadata(md)
    if mtype is MessageType.TENSOR_BATCH:
        return _tensor_batch_batch(env.tensors, md)
    id_names = _ID_COLUMNS[mtype]
    fields, arrays = [], []
    ids = [_ids(n, getattr(env, n)) for n in id_names]
    n = len(ids[0])
    if len(ids) == 2 and len(ids[1]) != n:
        raise SchemaError(f"edge block has {n} sources but {len(ids[1])} destinations")
    for name, a in zip(id_names, ids):
        fields.append(pa.field(name, pa.int64(), nullable=False))
        arrays.append(pa.array(a, type=pa.int64()))
    rows_of = "vertices" if mtype is MessageType.VERTEX_BLOCK else "edges"
    for name, x in env.tensors.items():
        _check_name("tensor", name)
        if name in id_names:
            raise SchemaError(f"tensor name {name!r} collides with the id column of a {mtype.value}")
        f, a = _row_tensor_field(name, _float32(name, x), n, rows_of)
        fields.append(f)
        arrays.append(a)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=md))


def _watermark_batch(marks: Sequence[Watermark]) -> pa.RecordBatch:
    if not marks:
        raise SchemaError("a watermark message needs at least one Watermark")
    run_ids = {m.run_id for m in marks}
    if len(run_ids) != 1:
        raise SchemaError(f"watermarks of one message must share a run_id, got {sorted(run_ids)}")
    for m in marks:
        if not isinstance(m, Watermark):
            raise SchemaError(f"expected Watermark, got {type(m).__name__}")
        _check_name("watermark producer", m.producer)
        _check_name("watermark channel", m.channel)
    partition = marks[0].partition if len({m.partition for m in marks}) == 1 else -1
    md = _metadata(MessageType.WATERMARK, TaskKind.WATERMARK.value, marks[0].run_id, -1, -1, -1, partition, -1,
                   None)
    cols = [
        pa.array([m.producer for m in marks], pa.string()),
        pa.array([_check_int("watermark partition", m.partition) for m in marks], pa.int32()),
        pa.array([_check_int("watermark epoch", m.epoch) for m in marks], pa.int64()),
        pa.array([_check_int("watermark stage", m.stage) for m in marks], pa.int32()),
        pa.array([m.channel for m in marks], pa.string()),
    ]
    return pa.RecordBatch.from_arrays(cols, schema=WATERMARK_SCHEMA.with_metadata(md))


def _control_batch(c: Control) -> pa.RecordBatch:
    _check_name("control command", c.command)
    if not isinstance(c.args, Mapping):
        raise SchemaError(f"control args must be a mapping, got {type(c.args).__name__}")
    try:
        args = json.dumps(dict(c.args), separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"control args are not a JSON object: {e}") from None
    md = _metadata(MessageType.CONTROL, TaskKind.CONTROL.value, c.run_id, -1, -1, -1, -1, -1, None)
    return pa.RecordBatch.from_arrays([pa.array([c.command], pa.string()), pa.array([args], pa.string())],
                                      schema=CONTROL_SCHEMA.with_metadata(md))


def to_record_batch(msg: WireMessage) -> pa.RecordBatch:
    """The record batch (with its schema metadata) that :func:`encode` writes."""
    if isinstance(msg, Envelope):
        return _envelope_batch(msg)
    if isinstance(msg, Watermark):
        return _watermark_batch([msg])
    if isinstance(msg, Control):
        return _control_batch(msg)
    if isinstance(msg, (list, tuple)):
        return _watermark_batch(list(msg))
    raise SchemaError(f"cannot encode a {type(msg).__name__}; expected Envelope, Watermark(s) or Control")


def _write_options(compression: str | None) -> pa.ipc.IpcWriteOptions:
    if compression not in COMPRESSIONS:
        raise SchemaError(f"unknown compression {compression!r}; choose one of {COMPRESSIONS}")
    return pa.ipc.IpcWriteOptions(compression=compression)


def encode_buffer(msg: WireMessage, compression: str | None = None) -> pa.Buffer:
    """Like :func:`encode`, returning the Arrow buffer without the copy into ``bytes``."""
    batch = to_record_batch(msg)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=_write_options(compression)) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def encode(msg: WireMessage, compression: str | None = None) -> bytes:
    """Encode an Envelope, a Watermark (or a list of them) or a Control as Arrow IPC stream bytes.

    ``compression``: ``None``, ``"lz4"`` or ``"zstd"`` (Arrow IPC buffer compression; readers decompress
    transparently).
    """
    return encode_buffer(msg, compression).to_pybytes()


# ------------------------------------------------------------------------------------------------------ decoding
def _as_buffer(data: Any) -> pa.Buffer:
    if isinstance(data, pa.Buffer):
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return pa.py_buffer(data)
    raise SchemaError(f"expected bytes (an Arrow IPC stream), got {type(data).__name__}")


def _open(data: Any) -> pa.ipc.RecordBatchStreamReader:
    try:
        return pa.ipc.open_stream(_as_buffer(data))
    except (pa.ArrowException, OSError) as e:
        raise SchemaError(f"not an Arrow IPC stream: {e}") from None


def _header_from_metadata(md: Mapping[bytes, bytes] | None) -> Header:
    if not md:
        raise SchemaError(f"missing schema version: message has no schema metadata ({K_SCHEMA_VERSION})")
    try:
        m = {k.decode(): v.decode() for k, v in md.items()}
    except UnicodeDecodeError as e:
        raise SchemaError(f"schema metadata is not UTF-8: {e}") from None
    if K_SCHEMA_VERSION not in m:
        raise SchemaError(f"missing schema version ({K_SCHEMA_VERSION}); not a dorylus message")
    try:
        sv = int(m[K_SCHEMA_VERSION])
    except ValueError:
        raise SchemaError(f"schema version {m[K_SCHEMA_VERSION]!r} is not an integer") from None
    if sv not in SUPPORTED_MESSAGE_SCHEMA_VERSIONS:
        raise SchemaError(f"unsupported schema version {sv}; this reader knows "
                          f"{sorted(SUPPORTED_MESSAGE_SCHEMA_VERSIONS)}")
    if K_TYPE not in m:
        raise SchemaError(f"missing message type ({K_TYPE})")
    try:
        mtype = MessageType(m[K_TYPE])
    except ValueError:
        raise SchemaError(f"unknown message type {m[K_TYPE]!r}; known: {[t.value for t in MessageType]}") from None
    vals: dict[str, Any] = {}
    for f in ROUTING_FIELDS:
        key = f"dorylus.{_V1_NAMES.get(f, f) if sv == 1 else f}"
        if key not in m:
            raise SchemaError(f"missing routing field {f} ({key})")
        vals[f] = m[key]
    for f in _INT_ROUTING:
        try:
            vals[f] = int(vals[f])
        except ValueError:
            raise SchemaError(f"routing field {f} = {vals[f]!r} is not an integer") from None
    if not vals["run_id"]:
        raise SchemaError("routing field run_id is empty")
    meta: Any = {}
    if K_META in m:
        try:
            meta = json.loads(m[K_META])
        except ValueError as e:
            raise SchemaError(f"{K_META} is not valid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise SchemaError(f"{K_META} must be a JSON object, got {type(meta).__name__}")
    return Header(mtype, meta=meta, schema_version=sv, **vals)


def peek_header(data: Any) -> Header:
    """The routing fields of a message; reads only the schema message, not the data."""
    return _header_from_metadata(_open(data).schema.metadata)


def _read_one(data: Any) -> tuple[Header, pa.RecordBatch]:
    reader = _open(data)
    header = _header_from_metadata(reader.schema.metadata)
    try:
        reader.schema.names
    except UnicodeDecodeError:
        raise SchemaError("column names are not valid UTF-8") from None
    try:
        batch = reader.read_next_batch()
    except StopIteration:
        raise SchemaError("message holds no record batch (expected exactly one)") from None
    except (pa.ArrowException, OSError) as e:
        raise SchemaError(f"corrupt record batch: {e}") from None
    try:
        reader.read_next_batch()
    except StopIteration:
        pass
    except (pa.ArrowException, OSError) as e:
        raise SchemaError(f"corrupt data after the record batch: {e}") from None
    else:
        raise SchemaError("message holds more than one record batch (expected exactly one)")
    try:
        batch.validate(full=True)
    except pa.ArrowException as e:
        raise SchemaError(f"invalid record batch: {e}") from None
    return header, batch


def _no_nulls(name: str, col: pa.Array) -> None:
    if col.null_count:
        raise SchemaError(f"column {name!r} has {col.null_count} nulls")


def _check_fixed_schema(mtype: MessageType, schema: pa.Schema, version: int = MESSAGE_SCHEMA_VERSION) -> None:
    want = _WATERMARK_SCHEMA_V1 if (mtype is MessageType.WATERMARK and version == 1) else _FIXED_SCHEMAS[mtype]
    for f in want:
        i = schema.get_field_index(f.name)
        if i < 0:
            raise SchemaError(f"{mtype.value} message is missing column {f.name!r}")
        got = schema.field(i).type
        if not got.equals(want.field(f.name).type, check_metadata=False) and not _loose_list_equal(
                got, want.field(f.name).type):
            raise SchemaError(f"{mtype.value} column {f.name!r} has type {got}, expected {want.field(f.name).type}")
    extra = [n for n in schema.names if n not in want.names]
    if extra:
        raise SchemaError(f"{mtype.value} message has unexpected columns {extra}")


def _loose_list_equal(got: pa.DataType, want: pa.DataType) -> bool:
    # list<item: T> vs list<element: T>, nullable or not: same data
    return (pa.types.is_list(got) and pa.types.is_list(want) and got.value_type.equals(want.value_type))


def _id_array(mtype: MessageType, batch: pa.RecordBatch, name: str) -> np.ndarray:
    i = batch.schema.get_field_index(name)
    if i < 0:
        raise SchemaError(f"{mtype.value} is missing the id column {name!r}")
    col = batch.column(i)
    if not pa.types.is_int64(col.type):
        raise SchemaError(f"{mtype.value} id column {name!r} has type {col.type}, expected int64")
    _no_nulls(name, col)
    return col.to_numpy(zero_copy_only=True)


def _row_tensor(name: str, field: pa.Field, col: pa.Array, n: int) -> np.ndarray:
    t = col.type
    if not pa.types.is_fixed_size_list(t):
        raise SchemaError(f"tensor column {name!r} has type {t}, expected fixed_size_list<float32>")
    if not pa.types.is_float32(t.value_type):
        raise SchemaError(f"tensor column {name!r} has element type {t.value_type}, expected float32")
    width = t.list_size
    row_shape: tuple[int, ...] = (width,)
    fmeta = field.metadata or {}
    if K_ROW_SHAPE.encode() in fmeta:
        try:
            rs = json.loads(fmeta[K_ROW_SHAPE.encode()])
            ok = isinstance(rs, list) and rs and all(isinstance(s, int) and s > 0 for s in rs)
        except ValueError:
            ok = False
        if not ok:
            raise SchemaError(f"tensor column {name!r}: {K_ROW_SHAPE} must be a JSON list of positive ints, "
                              f"got {fmeta[K_ROW_SHAPE.encode()]!r}")
        if math.prod(rs) != width:
            raise SchemaError(f"tensor column {name!r}: declared row shape {rs} has {math.prod(rs)} values "
                              f"but the column width is {width}")
        row_shape = tuple(rs)
    _no_nulls(name, col)
    values = col.flatten()
    if values.null_count:
        raise SchemaError(f"tensor column {name!r} has {values.null_count} null elements")
    if len(values) != n * width:
        raise SchemaError(f"tensor column {name!r}: {len(values)} values for {n} rows of width {width}")
    return values.to_numpy(zero_copy_only=True).reshape((n, *row_shape))


def _params_tensors(mtype: MessageType, batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    _check_fixed_schema(mtype, batch.schema)
    for name in PARAMS_SCHEMA.names:
        _no_nulls(name, batch.column(name))
    names = batch.column("name").to_pylist()
    if len(set(names)) != len(names):
        raise SchemaError(f"{mtype.value} message repeats parameter names: {names}")
    shapes = batch.column("shape").to_pylist()
    data = batch.column("data")
    if data.values.null_count:
        raise SchemaError(f"{mtype.value} column 'data' has null elements")
    values = data.values.to_numpy(zero_copy_only=True)
    offsets = data.offsets.to_numpy()
    out = {}
    for k, (name, shape) in enumerate(zip(names, shapes)):
        if any(s is None or s < 0 for s in shape):
            raise SchemaError(f"parameter {name!r} has an invalid shape {shape}")
        size = int(offsets[k + 1] - offsets[k])
        if math.prod(shape) != size:
            raise SchemaError(f"parameter {name!r}: declared shape {shape} needs {math.prod(shape)} values, "
                              f"data has {size}")
        out[name] = values[offsets[k]:offsets[k + 1]].reshape(shape)
    return out


def _envelope_from(header: Header, batch: pa.RecordBatch) -> Envelope:
    mtype = header.type
    common = dict(kind=header.kind, run_id=header.run_id, epoch=header.epoch, stage=header.stage,
                  interval=header.interval, partition=header.partition, version=header.version,
                  meta=header.meta, type=mtype)
    if mtype in (MessageType.GRADIENTS, MessageType.WEIGHTS):
        return Envelope(tensors=_params_tensors(mtype, batch), **common)
    if mtype is MessageType.TENSOR_BATCH:
        return Envelope(tensors=_tensor_batch_tensors(batch), **common)
    id_names = _ID_COLUMNS[mtype]
    ids = {n: _id_array(mtype, batch, n) for n in id_names}
    n = batch.num_rows
    tensors = {}
    for i, field in enumerate(batch.schema):
        if field.name in id_names:
            continue
        tensors[field.name] = _row_tensor(field.name, field, batch.column(i), n)
    return Envelope(tensors=tensors, **common, **ids)


def decode(data: Any, expect: MessageType | str | None = None) -> Envelope:
    """Decode a vertex block, edge block, gradients or weights message (validated) into an :class:`Envelope`.

    ``expect`` (a message type) makes any other type an error. Raises :class:`SchemaError` on any mismatch.
    """
    header, batch = _read_one(data)
    if expect is not None and header.type is not MessageType(expect):
        raise SchemaError(f"expected a {MessageType(expect).value} message, got {header.type.value}")
    if header.type in (MessageType.WATERMARK, MessageType.CONTROL):
        raise SchemaError(f"a {header.type.value} message is not an Envelope; use decode_message")
    return _envelope_from(header, batch)


def _watermarks_from(header: Header, batch: pa.RecordBatch) -> list[Watermark]:
    _check_fixed_schema(MessageType.WATERMARK, batch.schema, header.schema_version)
    cols = {}
    for name in WATERMARK_SCHEMA.names:
        stored = _V1_NAMES.get(name, name) if header.schema_version == 1 else name
        _no_nulls(stored, batch.column(stored))
        cols[name] = batch.column(stored).to_pylist()
    return [Watermark(header.run_id, p, int(pa_), int(e), int(st), c)
            for p, pa_, e, st, c in zip(cols["producer"], cols["partition"], cols["epoch"], cols["stage"],
                                       cols["channel"])]


def _control_from(header: Header, batch: pa.RecordBatch) -> Control:
    _check_fixed_schema(MessageType.CONTROL, batch.schema)
    if batch.num_rows != 1:
        raise SchemaError(f"a control message has exactly one row, got {batch.num_rows}")
    for name in CONTROL_SCHEMA.names:
        _no_nulls(name, batch.column(name))
    raw = batch.column("args")[0].as_py()
    try:
        args = json.loads(raw)
    except ValueError as e:
        raise SchemaError(f"control args are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise SchemaError(f"control args must be a JSON object, got {type(args).__name__}")
    return Control(header.run_id, batch.column("command")[0].as_py(), args)


def decode_watermarks(data: Any) -> list[Watermark]:
    header, batch = _read_one(data)
    if header.type is not MessageType.WATERMARK:
        raise SchemaError(f"expected a watermark message, got {header.type.value}")
    return _watermarks_from(header, batch)


def decode_control(data: Any) -> Control:
    header, batch = _read_one(data)
    if header.type is not MessageType.CONTROL:
        raise SchemaError(f"expected a control message, got {header.type.value}")
    return _control_from(header, batch)


def decode_message(data: Any) -> Envelope | list[Watermark] | Control:
    """Decode any message: an Envelope, a list of Watermarks or a Control, by its ``dorylus.type``."""
    header, batch = _read_one(data)
    if header.type is MessageType.WATERMARK:
        return _watermarks_from(header, batch)
    if header.type is MessageType.CONTROL:
        return _control_from(header, batch)
    return _envelope_from(header, batch)


def arrow_schema(msg: WireMessage) -> pa.Schema:
    """The Arrow schema (with routing metadata) a message is written with."""
    return to_record_batch(msg).schema
