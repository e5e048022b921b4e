"""The tensor-worker Lambda's wire format: events, references and responses, and the client helpers that build and
read them (used by the handler, ops/lambda_handler.py, and by the AWS backend, pipelines/engine/aws_lambda.py).

Event (a JSON object; ``event_version`` 1)::

    {
      "event_version": 1,
      "task": "AV",                                   # optional: must match the input's kind when given
      "input":   <ref>,                               # a tensor_batch message (schemas): the task's arrays
      "weights": <ref>,                               # a weights message (schemas): the task's weight version
      "output":  {"inline_limit": 6291456,            # optional: largest inline response (bytes of JSON)
                  "s3": {"bucket": "b", "prefix": "runs/r/out/t1/"},   # optional: where larger outputs go
                  "compression": "zstd"}              # optional: Arrow IPC compression of the outputs
    }

    <ref> is one of
      {"inline": "<base64 Arrow IPC stream>"}
      {"s3": {"bucket": "b", "key": "k"}}
      {"kafka": {"bootstrap": "host:port", "topic": "t", "partition": 0, "offset": 42}}

The task message is a ``tensor_batch`` (see :mod:`schemas.messages`): routing fields in the schema metadata
(``kind``; ``stage`` = the engine's stage index; ``epoch``, ``interval``, ``partition``; ``version`` = the weight
version), the model spec and task settings (``model``, ``seed``, ``scale``, ``wrt``, ``attempt``) in
``dorylus.meta``, and the arrays as columns. The weights message must carry the same version.

Response::

    {"ok": true, "event_version": 1, "task": {kind, epoch, stage, interval, partition, version, attempt},
     "result": <ref>, "grads": <ref> | null, "scalars": {...}, "stats": {...}}
    {"ok": false, "event_version": 1, "error": {"type": "...", "message": "...", "retryable": false}, "stats": {...}}

``stats`` (both): ``handler_s`` (the handler's own time), ``encode_s`` (its JSON encoding of the response, which
the runtime repeats after it returns), ``runtime_s`` (the invocation as Lambda bills it: from its start, when the
runtime's deadline tells it, to the handler's end, plus ``encode_s`` where the runtime's post is not timed) and,
on a cold start, ``init_s`` (the handler module's import); :func:`billed_ms` turns them into the billed duration
where no REPORT line is at hand. Inside awslambdaric the handler also times the runtime's marshalling and post of
each response and reports it in the next response of the same instance, ``prev_invocation`` = {``request_id``,
``runtime_s``, ``after_s``}; :func:`billed_after` adds it to that invocation's bill.

``result`` is a tensor_batch with the arrays for the graph server (``h``/``alpha``, ``dh``, ``d_<input>``);
``grads`` a gradients message (parameter gradients, keys ``stage/param``) when the task has any. Both come
back inline (base64) while the whole response fits ``inline_limit``, else as S3 references under
``output.s3.prefix``; with no ``output.s3`` an oversized output is an ``OutputTooLarge`` error.

Reading S3 and Kafka references is :mod:`ops.refs`; this module decodes inline ones only.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from . import messages
from .messages import MessageType
from .tasks import TENSOR_TASK_KINDS

EVENT_VERSION = 1
#: Lambda's limit on a synchronous (RequestResponse) invocation's request and response payloads: 6 MB.
INVOKE_LIMIT_BYTES = 6 * 1024 * 1024
TENSOR_KINDS = TENSOR_TASK_KINDS
REF_KINDS = ("inline", "s3", "kafka")
EVENT_KEYS = ("event_version", "task", "input", "weights", "output")
OUTPUT_KEYS = ("inline_limit", "s3", "compression")


class HandlerError(Exception):
    """A failure reported as a structured error response: ``type`` (e.g. ``InvalidEvent``), message, and whether
    a retry may succeed."""

    def __init__(self, type_: str, message: str, retryable: bool = False):
        super().__init__(message)
        self.type = type_
        self.message = message
        self.retryable = retryable

    def response(self) -> dict:
        return error_response(self.type, self.message, self.retryable)


def error_response(type_: str, message: str, retryable: bool = False) -> dict:
    """The response of a failed task."""
    return {"ok": False, "event_version": EVENT_VERSION,
            "error": {"type": type_, "message": message, "retryable": bool(retryable)}}


def require(cond: bool, msg: str, type_: str = "InvalidEvent") -> None:
    """HandlerError(type_, msg) unless ``cond``."""
    if not cond:
        raise HandlerError(type_, msg)


# ------------------------------------------------------------------------------------------------------ references
def check_ref(ref: Any, what: str) -> tuple[str, Any]:
    """(kind, value) of a well-formed reference; HandlerError("InvalidEvent") otherwise."""
    require(isinstance(ref, Mapping), f"{what} must be an object with one of {list(REF_KINDS)}, "
                                      f"got {type(ref).__name__}")
    keys = [k for k in REF_KINDS if k in ref]
    extra = sorted(set(ref) - set(REF_KINDS) - {"bytes"})
    require(len(keys) == 1 and not extra, f"{what} must have exactly one of {list(REF_KINDS)}, got keys "
                                          f"{sorted(ref)}")
    kind = keys[0]
    val = ref[kind]
    if kind == "s3":
        require(isinstance(val, Mapping) and isinstance(val.get("bucket"), str) and bool(val.get("bucket"))
                and isinstance(val.get("key"), str) and bool(val.get("key")),
                f"{what}.s3 must be {{\"bucket\": str, \"key\": str}}, got {val!r}")
    elif kind == "kafka":
        ok = (isinstance(val, Mapping) and isinstance(val.get("topic"), str) and val.get("topic")
              and isinstance(val.get("bootstrap"), (str, list)) and val.get("bootstrap")
              and all(isinstance(val.get(k), int) and not isinstance(val.get(k), bool) and val.get(k) >= 0
                      for k in ("partition", "offset")))
        require(bool(ok), f"{what}.kafka must be {{\"bootstrap\": str, \"topic\": str, \"partition\": int >= 0, "
                          f"\"offset\": int >= 0}}, got {val!r}")
    return kind, val


def decode_inline(s: Any, what: str) -> bytes:
    """The bytes of an inline reference's base64 string (at most what one invocation can carry)."""
    require(isinstance(s, str), f"{what}.inline must be a base64 string, got {type(s).__name__}")
    require(len(s) <= INVOKE_LIMIT_BYTES * 2, f"{what}.inline holds {len(s)} characters, more than an invocation "
                                              f"can carry ({INVOKE_LIMIT_BYTES} bytes)", "PayloadTooLarge")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as e:
        raise HandlerError("InvalidEvent", f"{what}.inline is not valid base64: {e}") from None


def inline(data: bytes) -> dict:
    """An inline reference to ``data``."""
    return {"inline": base64.b64encode(data).decode("ascii")}


def fetch_inline(ref: Any, what: str) -> bytes:
    """The bytes of an inline reference; a reference to S3 or Kafka needs :func:`ops.refs.fetch_ref`."""
    kind, val = check_ref(ref, what)
    require(kind == "inline", f"{what} is a {kind} reference; read it with ops.refs.fetch_ref", "InvalidResponse")
    return decode_inline(val, what)


# ------------------------------------------------------------------------------------------------------ events
class Event(NamedTuple):
    """A checked event: the task kind it names (or None), the input and weights references, the output options."""

    task: str | None
    input: Any
    weights: Any
    inline_limit: int
    output_s3: Mapping | None
    compression: str | None


def parse_output(out: Any) -> tuple[int, Mapping | None, str | None]:
    """(inline limit, S3 location or None, compression or None) of an event's ``output`` object."""
    if out is None:
        return INVOKE_LIMIT_BYTES, None, None
    require(isinstance(out, Mapping), f"output must be an object, got {type(out).__name__}")
    extra = sorted(set(out) - set(OUTPUT_KEYS))
    require(not extra, f"output has unknown keys {extra}")
    limit = out.get("inline_limit", INVOKE_LIMIT_BYTES)
    require(isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit <= INVOKE_LIMIT_BYTES,
            f"output.inline_limit must be an integer in [0, {INVOKE_LIMIT_BYTES}], got {limit!r}")
    s3 = out.get("s3")
    if s3 is not None:
        require(isinstance(s3, Mapping) and isinstance(s3.get("bucket"), str) and bool(s3["bucket"])
                and isinstance(s3.get("prefix"), str),
                f"output.s3 must be {{\"bucket\": str, \"prefix\": str}}, got {s3!r}")
    comp = out.get("compression")
    require(comp in messages.COMPRESSIONS, f"output.compression must be one of {list(messages.COMPRESSIONS)}, "
                                           f"got {comp!r}")
    return limit, s3, comp


def parse_event(event: Any) -> Event:
    """Check an event (a JSON object or its text) as far as its format goes; HandlerError otherwise."""
    if isinstance(event, (str, bytes)):
        try:
            event = json.loads(event)
        except ValueError as e:
            raise HandlerError("InvalidEvent", f"event is not JSON: {e}") from None
    require(isinstance(event, Mapping), f"event must be a JSON object, got {type(event).__name__}")
    ev = event.get("event_version")
    require(ev is not None, "event lacks event_version")
    require(ev == EVENT_VERSION, f"unsupported event_version {ev!r}; this handler speaks {EVENT_VERSION}",
            "UnsupportedVersion")
    extra = sorted(set(event) - set(EVENT_KEYS))
    require(not extra, f"event has unknown keys {extra}")
    for k in ("input", "weights"):
        require(k in event, f"event lacks {k!r}")
    task_kind = event.get("task")
    require(task_kind is None or task_kind in TENSOR_KINDS,
            f"unknown task {task_kind!r} (one of {list(TENSOR_KINDS)})", "InvalidTask")
    limit, out_s3, comp = parse_output(event.get("output"))
    check_ref(event["weights"], "weights")
    return Event(task_kind, event["input"], event["weights"], limit, out_s3, comp)


def make_event(task: dict, weights: dict, output: Mapping | None = None, kind: str | None = None) -> dict:
    """An event from references (``inline(bytes)``, ``{"s3": {...}}`` or ``{"kafka": {...}}``)."""
    ev = {"event_version": EVENT_VERSION, "input": task, "weights": weights}
    if kind is not None:
        ev["task"] = kind
    if output:
        ev["output"] = dict(output)
    return ev


def encode_task(kind: str, epoch: int, stage: int, interval: int, partition: int, version: int,
                arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], run_id: str = "dorylus",
                compression: str | None = None) -> bytes:
    """A task as the handler reads it: a tensor_batch with the engine's routing and meta."""
    return messages.encode(messages.tensor_batch(kind, run_id, epoch, stage, interval, partition,
                                                 {k: np.asarray(v) for k, v in arrays.items()}, version=version,
                                                 meta=dict(meta)), compression)


def encode_weights(version: int, flat: Mapping[str, np.ndarray], run_id: str = "dorylus",
                   compression: str | None = None) -> bytes:
    """A weight version ({"stage/param": array}) as the handler reads it."""
    return messages.encode(messages.weights(run_id, version, dict(flat)), compression)


# ------------------------------------------------------------------------------------------------------ responses
def ok_response(task: Mapping, result: bytes, grads: bytes | None, scalars: Mapping, stats: Mapping) -> dict:
    """The response of a successful task, its outputs inline (see :func:`response_size`)."""
    return {"ok": True, "event_version": EVENT_VERSION, "task": dict(task), "result": inline(result),
            "grads": None if grads is None else inline(grads), "scalars": dict(scalars), "stats": dict(stats)}


def billed_ms(resp: Any) -> int | None:
    """Milliseconds Lambda bills for an invocation, from the runtime's own timing in its response: ``stats.
    runtime_s`` (invocation start to handler end) rounded up to 1 ms, plus ``stats.init_s`` (the init phase of a
    cold start) rounded up the same way; None when the response carries no timing (a runtime error)."""
    stats = resp.get("stats") if isinstance(resp, Mapping) else None
    if not isinstance(stats, Mapping) or not isinstance(stats.get("runtime_s"), (int, float)):
        return None
    ms = max(1, math.ceil(float(stats["runtime_s"]) * 1000.0))
    init = stats.get("init_s")
    if isinstance(init, (int, float)) and init > 0:
        ms += math.ceil(float(init) * 1000.0)
    return ms


def billed_after(resp: Any) -> tuple[str, int] | None:
    """(request id, ms) that the runtime's work after its handler returned (marshalling and posting the
    response, which the handler cannot time) adds to the bill of the instance's previous invocation, from
    ``stats.prev_invocation`` of this response: ceil(runtime_s + after_s) - ceil(runtime_s), in ms, the same
    rounding as :func:`billed_ms`; None when the response carries none."""
    stats = resp.get("stats") if isinstance(resp, Mapping) else None
    prev = stats.get("prev_invocation") if isinstance(stats, Mapping) else None
    if not isinstance(prev, Mapping) or not isinstance(prev.get("request_id"), str):
        return None
    rt, after = prev.get("runtime_s"), prev.get("after_s")
    if not isinstance(rt, (int, float)) or not isinstance(after, (int, float)) or rt < 0 or after < 0:
        return None
    ms = max(1, math.ceil(float(rt) * 1000.0))
    return prev["request_id"], max(1, math.ceil((float(rt) + float(after)) * 1000.0)) - ms


def response_size(resp: Mapping) -> int:
    """Bytes of a response as JSON: what counts against ``output.inline_limit``."""
    return len(json.dumps(resp))


def decode_result(resp: Mapping, fetch: Callable[[Any, str], bytes] = fetch_inline) -> tuple[dict, dict, dict]:
    """(result arrays, flat parameter gradients, scalars) of a successful response; ``fetch`` reads references
    (inline only by default; :func:`ops.refs.fetch_ref` reads S3 and Kafka too). HandlerError for an error
    response."""
    if not resp.get("ok"):
        err = resp.get("error", {})
        raise HandlerError(err.get("type", "Error"), err.get("message", "?"), bool(err.get("retryable")))
    res = messages.decode(fetch(resp["result"], "result"), expect=MessageType.TENSOR_BATCH)
    grads = {}
    if resp.get("grads"):
        grads = dict(messages.decode(fetch(resp["grads"], "grads"), expect=MessageType.GRADIENTS).tensors)
    return dict(res.tensors), grads, dict(resp.get("scalars", {}))
