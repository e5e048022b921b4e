"""Vertex predictions that `dorylus stream` publishes after each model version (one Arrow batch per message).

Columns:

``vertex: int64``               the vertex id (as in the events)
``prediction: int32``           the predicted class (argmax of the logits)
``logits: fixed_size_list<float32>[C]``  the model's logits (C = classes; the list size is in the type)
``model_version: int64``        the model version that computed it (`models` topic announcements)
``watermark: timestamp[ms, UTC]``  the event-time cut of the graph it was computed on: every event below it
                                is in that graph

Schema metadata: ``dorylus.type = "vertex_predictions"``, ``dorylus.schema_version``. Messages of a topic are
partitioned by ``vertex mod partitions``. A version is published twice for the vertices that changed: after it
is trained (on its own graph) and, before the next version trains, on the next round's graph (a later
watermark); so the newest prediction of a vertex is its row with the largest (model_version, watermark), which
is also the last row for it in its partition.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from .messages import SCHEMA_VERSION, SchemaError

PREDICTIONS_TYPE = "vertex_predictions"
_TS = pa.timestamp("ms", tz="UTC")


def predictions_schema(num_classes: int) -> pa.Schema:
    return pa.schema([pa.field("vertex", pa.int64(), nullable=False),
                      pa.field("prediction", pa.int32(), nullable=False),
                      pa.field("logits", pa.list_(pa.float32(), int(num_classes)), nullable=False),
                      pa.field("model_version", pa.int64(), nullable=False),
                      pa.field("watermark", _TS, nullable=False)],
                     metadata={b"dorylus.schema_version": str(SCHEMA_VERSION).encode(),
                               b"dorylus.type": PREDICTIONS_TYPE.encode()})


def predictions_batch(vertex: np.ndarray, logits: np.ndarray, model_version: int,
                      watermark_ms: int) -> pa.RecordBatch:
    """A batch of predictions: one row per vertex; logits float32 [rows, classes]."""
    logits = np.ascontiguousarray(logits, np.float32)
    n, c = logits.shape
    cols = [pa.array(np.asarray(vertex, np.int64)), pa.array(logits.argmax(axis=1).astype(np.int32)),
            pa.FixedSizeListArray.from_arrays(pa.array(logits.ravel()), c),
            pa.array(np.full(n, model_version, np.int64)),
            pa.array(np.full(n, watermark_ms, np.int64)).cast(_TS)]
    return pa.RecordBatch.from_arrays(cols, schema=predictions_schema(c))


def encode_predictions(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode_predictions(data: Any) -> pa.Table:
    """Decode one predictions message; SchemaError when it is not one."""
    try:
        t = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError, TypeError) as e:
        raise SchemaError(f"not an Arrow IPC stream: {e}") from None
    kind = (t.schema.metadata or {}).get(b"dorylus.type", b"").decode(errors="replace")
    if kind != PREDICTIONS_TYPE:
        raise SchemaError(f"expected a {PREDICTIONS_TYPE} message, got {kind!r}")
    want = [f.name for f in predictions_schema(1)]
    if t.schema.names != want:
        raise SchemaError(f"predictions columns {t.schema.names}, expected {want}")
    return t
