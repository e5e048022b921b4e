"""The engine's `Message` on the wire: one Arrow IPC stream (the schemas of `schemas.messages`) per message.

Each engine message maps onto the most specific Arrow message type that carries it exactly; anything else is a
generic ``tensor_batch`` (named tensors of any dtype). ``decode(encode(m)) == m`` for every engine message:
same kind, routing fields, array names, dtypes, shapes and bits, and the same meta (as JSON gives it back).

=============================  =====================  =======================================================
engine message                 Arrow message type     mapping
=============================  =====================  =======================================================
SC, SC_BWD (ghost rows)        ``vertex_block``       ``vertex`` (int64 global ids) + one ``fixed_size_list
                                                      <float32>`` column per tensor; ``stage``
GRAD                           ``gradients``          one row per parameter (``stage/name``), ``version``
WEIGHTS                        ``weights``            one row per parameter, ``version``
WM                             ``watermark``          one row: producer ``graph-server-<p>``, partition p,
                                                      epoch, stage, channel ``ghosts`` (forward) or
                                                      ``ghosts.grad`` (backward)
STOP, STOP_AFTER               ``control``            command = kind; args = routing fields + meta
everything else (tensor        ``tensor_batch``       one ``large_list<T>`` column per array (any dtype) with
tasks, results, metrics)                              its shape in the field metadata
=============================  =====================  =======================================================

The engine's ``stage`` travels as the header's ``dorylus.stage`` (the index in the model's stage list). A message
that does not fit its specific type exactly (say a float64 ghost tensor) falls back to ``tensor_batch``, so the
mapping never changes a value.
"""
from __future__ import annotations

import numpy as np

from schemas import messages as S
from schemas.messages import SchemaError
from schemas.tasks import CONTROL_KINDS, Channel, Direction, Message, TaskKind

_WM_CHANNELS = {Direction.FORWARD: Channel.GHOSTS, Direction.BACKWARD: Channel.GHOST_GRADS}
_WM_DIRS = {v: k for k, v in _WM_CHANNELS.items()}


def _is_f32_rows(a, n: int) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim >= 2 and a.shape[0] == n \
        and all(s > 0 for s in a.shape[1:])


def _vertex_fit(msg: Message) -> bool:
    v = msg.arrays.get("vertex")
    if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype != np.int64 or len(msg.arrays) < 2:
        return False
    return all(_is_f32_rows(a, v.shape[0]) for k, a in msg.arrays.items() if k != "vertex")


def _params_fit(msg: Message) -> bool:
    return bool(msg.arrays) and all(isinstance(a, np.ndarray) and a.dtype == np.float32
                                    for a in msg.arrays.values())


def to_arrow(msg: Message, run_id: str):
    """The `schemas.messages` object an engine message travels as."""
    common = (msg.kind, run_id, msg.epoch, msg.stage, msg.interval, msg.partition)
    if msg.kind in (TaskKind.SC, TaskKind.SC_BWD) and _vertex_fit(msg):
        tensors = {k: v for k, v in msg.arrays.items() if k != "vertex"}
        return S.vertex_block(*common, vertex=msg.arrays["vertex"], tensors=tensors, version=msg.version,
                              meta=msg.meta)
    if msg.kind in (TaskKind.GRAD, TaskKind.WEIGHTS) and _params_fit(msg):
        mtype = S.MessageType.GRADIENTS if msg.kind == TaskKind.GRAD else S.MessageType.WEIGHTS
        return S.Envelope(msg.kind, run_id, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version,
                          dict(msg.arrays), dict(msg.meta), mtype)
    if (msg.kind == TaskKind.WATERMARK and not msg.arrays and set(msg.meta) == {"dir"}
            and msg.meta["dir"] in _WM_CHANNELS
            and msg.interval == -1 and msg.version == -1):
        return S.Watermark(run_id, f"graph-server-{msg.partition}", msg.partition, msg.epoch, msg.stage,
                           _WM_CHANNELS[msg.meta["dir"]])
    if msg.kind in CONTROL_KINDS and not msg.arrays:
        return S.Control(run_id, msg.kind, {"epoch": msg.epoch, "stage": msg.stage, "interval": msg.interval,
                                            "partition": msg.partition, "version": msg.version,
                                            "meta": dict(msg.meta)})
    arrays = {k: np.asarray(v) for k, v in msg.arrays.items()}
    return S.tensor_batch(*common, tensors=arrays, version=msg.version, meta=msg.meta)


def encode(msg: Message, run_id: str, compression: str | None = None) -> bytes:
    """Arrow IPC stream bytes of an engine message (``compression``: None, "lz4" or "zstd", Arrow-level, so any
    Arrow reader decompresses it)."""
    return S.encode(to_arrow(msg, run_id), compression=compression)


def encode_buffer(msg: Message, run_id: str, compression: str | None = None):
    """Like `encode`, as the Arrow buffer itself (no copy into ``bytes``; ``memoryview(buf)`` is bytes-like)."""
    return S.encode_buffer(to_arrow(msg, run_id), compression=compression)


def from_arrow(obj) -> tuple[str, Message]:
    """(run id, engine message) of a decoded `schemas.messages` object."""
    if isinstance(obj, list):  # watermarks
        if len(obj) != 1:
            raise SchemaError(f"an engine watermark message has one mark, got {len(obj)}")
        w = obj[0]
        if w.channel not in _WM_DIRS:
            raise SchemaError(f"watermark channel {w.channel!r} is not one the engine uses ({sorted(_WM_DIRS)})")
        return w.run_id, Message(TaskKind.WATERMARK, w.epoch, w.stage, -1, w.partition, -1,
                                 meta={"dir": _WM_DIRS[w.channel]})
    if isinstance(obj, S.Control):
        a = obj.args
        try:
            msg = Message(obj.command, int(a["epoch"]), int(a["stage"]), int(a["interval"]), int(a["partition"]),
                          int(a["version"]), meta=dict(a.get("meta", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"control message {obj.command!r} lacks routing args: {e}") from None
        return obj.run_id, msg
    env: S.Envelope = obj
    arrays = dict(env.tensors)
    if env.type is S.MessageType.VERTEX_BLOCK:
        if "vertex" in arrays:
            raise SchemaError("a vertex block tensor may not be named 'vertex'")
        arrays["vertex"] = env.vertex
    elif env.type is S.MessageType.EDGE_BLOCK:
        raise SchemaError("the engine sends no edge blocks")
    return env.run_id, Message(env.kind, env.epoch, env.stage, env.interval, env.partition, env.version,
                               arrays=arrays, meta=dict(env.meta))


def decode(data, run_id: str | None = None) -> Message:
    """The engine message in Arrow IPC bytes; SchemaError for anything that is not one (or is another run's)."""
    got_run, msg = from_arrow(S.decode_message(data))
    if run_id is not None and got_run != run_id:
        raise SchemaError(f"message of run {got_run!r} on a channel of run {run_id!r}")
    return msg
