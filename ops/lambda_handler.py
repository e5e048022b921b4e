"""The AWS Lambda entry point of a tensor worker: ``handler(event, context)`` runs one tensor task.

It runs any tensor task of the engine (AV, AE, the fused last layer LAST, LOSS, and the backward tasks AV_BWD,
AE_BWD) with :func:`ops.tasks.run_tensor_task`, the same function the local pool runs, so results are the same.
Imports only ``ops``, ``schemas``, numpy, jax and pyarrow; ``boto3`` (present in the Lambda runtime) is imported
lazily for S3 references only, ``kafka`` (kafka-python, in the project image) for Kafka references only.

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
    {"ok": false, "event_version": 1, "error": {"type": "...", "message": "...", "retryable": false}}

``result`` is a tensor_batch with the arrays for the graph server (``h``/``alpha``, ``dh``, ``d_<input>``);
``grads`` a gradients message (parameter gradients, keys ``stage/param``) when the task has any. Both come
back inline (base64) while the whole response fits ``inline_limit``, else as S3 references under
``output.s3.prefix``; with no ``output.s3`` an oversized output is an ``OutputTooLarge`` error.
"""
from __future__ import annotations

import base64
import binascii
import collections
import functools
import json
import math
import os
import threading
import time
from typing import Any, Mapping

import numpy as np

from ops import params as P
import schemas
from schemas import MessageType, SchemaError
from schemas.tasks import TENSOR_TASK_KINDS, StageKind, TaskKind

EVENT_VERSION = 1
#: Lambda's limit on a synchronous (RequestResponse) invocation's request and response payloads: 6 MB.
INVOKE_LIMIT_BYTES = 6 * 1024 * 1024
#: The largest task input (bytes of Arrow IPC) a handler accepts by reference; env DORYLUS_MAX_INPUT_BYTES.
DEFAULT_MAX_INPUT_BYTES = 2 * 1024 ** 3
TENSOR_KINDS = TENSOR_TASK_KINDS
REF_KINDS = ("inline", "s3", "kafka")

_INT_ARRAYS = ("row_gids", "labels", "indices", "indptr", "row_ids", "col_gids")
_BLOCK = ("data", "indices", "indptr", "row_ids", "row_gids", "col_gids")


class HandlerError(Exception):
    """A failure the handler reports as a structured error response."""

    def __init__(self, type_: str, message: str, retryable: bool = False):
        super().__init__(message)
        self.type = type_
        self.message = message
        self.retryable = retryable

    def response(self) -> dict:
        return error_response(self.type, self.message, self.retryable)


def error_response(type_: str, message: str, retryable: bool = False) -> dict:
    return {"ok": False, "event_version": EVENT_VERSION,
            "error": {"type": type_, "message": message, "retryable": bool(retryable)}}


# ------------------------------------------------------------------------------------------------------ references
def _b64decode(s: Any, what: str) -> bytes:
    if not isinstance(s, str):
        raise HandlerError("InvalidEvent", f"{what}.inline must be a base64 string, got {type(s).__name__}")
    if len(s) > INVOKE_LIMIT_BYTES * 2:
        raise HandlerError("PayloadTooLarge", f"{what}.inline holds {len(s)} characters, more than an invocation "
                                              f"can carry ({INVOKE_LIMIT_BYTES} bytes)")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as e:
        raise HandlerError("InvalidEvent", f"{what}.inline is not valid base64: {e}") from None


def _check_ref(ref: Any, what: str) -> tuple[str, Any]:
    if not isinstance(ref, Mapping):
        raise HandlerError("InvalidEvent", f"{what} must be an object with one of {list(REF_KINDS)}, "
                                           f"got {type(ref).__name__}")
    keys = [k for k in REF_KINDS if k in ref]
    extra = sorted(set(ref) - set(REF_KINDS) - {"bytes"})
    if len(keys) != 1 or extra:
        raise HandlerError("InvalidEvent", f"{what} must have exactly one of {list(REF_KINDS)}, got keys "
                                           f"{sorted(ref)}")
    kind = keys[0]
    val = ref[kind]
    if kind == "s3":
        if not (isinstance(val, Mapping) and isinstance(val.get("bucket"), str) and val.get("bucket")
                and isinstance(val.get("key"), str) and val.get("key")):
            raise HandlerError("InvalidEvent", f"{what}.s3 must be {{\"bucket\": str, \"key\": str}}, got {val!r}")
    elif kind == "kafka":
        ok = (isinstance(val, Mapping) and isinstance(val.get("topic"), str) and val.get("topic")
              and isinstance(val.get("bootstrap"), (str, list)) and val.get("bootstrap")
              and all(isinstance(val.get(k), int) and not isinstance(val.get(k), bool) and val.get(k) >= 0
                      for k in ("partition", "offset")))
        if not ok:
            raise HandlerError("InvalidEvent", f"{what}.kafka must be {{\"bootstrap\": str, \"topic\": str, "
                                               f"\"partition\": int >= 0, \"offset\": int >= 0}}, got {val!r}")
    return kind, val


def max_input_bytes() -> int:
    try:
        return int(os.environ.get("DORYLUS_MAX_INPUT_BYTES", DEFAULT_MAX_INPUT_BYTES))
    except ValueError:
        return DEFAULT_MAX_INPUT_BYTES


_clients: dict = {}
_clients_lock = threading.Lock()


def _s3_client():
    """boto3's S3 client, created on first use (boto3 is in the Lambda runtime, not a dependency of ops)."""
    with _clients_lock:
        if "s3" not in _clients:
            try:
                import boto3
            except ModuleNotFoundError:
                raise HandlerError("DependencyMissing", "an S3 reference needs boto3, which is not installed") \
                    from None
            _clients["s3"] = boto3.client("s3")
        return _clients["s3"]


def _storage_error(e: Exception, what: str, where: str) -> HandlerError:
    code, status = "", 0
    resp = getattr(e, "response", None)
    if isinstance(resp, Mapping):
        code = str(resp.get("Error", {}).get("Code", ""))
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    retryable = code in ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                         "ThrottlingException", "RequestLimitExceeded") or status >= 500
    if not code:  # no HTTP answer at all (connection, credentials): transient at best
        retryable = type(e).__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                         "ConnectionClosedError")
    return HandlerError("StorageError", f"{what}: {where}: {code or type(e).__name__}: {e}", retryable)


def _s3_get(val: Mapping, what: str) -> bytes:
    s3 = _s3_client()
    where = f"s3://{val['bucket']}/{val['key']}"
    try:
        obj = s3.get_object(Bucket=val["bucket"], Key=val["key"])
        size = int(obj.get("ContentLength", 0))
        if size > max_input_bytes():
            raise HandlerError("PayloadTooLarge", f"{what}: {where} holds {size} bytes, more than the handler "
                                                  f"accepts ({max_input_bytes()}, DORYLUS_MAX_INPUT_BYTES)")
        return obj["Body"].read()
    except HandlerError:
        raise
    except Exception as e:  # botocore ClientError and transport errors
        raise _storage_error(e, what, where) from None


def _s3_put(bucket: str, key: str, data: bytes) -> None:
    try:
        _s3_client().put_object(Bucket=bucket, Key=key, Body=data)
    except HandlerError:
        raise
    except Exception as e:
        raise _storage_error(e, "output", f"s3://{bucket}/{key}") from None


def _kafka_get(val: Mapping, what: str) -> bytes:
    """One record's value, read at (topic, partition, offset) with kafka-python (in the project image)."""
    try:
        from kafka import KafkaConsumer, TopicPartition
    except ModuleNotFoundError:
        raise HandlerError("DependencyMissing", f"{what}: a Kafka reference needs kafka-python, which is not "
                                                f"installed") from None
    tp = TopicPartition(val["topic"], val["partition"])
    where = f"kafka {val['topic']}[{val['partition']}]@{val['offset']}"
    try:
        consumer = KafkaConsumer(bootstrap_servers=val["bootstrap"], enable_auto_commit=False, group_id=None,
                                 fetch_max_bytes=max_input_bytes(), max_partition_fetch_bytes=max_input_bytes(),
                                 request_timeout_ms=30000, api_version_auto_timeout_ms=10000)
    except Exception as e:
        raise HandlerError("InputUnavailable", f"{what}: {where}: cannot reach the broker: {e}", True) from None
    try:
        consumer.assign([tp])
        consumer.seek(tp, val["offset"])
        deadline = time.monotonic() + float(val.get("timeout_s", 20))
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500, max_records=1).values():
                for r in records:
                    if r.offset != val["offset"]:
                        raise HandlerError("InputUnavailable", f"{what}: {where}: offset {val['offset']} is gone "
                                                               f"(the first record is at {r.offset})")
                    if r.value is None:
                        raise HandlerError("InvalidInput", f"{what}: {where}: the record has no value")
                    return bytes(r.value)
        raise HandlerError("InputUnavailable", f"{what}: {where}: no record within the timeout", True)
    except HandlerError:
        raise
    except Exception as e:
        raise HandlerError("InputUnavailable", f"{what}: {where}: {type(e).__name__}: {e}", True) from None
    finally:
        consumer.close()


def fetch_ref(ref: Any, what: str) -> bytes:
    """The bytes a reference names (inline, S3 or Kafka)."""
    kind, val = _check_ref(ref, what)
    if kind == "inline":
        return _b64decode(val, what)
    if kind == "s3":
        return _s3_get(val, what)
    return _kafka_get(val, what)


# ------------------------------------------------------------------------------------------------------ weights
_WEIGHTS_CACHE: collections.OrderedDict = collections.OrderedDict()  # (bucket, key) -> (version, params)
_WEIGHTS_CACHE_SIZE = 4


def unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    """{"stage/param": array} -> {stage: {param: array}} (`ops.params`); InvalidWeights for any other name."""
    try:
        return P.unflatten(flat, strict=True)
    except P.ParamNameError as e:
        raise HandlerError("InvalidWeights", f"weights: {e}") from None


def _load_weights(ref: Any) -> tuple[int, dict, int, bool]:
    """(version, params, bytes read, cache hit). S3 weight versions are cached across warm invocations."""
    kind, val = _check_ref(ref, "weights")
    cache_key = (val["bucket"], val["key"]) if kind == "s3" else None
    if cache_key is not None and cache_key in _WEIGHTS_CACHE:
        _WEIGHTS_CACHE.move_to_end(cache_key)
        version, params = _WEIGHTS_CACHE[cache_key]
        return version, params, 0, True
    data = fetch_ref(ref, "weights")
    try:
        env = schemas.decode(data, expect=MessageType.WEIGHTS)
    except SchemaError as e:
        raise HandlerError("InvalidWeights", f"weights: {e}") from None
    params = unflatten(env.tensors)
    if cache_key is not None:
        _WEIGHTS_CACHE[cache_key] = (env.version, params)
        while len(_WEIGHTS_CACHE) > _WEIGHTS_CACHE_SIZE:
            _WEIGHTS_CACHE.popitem(last=False)
    return env.version, params, len(data), False


# ------------------------------------------------------------------------------------------------------ validation
@functools.lru_cache(maxsize=16)
def _model(spec_json: str):
    from ops import models

    try:
        return models.from_spec(json.loads(spec_json))
    except (TypeError, ValueError, KeyError) as e:
        raise HandlerError("InvalidTask", f"task meta.model is not a model spec: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=16)
def _param_shapes(spec_json: str) -> dict:
    import jax

    model = _model(spec_json)
    shapes = jax.eval_shape(model.init, jax.ShapeDtypeStruct((2,), np.uint32))
    return {s: {n: tuple(v.shape) for n, v in p.items()} for s, p in shapes.items()}


def _need(cond: bool, msg: str, type_: str = "InvalidTask") -> None:
    if not cond:
        raise HandlerError(type_, msg)


def _arr(arrays: Mapping, name: str, kind: str) -> np.ndarray:
    _need(name in arrays, f"{kind} task is missing array {name!r} (has {sorted(arrays)})")
    return arrays[name]


def _float(arrays, name, kind, ndim_min=1):
    a = _arr(arrays, name, kind)
    _need(a.dtype == np.float32, f"{kind} task: {name!r} must be float32, got {a.dtype}")
    _need(a.ndim >= ndim_min, f"{kind} task: {name!r} must have at least {ndim_min} dims, got shape {a.shape}")
    return a


def _int(arrays, name, kind, n=None):
    a = _arr(arrays, name, kind)
    _need(a.dtype in (np.int32, np.int64), f"{kind} task: {name!r} must be int32 or int64, got {a.dtype}")
    _need(a.ndim == 1, f"{kind} task: {name!r} must be 1-D, got shape {a.shape}")
    if n is not None:
        _need(a.shape[0] == n, f"{kind} task: {name!r} has {a.shape[0]} entries, expected {n}")
    return a


def _rows(arrays, name, kind, R):
    a = _float(arrays, name, kind, 2)
    _need(a.shape[0] == R, f"{kind} task: {name!r} has {a.shape[0]} rows, but the block has {R} (row_gids)")
    return a


def _check_block(arrays, kind: str, R: int) -> None:
    data = _float(arrays, "data", kind)
    _need(data.ndim == 1, f"{kind} task: 'data' must be 1-D, got shape {data.shape}")
    nnz = data.shape[0]
    indices = _int(arrays, "indices", kind, nnz)
    indptr = _int(arrays, "indptr", kind, R + 1)
    _int(arrays, "row_ids", kind, nnz)
    C = _int(arrays, "col_gids", kind).shape[0]
    _need(indptr[0] == 0 and indptr[-1] == nnz and bool((np.diff(indptr) >= 0).all()),
          f"{kind} task: 'indptr' is not a CSR row pointer over {nnz} entries")
    _need(nnz == 0 or (int(indices.min()) >= 0 and int(indices.max()) < C),
          f"{kind} task: 'indices' out of range for {C} columns")
    row_ids = arrays["row_ids"]
    _need(nnz == 0 or (int(row_ids.min()) >= 0 and int(row_ids.max()) < R),
          f"{kind} task: 'row_ids' out of range for {R} rows")


def check_task(env, params: dict) -> tuple[Any, int, dict, dict]:
    """Validate a decoded task against its model; returns (model, stage index, arrays, meta)."""
    from ops import models

    kind = env.kind
    _need(kind in TENSOR_KINDS, f"unknown tensor task kind {kind!r} (one of {list(TENSOR_KINDS)})")
    meta = dict(env.meta)
    spec = meta.get("model")
    _need(isinstance(spec, Mapping) and isinstance(spec.get("name"), str),
          f"{kind} task: meta.model must be a model spec object, got {type(spec).__name__}")
    spec_json = json.dumps(spec, sort_keys=True)
    model = _model(spec_json)
    stages = model.stages
    s = env.stage
    _need(0 <= s < len(stages), f"{kind} task: stage {s} does not exist (the model has {len(stages)} stages)")
    st = stages[s]
    if kind == TaskKind.LOSS:
        _need(st.kind == StageKind.LOSS, f"LOSS task on stage {s}, which is {st.kind}")
    elif kind == TaskKind.LAST:
        _need(st.kind == StageKind.AV and s == len(stages) - 2,
              f"LAST task on stage {s} ({st.kind}): the fused last layer is the AV right before the loss")
    else:
        _need(st.kind == kind.split("_")[0], f"{kind} task on stage {s}, which is {st.kind}")
    seed = meta.get("seed")
    _need(seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 32),
          f"{kind} task: meta.seed must be null or a uint32, got {seed!r}")
    a = env.tensors
    R = _int(a, "row_gids", kind).shape[0]
    if kind in (TaskKind.AV, TaskKind.AV_BWD, TaskKind.LAST, TaskKind.LOSS):
        h = _rows(a, "h", kind, R)
        if st.kind == StageKind.AV and st.in_dim:
            _need(h.ndim == 2 and h.shape[1] == st.in_dim,
                  f"{kind} task: 'h' has shape {h.shape}, stage {st.name} takes ({R}, {st.in_dim})")
    if kind in (TaskKind.LAST, TaskKind.LOSS):
        lab = _int(a, "labels", kind, R)
        mask = _arr(a, "mask", kind)
        _need(mask.dtype == np.bool_ and mask.shape == (R,), f"{kind} task: 'mask' must be bool ({R},), got "
                                                             f"{mask.dtype} {mask.shape}")
        _need(R == 0 or (int(lab.min()) >= 0 and int(lab.max()) < model.num_classes),
              f"{kind} task: labels out of range for {model.num_classes} classes")
        scale = meta.get("scale")
        _need(isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale),
              f"{kind} task: meta.scale must be a finite number, got {scale!r}")
    if kind in (TaskKind.AE, TaskKind.AE_BWD):
        _check_block(a, kind, R)
        C = a["col_gids"].shape[0]
        s_src = _float(a, "s_src", kind, 2)
        s_dst = _rows(a, "s_dst", kind, R)
        _need(s_src.shape[0] == C, f"{kind} task: 's_src' has {s_src.shape[0]} rows, the block has {C} columns")
        _need(s_src.shape[1:] == s_dst.shape[1:] == (max(st.heads, 1),),
              f"{kind} task: 's_src'/'s_dst' must have {max(st.heads, 1)} heads, got {s_src.shape}, {s_dst.shape}")
    if kind in (TaskKind.AV_BWD, TaskKind.AE_BWD):
        wrt = meta.get("wrt", [])
        reads = models.reads(st)
        _need(isinstance(wrt, list) and all(w in reads for w in wrt),
              f"{kind} task: meta.wrt must list inputs of stage {st.name} ({sorted(reads)}), got {wrt!r}")
        g = {k[2:] for k in a if k.startswith("g_")}
        writes = set(models.writes(st))
        _need(g and g <= writes, f"{kind} task: output gradients {sorted('g_' + k for k in g)} must be among "
                                 f"{sorted('g_' + k for k in writes)}")
        for k in g:
            _float(a, f"g_{k}", kind)
    allowed = {"h", "row_gids", "labels", "mask", "s_src", "s_dst", *_BLOCK} | {k for k in a if k.startswith("g_")}
    extra = sorted(set(a) - allowed)
    _need(not extra, f"{kind} task: unexpected arrays {extra}")
    # The weights: every parameter the task's stages use, with the model's shapes.
    names = [st.name] if kind != TaskKind.LOSS else []
    if kind in (TaskKind.LAST, TaskKind.LOSS):
        names.append(stages[-1].name)
    want = _param_shapes(spec_json)
    for n in names:
        for pname, shape in want.get(n, {}).items():
            got = params.get(n, {}).get(pname)
            _need(got is not None, f"weights lack parameter {n}/{pname}", "InvalidWeights")
            _need(tuple(got.shape) == shape and got.dtype == np.float32,
                  f"weights: {n}/{pname} has shape {tuple(got.shape)} {got.dtype}, the model needs {shape} float32",
                  "InvalidWeights")
    return model, s, dict(a), meta


def _check_out_grads(model, kind: str, s: int, params: dict, arrays: dict, meta: dict) -> None:
    """∇ tasks: each output gradient must have the shape of the output it is the gradient of."""
    if kind not in (TaskKind.AV_BWD, TaskKind.AE_BWD):
        return
    import jax

    from ops import tasks

    st = model.stages[s]
    p = params.get(st.name, {})
    if st.kind == StageKind.AV:
        adj, inputs = tasks.Rows(arrays["row_gids"]), {"h": arrays["h"]}
    else:
        adj = tasks.block_from_arrays(arrays, arrays["s_dst"].shape[0], arrays["s_src"].shape[0])
        inputs = {"s_src": arrays["s_src"], "s_dst": arrays["s_dst"]}
    out = jax.eval_shape(tasks.forward_fn(st), p, inputs, adj, np.uint32(0))
    for k, v in arrays.items():
        if k.startswith("g_"):
            _need(tuple(v.shape) == tuple(out[k[2:]].shape),
                  f"{kind} task: {k!r} has shape {tuple(v.shape)}, the output {k[2:]!r} has {tuple(out[k[2:]].shape)}")


# ------------------------------------------------------------------------------------------------------ handler
_invocations = 0


def _parse_output(out: Any) -> tuple[int, Mapping | None, str | None]:
    if out is None:
        return INVOKE_LIMIT_BYTES, None, None
    _need(isinstance(out, Mapping), f"output must be an object, got {type(out).__name__}", "InvalidEvent")
    extra = sorted(set(out) - {"inline_limit", "s3", "compression"})
    _need(not extra, f"output has unknown keys {extra}", "InvalidEvent")
    limit = out.get("inline_limit", INVOKE_LIMIT_BYTES)
    _need(isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit <= INVOKE_LIMIT_BYTES,
          f"output.inline_limit must be an integer in [0, {INVOKE_LIMIT_BYTES}], got {limit!r}", "InvalidEvent")
    s3 = out.get("s3")
    if s3 is not None:
        _need(isinstance(s3, Mapping) and isinstance(s3.get("bucket"), str) and s3["bucket"]
              and isinstance(s3.get("prefix"), str),
              f"output.s3 must be {{\"bucket\": str, \"prefix\": str}}, got {s3!r}", "InvalidEvent")
    comp = out.get("compression")
    _need(comp in schemas.COMPRESSIONS, f"output.compression must be one of {list(schemas.COMPRESSIONS)}, "
                                        f"got {comp!r}", "InvalidEvent")
    return limit, s3, comp


def handler(event: Any, context: Any = None) -> dict:
    """Run one tensor task; never raises (errors are ``{"ok": false, "error": {...}}``)."""
    global _invocations
    _invocations += 1
    cold = _invocations == 1
    t0 = time.perf_counter()
    try:
        return _handle(event, context, t0, cold)
    except HandlerError as e:
        return e.response()
    except MemoryError:
        return error_response("OutOfMemory", "the task does not fit this function's memory", False)
    except Exception as e:  # a bug: report it rather than let Lambda retry a deterministic failure
        return error_response("InternalError", f"{type(e).__name__}: {e}", False)


def _handle(event: Any, context: Any, t0: float, cold: bool) -> dict:
    if isinstance(event, (str, bytes)):
        try:
            event = json.loads(event)
        except ValueError as e:
            raise HandlerError("InvalidEvent", f"event is not JSON: {e}") from None
    _need(isinstance(event, Mapping), f"event must be a JSON object, got {type(event).__name__}", "InvalidEvent")
    ev = event.get("event_version")
    _need(ev is not None, "event lacks event_version", "InvalidEvent")
    _need(ev == EVENT_VERSION, f"unsupported event_version {ev!r}; this handler speaks {EVENT_VERSION}",
          "UnsupportedVersion")
    extra = sorted(set(event) - {"event_version", "task", "input", "weights", "output"})
    _need(not extra, f"event has unknown keys {extra}", "InvalidEvent")
    for k in ("input", "weights"):
        _need(k in event, f"event lacks {k!r}", "InvalidEvent")
    task_kind = event.get("task")
    _need(task_kind is None or task_kind in TENSOR_KINDS,
          f"unknown task {task_kind!r} (one of {list(TENSOR_KINDS)})", "InvalidTask")
    limit, out_s3, comp = _parse_output(event.get("output"))
    _check_ref(event["weights"], "weights")
    data = fetch_ref(event["input"], "input")
    try:
        env = schemas.decode(data, expect=MessageType.TENSOR_BATCH)
    except SchemaError as e:
        raise HandlerError("InvalidInput", f"input: {e}") from None
    _need(task_kind is None or env.kind == task_kind,
          f"event names task {task_kind!r} but the input is a {env.kind!r} task")
    version, params, wbytes, cached = _load_weights(event["weights"])
    _need(version == env.version, f"weights are version {version}, the task needs version {env.version}",
          "InvalidWeights")
    model, s, arrays, meta = check_task(env, params)
    _check_out_grads(model, env.kind, s, params, arrays, meta)
    t1 = time.perf_counter()
    from ops.tasks import run_tensor_task

    result, grads, scalars = run_tensor_task(model, env.kind, s, params, arrays, meta)
    result = {k: np.asarray(v) for k, v in result.items()}
    grads = P.flatten(grads)
    compute_s = time.perf_counter() - t1
    attempt = meta.get("attempt", 0)
    routing = dict(kind=env.kind, run_id=env.run_id, epoch=env.epoch, stage=env.stage, interval=env.interval,
                   partition=env.partition)
    res_bytes = schemas.encode(schemas.tensor_batch(tensors=result, version=env.version,
                                                    meta={"attempt": attempt, **scalars}, **routing), comp)
    g_bytes = None
    if grads:
        g_bytes = schemas.encode(schemas.gradients(env.run_id, env.epoch, env.version, grads, kind=env.kind,
                                                   stage=env.stage, interval=env.interval,
                                                   partition=env.partition), comp)
    resp = {"ok": True, "event_version": EVENT_VERSION,
            "task": {"kind": env.kind, "epoch": env.epoch, "stage": env.stage, "interval": env.interval,
                     "partition": env.partition, "version": env.version, "attempt": attempt},
            "result": {"inline": base64.b64encode(res_bytes).decode("ascii")},
            "grads": None if g_bytes is None else {"inline": base64.b64encode(g_bytes).decode("ascii")},
            "scalars": scalars,
            "stats": {"compute_s": compute_s, "bytes_in": len(data) + wbytes, "weights_cached": cached,
                      "bytes_out": len(res_bytes) + (len(g_bytes) if g_bytes else 0), "cold_start": cold,
                      "memory_mb": _memory_mb(context)}}
    size = len(json.dumps(resp))
    if size > limit:
        _need(out_s3 is not None, f"the output ({size} bytes as JSON) exceeds the inline limit of {limit} bytes "
                                  f"and the event names no output.s3 location", "OutputTooLarge")
        prefix = out_s3["prefix"]
        for name, b in (("result", res_bytes), ("grads", g_bytes)):
            if b is None:
                continue
            key = f"{prefix}{name}.arrow"
            _s3_put(out_s3["bucket"], key, b)
            resp[name] = {"s3": {"bucket": out_s3["bucket"], "key": key}, "bytes": len(b)}
    resp["stats"]["handler_s"] = time.perf_counter() - t0
    return resp


def _memory_mb(context: Any) -> int | None:
    v = getattr(context, "memory_limit_in_mb", None)
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------------ client side
def encode_task(kind: str, epoch: int, stage: int, interval: int, partition: int, version: int,
                arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], run_id: str = "dorylus",
                compression: str | None = None) -> bytes:
    """A task as the handler reads it: a tensor_batch with the engine's routing and meta."""
    return schemas.encode(schemas.tensor_batch(kind, run_id, epoch, stage, interval, partition,
                                               {k: np.asarray(v) for k, v in arrays.items()}, version=version,
                                               meta=dict(meta)), compression)


def encode_weights(version: int, flat: Mapping[str, np.ndarray], run_id: str = "dorylus",
                   compression: str | None = None) -> bytes:
    """A weight version ({"stage/param": array}) as the handler reads it."""
    return schemas.encode(schemas.weights(run_id, version, dict(flat)), compression)


def inline(data: bytes) -> dict:
    return {"inline": base64.b64encode(data).decode("ascii")}


def make_event(task: dict, weights: dict, output: Mapping | None = None, kind: str | None = None) -> dict:
    """An event from references (``inline(bytes)``, ``{"s3": {...}}`` or ``{"kafka": {...}}``)."""
    ev = {"event_version": EVENT_VERSION, "input": task, "weights": weights}
    if kind is not None:
        ev["task"] = kind
    if output:
        ev["output"] = dict(output)
    return ev


def decode_result(resp: Mapping, fetch=fetch_ref) -> tuple[dict, dict, dict]:
    """(result arrays, flat parameter gradients, scalars) of a successful response; fetch reads references."""
    if not resp.get("ok"):
        err = resp.get("error", {})
        raise HandlerError(err.get("type", "Error"), err.get("message", "?"), bool(err.get("retryable")))
    res = schemas.decode(fetch(resp["result"], "result"), expect=MessageType.TENSOR_BATCH)
    grads = {}
    if resp.get("grads"):
        grads = dict(schemas.decode(fetch(resp["grads"], "grads"), expect=MessageType.GRADIENTS).tensors)
    return dict(res.tensors), grads, dict(resp.get("scalars", {}))
