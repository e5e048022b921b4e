"""The AWS Lambda entry point of a tensor worker: ``handler(event, context)`` runs one tensor task.

It runs any tensor task of the engine (AV, AE, the fused last layer LAST, LOSS, and the backward tasks AV_BWD,
AE_BWD) with :func:`ops.tasks.run_tensor_task`, the same function the local pool runs, so results are the same.
This module handles and validates: it checks the task against its model and the weights against the model's
shapes, runs it and answers. The event and response format, and the client helpers that build events and read
responses, are :mod:`schemas.lambda_events`; reading S3/Kafka references and writing outputs to S3 is
:mod:`ops.refs`. Imports only ``ops``, ``schemas``, numpy, jax and pyarrow (and, inside a runtime, awslambdaric, to
time its post of the response).
"""
from __future__ import annotations

import time

_IMPORT_T0 = time.perf_counter()  # the function's init phase is mostly this module's imports (jax, pyarrow)

import collections
import functools
import json
import math
import os
from typing import Any, Mapping

import jax
import numpy as np

import schemas
from ops import models, refs, tasks
from ops import params as P
from schemas import MessageType, SchemaError
from schemas.tasks import StageKind, TaskKind
from schemas.lambda_events import TENSOR_KINDS, HandlerError, check_ref, error_response, ok_response, parse_event, \
    require, response_size

_BLOCK = ("data", "indices", "indptr", "row_ids", "row_gids", "col_gids")


# ------------------------------------------------------------------------------------------------------ weights
_WEIGHTS_CACHE: collections.OrderedDict = collections.OrderedDict()  # (bucket, key) -> (version, params)
_WEIGHTS_CACHE_SIZE = 4


def clear_caches() -> None:
    """Forget what warm invocations keep: the cached weight versions and the network clients."""
    _WEIGHTS_CACHE.clear()
    refs.reset_clients()


def unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    """{"stage/param": array} -> {stage: {param: array}} (`ops.params`); InvalidWeights for any other name."""
    try:
        return P.unflatten(flat, strict=True)
    except P.ParamNameError as e:
        raise HandlerError("InvalidWeights", f"weights: {e}") from None


def _load_weights(ref: Any) -> tuple[int, dict, int, bool]:
    """(version, params, bytes read, cache hit). S3 weight versions are cached across warm invocations."""
    kind, val = check_ref(ref, "weights")
    cache_key = (val["bucket"], val["key"]) if kind == "s3" else None
    if cache_key is not None and cache_key in _WEIGHTS_CACHE:
        _WEIGHTS_CACHE.move_to_end(cache_key)
        version, params = _WEIGHTS_CACHE[cache_key]
        return version, params, 0, True
    data = refs.fetch_ref(ref, "weights")
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
    try:
        return models.from_spec(json.loads(spec_json))
    except (TypeError, ValueError, KeyError) as e:
        raise HandlerError("InvalidTask", f"task meta.model is not a model spec: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=16)
def _param_shapes(spec_json: str) -> dict:
    model = _model(spec_json)
    shapes = jax.eval_shape(model.init, jax.ShapeDtypeStruct((2,), np.uint32))
    return {s: {n: tuple(v.shape) for n, v in p.items()} for s, p in shapes.items()}


def _need(cond: bool, msg: str, type_: str = "InvalidTask") -> None:
    require(cond, msg, type_)


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


def _check_chain(kind: str, model, s: int, meta: Mapping) -> tuple[int, ...]:
    """The stages a task runs (``meta.stages``: fused consecutive AV stages) and their seeds."""
    try:
        chain = tasks.task_stages(model, s, meta)
    except (TypeError, ValueError) as e:
        raise HandlerError("InvalidTask", f"{kind} task: {e}") from None
    if len(chain) > 1:
        _need(kind in (TaskKind.AV, TaskKind.AV_BWD, TaskKind.LAST),
              f"{kind} task cannot run fused stages {list(chain)}")
        seeds = meta.get("seeds")
        _need(meta.get("seed") is None or (isinstance(seeds, list) and len(seeds) == len(chain) and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2 ** 32 for x in seeds)),
            f"{kind} task: meta.seeds must list one uint32 per fused stage ({len(chain)}), got {seeds!r}")
    rows = meta.get("rows")
    _need(rows is None or (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0
                           and kind in tasks.ROW_LOCAL_KINDS),
          f"{kind} task: meta.rows must be a row count of a row-local task, got {rows!r}")
    return chain


def _check_stage(kind: str, s: int, stages, last: int | None = None) -> Any:
    """The stage a task of ``kind`` runs on: it must exist and be of the task's kind; `last` is the final
    stage of a fused chain starting at s."""
    _need(0 <= s < len(stages), f"{kind} task: stage {s} does not exist (the model has {len(stages)} stages)")
    st = stages[s]
    if kind == TaskKind.LOSS:
        _need(st.kind == StageKind.LOSS, f"LOSS task on stage {s}, which is {st.kind}")
    elif kind == TaskKind.LAST:
        _need(st.kind == StageKind.AV and (s if last is None else last) == len(stages) - 2,
              f"LAST task on stage {s} ({st.kind}): the fused last layer is the AV right before the loss")
    else:
        _need(st.kind == kind.split("_")[0], f"{kind} task on stage {s}, which is {st.kind}")
    return st


def _check_loss_inputs(a: Mapping, kind: str, R: int, model, meta: Mapping) -> None:
    """LAST/LOSS: labels in range, a bool mask, a finite loss scale."""
    lab = _int(a, "labels", kind, R)
    mask = _arr(a, "mask", kind)
    _need(mask.dtype == np.bool_ and mask.shape == (R,), f"{kind} task: 'mask' must be bool ({R},), got "
                                                         f"{mask.dtype} {mask.shape}")
    _need(R == 0 or (int(lab.min()) >= 0 and int(lab.max()) < model.num_classes),
          f"{kind} task: labels out of range for {model.num_classes} classes")
    scale = meta.get("scale")
    _need(isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale),
          f"{kind} task: meta.scale must be a finite number, got {scale!r}")


def _check_attention_inputs(a: Mapping, kind: str, R: int, st) -> None:
    """AE/AE_BWD: a CSR block and per-head scores of its columns and rows."""
    _check_block(a, kind, R)
    C = a["col_gids"].shape[0]
    s_src = _float(a, "s_src", kind, 2)
    s_dst = _rows(a, "s_dst", kind, R)
    _need(s_src.shape[0] == C, f"{kind} task: 's_src' has {s_src.shape[0]} rows, the block has {C} columns")
    _need(s_src.shape[1:] == s_dst.shape[1:] == (max(st.heads, 1),),
          f"{kind} task: 's_src'/'s_dst' must have {max(st.heads, 1)} heads, got {s_src.shape}, {s_dst.shape}")


def _check_backward_inputs(a: Mapping, kind: str, st, meta: Mapping) -> None:
    """AV_BWD/AE_BWD: ``meta.wrt`` among the stage's inputs, output gradients among its outputs."""
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


def _check_weights(kind: str, st, stages, spec_json: str, params: dict, chain=None) -> None:
    """Every parameter the task's stages use, with the model's shapes, float32."""
    names = [stages[k].name for k in (chain or (st.index,))] if kind != TaskKind.LOSS else []
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


def check_task(env, params: dict) -> tuple[Any, int, dict, dict]:
    """Validate a decoded task against its model; returns (model, stage index, arrays, meta)."""
    kind = env.kind
    _need(kind in TENSOR_KINDS, f"unknown tensor task kind {kind!r} (one of {list(TENSOR_KINDS)})")
    meta = dict(env.meta)
    spec = meta.get("model")
    _need(isinstance(spec, Mapping) and isinstance(spec.get("name"), str),
          f"{kind} task: meta.model must be a model spec object, got {type(spec).__name__}")
    spec_json = json.dumps(spec, sort_keys=True)
    model = _model(spec_json)
    s = env.stage
    _need(0 <= s < len(model.stages), f"{kind} task: stage {s} does not exist (the model has "
                                      f"{len(model.stages)} stages)")
    chain = _check_chain(kind, model, s, meta)
    st = _check_stage(kind, s, model.stages, chain[-1])
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
        _check_loss_inputs(a, kind, R, model, meta)
    if kind in (TaskKind.AE, TaskKind.AE_BWD):
        _check_attention_inputs(a, kind, R, st)
    if kind in (TaskKind.AV_BWD, TaskKind.AE_BWD):
        _check_backward_inputs(a, kind, st, meta)
    allowed = {"h", "row_gids", "labels", "mask", "s_src", "s_dst", *_BLOCK} | {k for k in a if k.startswith("g_")}
    extra = sorted(set(a) - allowed)
    _need(not extra, f"{kind} task: unexpected arrays {extra}")
    _check_weights(kind, st, model.stages, spec_json, params, chain)
    return model, s, dict(a), meta


def _check_out_grads(model, kind: str, s: int, params: dict, arrays: dict, meta: dict) -> None:
    """∇ tasks: each output gradient must have the shape of the output it is the gradient of."""
    if kind not in (TaskKind.AV_BWD, TaskKind.AE_BWD):
        return
    st = model.stages[s]
    p = params.get(st.name, {})
    chain = tasks.task_stages(model, s, meta)
    if len(chain) > 1:
        stages = tuple(model.stages[k] for k in chain)
        p = {model.stages[k].name: params[model.stages[k].name] for k in chain if model.stages[k].has_params}
        rows = meta.get("rows") or arrays["row_gids"].shape[0]
        h = jax.ShapeDtypeStruct((rows, *arrays["h"].shape[1:]), np.float32)
        out = jax.eval_shape(tasks.chain_forward_fn(stages), p, {"h": h},
                             tasks.Rows(jax.ShapeDtypeStruct((rows,), np.int32)), None)
        out = {k: (arrays["row_gids"].shape[0], *v.shape[1:]) for k, v in out.items()}
        for k, v in arrays.items():
            if k.startswith("g_"):
                _need(k[2:] in out and tuple(v.shape) == out[k[2:]],
                      f"{kind} task: {k!r} has shape {tuple(v.shape)}, the output {k[2:]!r} has {out.get(k[2:])}")
        return
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


def handler(event: Any, context: Any = None) -> dict:
    """Run one tensor task; never raises (errors are ``{"ok": false, "error": {...}}``)."""
    global _invocations
    _invocations += 1
    cold = _invocations == 1
    t0 = time.perf_counter()
    queued_s = _since_invoke(context)
    try:
        resp = _handle(event, context, t0, cold)
    except HandlerError as e:
        resp = e.response()
    except MemoryError:
        resp = error_response("OutOfMemory", "the task does not fit this function's memory", False)
    except Exception as e:  # a bug: report it rather than let Lambda retry a deterministic failure
        resp = error_response("InternalError", f"{type(e).__name__}: {e}", False)
    stats = resp.setdefault("stats", {})
    if "after_s" in _PREV:
        stats["prev_invocation"] = {k: _PREV[k] for k in ("request_id", "runtime_s", "after_s")}
    stats["handler_s"] = time.perf_counter() - t0
    # the runtime's own encoding and post of this response: timed and reported by the next invocation where the
    # posts are timed, else estimated by the handler's encoding of it
    after = 0.0 if _RESPONSE_POSTS_TIMED else stats.get("encode_s", 0.0)
    stats["runtime_s"] = queued_s + stats["handler_s"] + after
    if cold:
        stats["init_s"] = _INIT_S
    _PREV.clear()
    rid = getattr(context, "aws_request_id", None)
    if _RESPONSE_POSTS_TIMED and isinstance(rid, str):
        _PREV.update(request_id=rid, runtime_s=stats["runtime_s"], returned=time.perf_counter())
    return resp


# The previous invocation of this instance: its request id, its runtime_s, when the handler returned and (once the
# runtime has posted its response) after_s, the seconds from that return to the post's end.
_PREV: dict = {}
_RESPONSE_POSTS_TIMED = False


def _time_response_posts() -> bool:
    """Time what the runtime does after the handler returns, which Lambda bills but the handler cannot see: it
    marshals the response to JSON and posts it to the Runtime API (a few ms on a loaded machine). This wraps
    awslambdaric's post so that the next invocation's response reports it (``stats.prev_invocation``) and the
    client bills it (`schemas.lambda_events.billed_after_ms`). False where awslambdaric is not the runtime."""
    try:
        from awslambdaric import lambda_runtime_client as lrc
    except ImportError:
        return False
    post = getattr(lrc.LambdaRuntimeClient, "post_invocation_result", None)
    if post is None:
        return False
    if getattr(post, "dorylus_timed", False):
        return True

    @functools.wraps(post)
    def timed_post(self, invoke_id, *args, **kwargs):
        try:
            return post(self, invoke_id, *args, **kwargs)
        finally:
            if _PREV.get("request_id") == invoke_id and "returned" in _PREV:
                _PREV["after_s"] = time.perf_counter() - _PREV.pop("returned")

    timed_post.dorylus_timed = True
    lrc.LambdaRuntimeClient.post_invocation_result = timed_post
    return True


if os.environ.get("AWS_LAMBDA_RUNTIME_API"):  # set by Lambda (and the emulator) for the runtime process only
    _RESPONSE_POSTS_TIMED = _time_response_posts()


def _since_invoke(context: Any) -> float:
    """Seconds from the invocation's start (when Lambda starts billing) to the handler's entry: the runtime's
    delivery and decoding of the event. The deadline the runtime hands the context is that start plus the
    function's timeout; the timeout is known where the runtime's environment names it (the emulator's
    AWS_LAMBDA_FUNCTION_TIMEOUT), else this is 0."""
    timeout = os.environ.get("AWS_LAMBDA_FUNCTION_TIMEOUT")
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    if not timeout or remaining is None:
        return 0.0
    try:
        since = float(timeout) * 1000.0 - float(remaining())
    except (TypeError, ValueError):
        return 0.0
    return since / 1000.0 if 0.0 <= since < float(timeout) * 1000.0 else 0.0


def _handle(event: Any, context: Any, t0: float, cold: bool) -> dict:
    ev = parse_event(event)
    data = refs.fetch_ref(ev.input, "input")
    try:
        env = schemas.decode(data, expect=MessageType.TENSOR_BATCH)
    except SchemaError as e:
        raise HandlerError("InvalidInput", f"input: {e}") from None
    _need(ev.task is None or env.kind == ev.task, f"event names task {ev.task!r} but the input is a {env.kind!r} task")
    version, params, wbytes, cached = _load_weights(ev.weights)
    _need(version == env.version, f"weights are version {version}, the task needs version {env.version}",
          "InvalidWeights")
    model, s, arrays, meta = check_task(env, params)
    _check_out_grads(model, env.kind, s, params, arrays, meta)
    t1 = time.perf_counter()
    result, grads, scalars = tasks.run_tensor_task(model, env.kind, s, params, arrays, meta)
    result = {k: np.asarray(v) for k, v in result.items()}   # waits for the device: part of compute_s
    grads = P.flatten(grads)
    compute_s = time.perf_counter() - t1
    attempt = meta.get("attempt", 0)
    res_bytes, g_bytes = _encode_outputs(env, result, grads, scalars, attempt, ev.compression)
    task = {"kind": env.kind, "epoch": env.epoch, "stage": env.stage, "interval": env.interval,
            "partition": env.partition, "version": env.version, "attempt": attempt}
    stats = {"compute_s": compute_s, "bytes_in": len(data) + wbytes, "weights_cached": cached,
             "bytes_out": len(res_bytes) + (len(g_bytes) if g_bytes else 0), "cold_start": cold,
             "memory_mb": _memory_mb(context)}
    resp = ok_response(task, res_bytes, g_bytes, scalars, stats)
    t_enc = time.perf_counter()
    size = response_size(resp)
    # After the handler returns, the runtime serializes this response to JSON once more and posts it, which
    # Lambda bills too: as long as this serialization took (the response is the same but for a few numbers).
    resp["stats"]["encode_s"] = time.perf_counter() - t_enc
    if size > ev.inline_limit:
        _need(ev.output_s3 is not None, f"the output ({size} bytes as JSON) exceeds the inline limit of "
                                        f"{ev.inline_limit} bytes and the event names no output.s3 location",
              "OutputTooLarge")
        _outputs_to_s3(resp, ev.output_s3, res_bytes, g_bytes)
    return resp


def _encode_outputs(env, result: dict, grads: dict, scalars: dict, attempt, compression) -> tuple[bytes, bytes | None]:
    """The task's result (a tensor_batch) and flat parameter gradients (a gradients message, or None) as Arrow
    IPC."""
    routing = dict(kind=env.kind, run_id=env.run_id, epoch=env.epoch, stage=env.stage, interval=env.interval,
                   partition=env.partition)
    res_bytes = schemas.encode(schemas.tensor_batch(tensors=result, version=env.version,
                                                    meta={"attempt": attempt, **scalars}, **routing), compression)
    g_bytes = None
    if grads:
        g_bytes = schemas.encode(schemas.gradients(env.run_id, env.epoch, env.version, grads, kind=env.kind,
                                                   stage=env.stage, interval=env.interval,
                                                   partition=env.partition), compression)
    return res_bytes, g_bytes


def _outputs_to_s3(resp: dict, out_s3: Mapping, res_bytes: bytes, g_bytes: bytes | None) -> None:
    """Put the outputs under ``output.s3.prefix`` and answer with S3 references instead of inline data."""
    prefix = out_s3["prefix"]
    for name, b in (("result", res_bytes), ("grads", g_bytes)):
        if b is None:
            continue
        key = f"{prefix}{name}.arrow"
        refs.s3_put(out_s3["bucket"], key, b)
        resp[name] = {"s3": {"bucket": out_s3["bucket"], "key": key}, "bytes": len(b)}


def _memory_mb(context: Any) -> int | None:
    v = getattr(context, "memory_limit_in_mb", None)
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


_INIT_S = time.perf_counter() - _IMPORT_T0
