"""The Lambda handler (ops/lambda_handler.py): same outputs as the local pool on real Cora tasks, every task kind;
references (inline, S3, Kafka); validation and structured errors; import isolation; the tensor_batch schema."""
from __future__ import annotations

import ast
import base64
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import schemas
from ops import lambda_handler as LH
from ops import models, refs
from pipelines.engine.param_server import unflatten
from pipelines.engine.tensor_worker import execute
from schemas import lambda_events as LE
from tests.support.lambda_tasks import capture

REPO = Path(__file__).resolve().parents[1]
KINDS = {("gcn", "ga-first"): ("AV", "LAST", "AV_BWD"), ("gcn", "auto"): ("AV", "LOSS", "AV_BWD"),
         ("gat", "auto"): ("AV", "AE", "LOSS", "AE_BWD", "AV_BWD"),
         ("sage", "auto"): ("AV", "LOSS", "AV_BWD")}


def _event(msg, flat_weights, output=None, compression=None):
    task = LE.encode_task(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version, msg.arrays,
                          msg.meta, compression=compression)
    return LE.make_event(LE.inline(task), LE.inline(LE.encode_weights(msg.version, flat_weights)), output,
                         kind=msg.kind)


def _pick(msgs, n=4):
    """A spread of tasks: both partitions, several intervals and epochs, training rows present or not."""
    idx = np.linspace(0, len(msgs) - 1, min(n, len(msgs))).round().astype(int)
    return [msgs[i] for i in sorted(set(idx))]


@pytest.mark.parametrize("model,order", list(KINDS))
def test_handler_equals_local_pool(model, order):
    tasks, weights, _ = capture(model, order)
    assert set(KINDS[(model, order)]) <= set(tasks), sorted(tasks)
    seen = set()
    for kind in KINDS[(model, order)]:
        for msg in _pick(tasks[kind]):
            ref, ref_grads = execute(models.from_spec(msg.meta["model"]), msg, unflatten(weights[msg.version]))
            resp = LH.handler(_event(msg, weights[msg.version], compression="zstd"), None)
            assert resp["ok"], resp
            assert resp["task"] == {"kind": kind, "epoch": msg.epoch, "stage": msg.stage, "interval": msg.interval,
                                    "partition": msg.partition, "version": msg.version,
                                    "attempt": msg.meta.get("attempt", 0)}
            arrays, grads, scalars = LE.decode_result(resp)
            assert sorted(arrays) == sorted(ref.arrays)
            for k, v in ref.arrays.items():
                assert arrays[k].dtype == v.dtype and arrays[k].shape == v.shape
                np.testing.assert_allclose(arrays[k], v, rtol=0, atol=1e-6)
            assert sorted(grads) == sorted(ref_grads or {})
            for k, v in (ref_grads or {}).items():
                np.testing.assert_allclose(grads[k], v, rtol=0, atol=1e-6)
            for k in ("loss_sum", "count", "correct"):
                if k in ref.meta:
                    assert scalars[k] == pytest.approx(ref.meta[k], abs=1e-6)
            seen.add(kind)
    assert seen == set(KINDS[(model, order)])


@pytest.mark.parametrize("module", ["ops.lambda_handler", "ops.refs"])
def test_import_does_not_pull_pipelines_or_boto3(module):
    code = (f"import sys, {module}; bad = sorted(m for m in sys.modules if m == 'pipelines' or "
            "m.startswith('pipelines.') or m in ('boto3', 'botocore', 'kafka')); print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


NETWORK_MODULES = {"boto3", "botocore", "kafka", "socket", "urllib", "http", "requests", "ssl"}


def _imports(path: Path) -> tuple[set, set]:
    """Top-level package names a module imports at module level, and inside functions."""
    tree = ast.parse(path.read_text())
    top, inner = set(), set()
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or "."] if isinstance(node, ast.ImportFrom) and not node.level else [])
        for name in names:
            (top if node in tree.body else inner).add(name.split(".")[0])
    return top, inner


def test_handler_and_refs_import_only_what_the_lambda_image_has():
    """ops/lambda_handler.py imports only ops, schemas, numpy, jax, pyarrow (and the standard library, and lazily the
    runtime awslambdaric where it runs in one); ops/refs.py,
    the only ops module that touches the network, imports boto3/kafka lazily, inside the functions that need them;
    no other ops module imports a network client."""
    stdlib = set(sys.stdlib_module_names) - NETWORK_MODULES
    top, inner = _imports(REPO / "ops" / "lambda_handler.py")
    assert top - stdlib <= {"ops", "schemas", "numpy", "jax", "pyarrow", "__future__"}
    # awslambdaric (the runtime of a container-image Lambda) only inside the function that times its posts
    assert inner - stdlib <= {"ops", "schemas", "numpy", "jax", "pyarrow", "awslambdaric"}
    top, inner = _imports(REPO / "ops" / "refs.py")
    assert top - stdlib <= {"ops", "schemas", "__future__"} and inner - stdlib == {"boto3", "kafka"}
    others = [p for p in (REPO / "ops").glob("*.py") if p.name != "refs.py"]
    assert len(others) >= 5
    for p in others:
        top, inner = _imports(p)
        assert not (top | inner) & NETWORK_MODULES, p.name


# ----------------------------------------------------------------------------------------------- references
def test_s3_input_weights_and_output(aws_env):
    import boto3
    from moto import mock_aws

    tasks, weights, _ = capture("gcn", "ga-first")
    msg = tasks["AV"][0]
    ref, _ = execute(models.from_spec(msg.meta["model"]), msg, unflatten(weights[msg.version]))
    with mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="dorylus-b")
        task = LE.encode_task(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version, msg.arrays,
                              msg.meta)
        s3.put_object(Bucket="dorylus-b", Key="in/t.arrow", Body=task)
        s3.put_object(Bucket="dorylus-b", Key="w/v.arrow", Body=LE.encode_weights(msg.version, weights[msg.version]))
        ev = LE.make_event({"s3": {"bucket": "dorylus-b", "key": "in/t.arrow"}},
                           {"s3": {"bucket": "dorylus-b", "key": "w/v.arrow"}},
                           {"inline_limit": 1000, "s3": {"bucket": "dorylus-b", "prefix": "out/t/"}})
        r1 = LH.handler(ev)
        assert r1["ok"], r1
        assert r1["result"] == {"s3": {"bucket": "dorylus-b", "key": "out/t/result.arrow"},
                                "bytes": r1["result"]["bytes"]}
        assert not r1["stats"]["weights_cached"]
        arrays, _, _ = LE.decode_result(r1, fetch=refs.fetch_ref)
        np.testing.assert_allclose(arrays["h"], ref.arrays["h"], atol=1e-6)
        r2 = LH.handler(ev)  # a warm function keeps the weight version
        assert r2["ok"] and r2["stats"]["weights_cached"]
        missing = LH.handler(LE.make_event({"s3": {"bucket": "dorylus-b", "key": "nope"}}, ev["weights"]))
        assert missing["ok"] is False and missing["error"]["type"] == "StorageError"
        assert "s3://dorylus-b/nope" in missing["error"]["message"] and missing["error"]["retryable"] is False


def test_kafka_input(monkeypatch):
    """A Kafka reference is read at (topic, partition, offset) with kafka-python (a fake one here)."""
    tasks, weights, _ = capture("gcn", "ga-first")
    msg = tasks["AV"][0]
    task = LE.encode_task(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version, msg.arrays,
                          msg.meta)
    log = {("tensor", 0): [b"x", b"y", task]}
    calls = []

    class TopicPartition(tuple):
        def __new__(cls, topic, partition):
            return super().__new__(cls, (topic, partition))

    class KafkaConsumer:
        def __init__(self, **kw):
            calls.append(kw)
            self.pos = {}

        def assign(self, tps):
            self.tps = tps

        def seek(self, tp, off):
            self.pos[tp] = off

        def poll(self, timeout_ms, max_records):
            out = {}
            for tp in self.tps:
                recs = log.get(tuple(tp), [])
                off = self.pos[tp]
                if off < len(recs):
                    out[tp] = [types.SimpleNamespace(offset=off, value=recs[off])]
            return out

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "kafka", types.SimpleNamespace(KafkaConsumer=KafkaConsumer,
                                                                     TopicPartition=TopicPartition))
    wref = LE.inline(LE.encode_weights(msg.version, weights[msg.version]))
    ok = LH.handler(LE.make_event({"kafka": {"bootstrap": "h:9092", "topic": "tensor", "partition": 0, "offset": 2}},
                                  wref))
    assert ok["ok"], ok
    assert calls[0]["bootstrap_servers"] == "h:9092"
    bad = LH.handler(LE.make_event({"kafka": {"bootstrap": "h:9092", "topic": "tensor", "partition": 0,
                                              "offset": 0}}, wref))
    assert bad["error"]["type"] == "InvalidInput" and "not an Arrow IPC stream" in bad["error"]["message"]


# ----------------------------------------------------------------------------------------------- bad input
def _good():
    tasks, weights, _ = capture("gcn", "ga-first")
    return tasks, weights, tasks["AV"][0]


def _err(resp):
    assert resp["ok"] is False, resp
    assert set(resp["error"]) == {"type", "message", "retryable"}
    return resp["error"]["type"], resp["error"]["message"]


def _with_arrays(msg, weights, **changes):
    arrays = {**msg.arrays, **changes}
    arrays = {k: v for k, v in arrays.items() if v is not None}
    return _event(msg.replace(arrays=arrays), weights[msg.version])


def test_malformed_events():
    tasks, weights, msg = _good()
    ev = _event(msg, weights[msg.version])
    cases = [
        (None, "InvalidEvent", "JSON object"),
        ("{not json", "InvalidEvent", "not JSON"),
        ({}, "InvalidEvent", "event_version"),
        ({**ev, "event_version": 99}, "UnsupportedVersion", "99"),
        ({k: v for k, v in ev.items() if k != "input"}, "InvalidEvent", "'input'"),
        ({**ev, "surprise": 1}, "InvalidEvent", "surprise"),
        ({**ev, "input": {"inline": "@@@"}}, "InvalidEvent", "base64"),
        ({**ev, "input": {"inline": "a", "s3": {}}}, "InvalidEvent", "exactly one"),
        ({**ev, "input": {"s3": {"bucket": "b"}}}, "InvalidEvent", "key"),
        ({**ev, "input": {"kafka": {"topic": "t"}}}, "InvalidEvent", "bootstrap"),
        ({**ev, "input": LE.inline(b"not arrow")}, "InvalidInput", "Arrow"),
        ({**ev, "input": ev["weights"]}, "InvalidInput", "expected a tensor_batch"),
        ({**ev, "task": "GA"}, "InvalidTask", "unknown task"),
        ({**ev, "task": "AE"}, "InvalidTask", "names task 'AE'"),
        ({**ev, "output": {"inline_limit": -1}}, "InvalidEvent", "inline_limit"),
        ({**ev, "output": {"compression": "rar"}}, "InvalidEvent", "compression"),
        ({**ev, "output": {"inline_limit": 100}}, "OutputTooLarge", "no output.s3"),
        ({**ev, "input": {"inline": "A" * (LE.INVOKE_LIMIT_BYTES * 2 + 4)}}, "PayloadTooLarge", "more than"),
    ]
    for event, typ, text in cases:
        t, m = _err(LH.handler(event, None))
        assert t == typ and text in m, (event if not isinstance(event, dict) else sorted(event), t, m)


def test_invalid_tasks_and_weights():
    tasks, weights, msg = _good()
    w = weights[msg.version]
    R = msg.arrays["row_gids"].shape[0]
    cases = [
        (_with_arrays(msg, weights, h=msg.arrays["h"][:, :5]), "InvalidTask", "takes"),
        (_with_arrays(msg, weights, h=msg.arrays["h"].astype(np.float64)), "InvalidTask", "float32"),
        (_with_arrays(msg, weights, h=None), "InvalidTask", "missing array 'h'"),
        (_with_arrays(msg, weights, row_gids=msg.arrays["row_gids"].astype(np.float32)), "InvalidTask", "int32"),
        (_with_arrays(msg, weights, h=msg.arrays["h"][: R - 1]), "InvalidTask", "rows"),
        (_with_arrays(msg, weights, junk=np.zeros(3, np.float32)), "InvalidTask", "unexpected arrays"),
        (_event(msg.replace(stage=7), w), "InvalidTask", "does not exist"),
        (_event(msg.replace(stage=0), w), "InvalidTask", "which is GA"),
        (_event(msg.replace(meta={**msg.meta, "model": {"name": "mlp"}}), w), "InvalidTask", "model spec"),
        (_event(msg.replace(meta={**msg.meta, "seed": -3}), w), "InvalidTask", "seed"),
        ({**_event(msg.replace(version=msg.version + 5), w),
          "weights": LE.inline(LE.encode_weights(msg.version, w))}, "InvalidWeights", "the task needs version"),
        (_event(msg, {k: v for k, v in w.items() if not k.endswith("/w")}), "InvalidWeights", "lack"),
        (_event(msg, {k: (v[:3] if k.endswith("/w") else v) for k, v in w.items()}), "InvalidWeights", "shape"),
        (_event(msg, {"noslash": next(iter(w.values()))}), "InvalidWeights", "stage/param"),
    ]
    last = tasks["LAST"][0]
    cases.append((_with_arrays(last, weights, labels=np.full(R, 99, np.int32)), "InvalidTask", "labels"))
    cases.append((_event(last.replace(meta={**last.meta, "scale": "x"}), weights[last.version]), "InvalidTask",
                  "scale"))
    bwd = tasks["AV_BWD"][0]
    g = bwd.arrays["g_h"]
    cases.append((_with_arrays(bwd, weights, g_h=g[:, :3]), "InvalidTask", "the output 'h' has"))
    cases.append((_event(bwd.replace(meta={**bwd.meta, "wrt": ["zz"]}), weights[bwd.version]), "InvalidTask", "wrt"))
    gat_tasks, gat_w, _ = capture("gat", "auto")
    ae = gat_tasks["AE"][0]
    bad_ptr = ae.arrays["indptr"].copy()
    bad_ptr[-1] += 1
    cases.append((_with_arrays(ae, gat_w, indptr=bad_ptr), "InvalidTask", "indptr"))
    bad_idx = ae.arrays["indices"].copy()
    bad_idx[0] = 10 ** 6
    cases.append((_with_arrays(ae, gat_w, indices=bad_idx), "InvalidTask", "out of range"))
    for k, (event, typ, text) in enumerate(cases):
        resp = LH.handler(event)
        assert resp["ok"] is False, (k, typ, text)
        t, m = _err(resp)
        assert t == typ and text in m, (k, typ, text, t, m)


def test_kafka_and_s3_without_clients(monkeypatch):
    """Without kafka-python or boto3 installed, a reference that needs them is a clear error."""
    tasks, weights, msg = _good()
    wref = LE.inline(LE.encode_weights(msg.version, weights[msg.version]))
    monkeypatch.setitem(sys.modules, "kafka", None)
    monkeypatch.setitem(sys.modules, "boto3", None)
    refs.reset_clients()
    t, m = _err(LH.handler(LE.make_event({"kafka": {"bootstrap": "h:1", "topic": "t", "partition": 0, "offset": 0}},
                                         wref)))
    assert t == "DependencyMissing" and "kafka-python" in m
    t, m = _err(LH.handler(LE.make_event({"s3": {"bucket": "b", "key": "k"}}, wref)))
    assert t == "DependencyMissing" and "boto3" in m


# ----------------------------------------------------------------------------------------------- schema
def test_tensor_batch_roundtrip_and_errors():
    import pyarrow as pa

    t = {"h": np.random.default_rng(0).random((3, 4), dtype=np.float32), "ids": np.arange(3, dtype=np.int32),
         "m": np.array([True, False, True]), "s": np.float32(2.5), "e": np.zeros((0, 2), np.float32),
         "d": np.ones((2, 1, 3)), "u": np.arange(4, dtype=np.uint32)}
    for comp in (None, "lz4", "zstd"):
        env = schemas.decode(schemas.encode(schemas.tensor_batch("AV", "r", 1, 2, 3, 0, t, version=4,
                                                                 meta={"a": 1}), comp))
        assert env.type is schemas.MessageType.TENSOR_BATCH and env.version == 4 and env.stage == 2
        for k, v in t.items():
            assert env.tensors[k].dtype == np.asarray(v).dtype and env.tensors[k].shape == np.shape(v)
            np.testing.assert_array_equal(env.tensors[k], v)
    # readable with pyarrow alone
    table = pa.ipc.open_stream(schemas.encode(schemas.tensor_batch("AV", "r", 0, 0, 0, 0, t))).read_all()
    assert json.loads(table.schema.field("h").metadata[b"dorylus.shape"]) == [3, 4]
    assert schemas.decode(schemas.encode(schemas.tensor_batch("AV", "r", 0, 0, 0, 0, {}))).tensors == {}
    with pytest.raises(schemas.SchemaError, match="dtype"):
        schemas.encode(schemas.tensor_batch("AV", "r", 0, 0, 0, 0, {"o": np.array(["x"])}))
    with pytest.raises(schemas.SchemaError, match="complex|dtype"):
        schemas.encode(schemas.tensor_batch("AV", "r", 0, 0, 0, 0, {"c": np.zeros(2, np.complex64)}))
    # a lying shape
    b = schemas.to_record_batch(schemas.tensor_batch("AV", "r", 0, 0, 0, 0, {"h": np.zeros((2, 2), np.float32)}))
    f = b.schema.field("h").with_metadata({"dorylus.shape": "[3, 2]"})
    bad = pa.RecordBatch.from_arrays(b.columns, schema=pa.schema([f], metadata=b.schema.metadata))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, bad.schema) as w:
        w.write_batch(bad)
    with pytest.raises(schemas.SchemaError, match="needs 6 values"):
        schemas.decode(sink.getvalue().to_pybytes())
    assert base64  # (imported for readers of this file: events carry base64 Arrow IPC)
