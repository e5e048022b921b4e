"""schemas/: Arrow message and file schemas, encode/decode, validation."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import schemas
from schemas import (
    Control,
    Envelope,
    MessageType,
    SchemaError,
    TaskKind,
    Watermark,
    decode,
    decode_control,
    decode_message,
    decode_watermarks,
    edge_block,
    encode,
    gradients,
    peek_header,
    vertex_block,
    weights,
)
from schemas import files

COMPRESSIONS = [None, "lz4", "zstd"]
RNG = np.random.default_rng(0)


def _vb(n=6, **kw):
    args = dict(kind="AV", run_id="run-1", epoch=3, stage=1, interval=7, partition=2,
                vertex=np.arange(100, 100 + n), version=5, meta={"attempt": 2, "note": "x"},
                tensors={"h": RNG.standard_normal((n, 4)).astype(np.float32),
                         "ah": RNG.standard_normal((n, 3)).astype(np.float32),
                         "att": RNG.standard_normal((n, 2, 3)).astype(np.float32)})
    args.update(kw)
    return vertex_block(**args)


def _routing_md(**over):
    md = {"dorylus.schema_version": "2", "dorylus.type": "vertex_block", "dorylus.run_id": "r",
          "dorylus.kind": "GA", "dorylus.epoch": "0", "dorylus.stage": "0", "dorylus.interval": "0",
          "dorylus.partition": "0", "dorylus.version": "-1", "dorylus.meta": "{}"}
    for k, v in over.items():
        key = f"dorylus.{k}"
        if v is None:
            md.pop(key, None)
        else:
            md[key] = v
    return md


def _raw(arrays, names, md, batches=1, fields=None):
    """Hand-written IPC stream (how a foreign or broken producer would write)."""
    schema = pa.schema(fields) if fields is not None else pa.schema(
        [pa.field(n, a.type) for n, a in zip(names, arrays)])
    schema = schema.with_metadata(md) if md is not None else schema
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        for _ in range(batches):
            w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _fsl(x, dtype=pa.float32()):
    x = np.asarray(x)
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), type=dtype), x.shape[1])


# ---------------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_vertex_block_round_trip(compression):
    env = _vb()
    data = encode(env, compression=compression)
    assert isinstance(data, bytes)
    out = decode(data)
    assert out.type is MessageType.VERTEX_BLOCK
    for f in ("kind", "run_id", "epoch", "stage", "interval", "partition", "version"):
        assert getattr(out, f) == getattr(env, f)
    assert out.meta == {"attempt": 2, "note": "x"}
    np.testing.assert_array_equal(out.vertex, env.vertex)
    assert out.vertex.dtype == np.int64
    assert set(out.tensors) == {"h", "ah", "att"}
    for k, x in env.tensors.items():
        assert out.tensors[k].dtype == np.float32
        np.testing.assert_array_equal(out.tensors[k], x)
    assert out.tensors["att"].shape == (6, 2, 3)
    assert out.num_rows == 6
    assert out.src is None and out.dst is None


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_edge_block_round_trip(compression):
    src, dst = np.array([0, 1, 2, 2]), np.array([1, 2, 0, 3], dtype=np.int32)
    logits = RNG.standard_normal((4, 8)).astype(np.float32)
    env = edge_block(TaskKind.AE, "run-1", 0, 0, 1, 0, src, dst, {"logits": logits}, version=2)
    out = decode(encode(env, compression), expect="edge_block")
    assert out.type is MessageType.EDGE_BLOCK and out.kind == "AE"
    np.testing.assert_array_equal(out.src, src)
    np.testing.assert_array_equal(out.dst, dst)
    assert out.dst.dtype == np.int64
    np.testing.assert_array_equal(out.tensors["logits"], logits)
    assert out.num_rows == 4


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_gradients_and_weights_round_trip(compression):
    params = {"W0": RNG.standard_normal((5, 3)).astype(np.float32), "b0": np.arange(3, dtype=np.float32),
              "scale": np.float32(0.5), "empty": np.zeros((0, 4), np.float32),
              "W1": RNG.standard_normal((3, 2)).astype(np.float64)}  # float64 is converted to float32
    g = decode(encode(gradients("run-1", 4, 11, params, interval=3, partition=1), compression))
    assert g.type is MessageType.GRADIENTS and g.version == 11 and g.epoch == 4 and g.kind == "AV_BWD"
    assert g.interval == 3 and g.partition == 1
    assert list(g.tensors) == list(params)
    for k, x in params.items():
        assert g.tensors[k].shape == np.shape(x) and g.tensors[k].dtype == np.float32
        np.testing.assert_allclose(g.tensors[k], np.asarray(x, np.float32))
    w = decode(encode(weights("run-1", 12, params), compression), expect=MessageType.WEIGHTS)
    assert w.type is MessageType.WEIGHTS and w.version == 12 and w.kind == "WU"
    np.testing.assert_array_equal(w.tensors["W0"], params["W0"])


def test_watermarks_and_control_round_trip():
    marks = [Watermark("run-1", "gs0", 0, 3, 1, "ghosts"), Watermark("run-1", "gs1", 1, 2, 0, "ghosts")]
    data = encode(marks, compression="lz4")
    assert decode_watermarks(data) == marks
    assert decode_message(data) == marks
    assert decode_watermarks(encode(marks[0])) == [marks[0]]
    assert peek_header(data).type is MessageType.WATERMARK
    c = Control("run-1", "checkpoint", {"epoch": 4, "path": "/tmp/x", "nested": {"a": [1, 2]}})
    assert decode_control(encode(c)) == c
    assert decode_message(encode(c)) == c


def test_empty_block_round_trip():
    env = vertex_block("GA", "r", 0, 0, 0, 0, np.zeros(0, np.int64), {"h": np.zeros((0, 16), np.float32)})
    out = decode(encode(env))
    assert out.vertex.shape == (0,) and out.tensors["h"].shape == (0, 16)
    topo = decode(encode(edge_block("AE", "r", 0, 0, 0, 0, [0, 1], [1, 0])))
    assert topo.tensors == {} and list(topo.src) == [0, 1]


def test_peek_header_reads_routing_only():
    h = peek_header(encode(_vb()))
    assert (h.type, h.kind, h.run_id, h.epoch, h.stage, h.interval, h.partition, h.version) == \
        (MessageType.VERTEX_BLOCK, "AV", "run-1", 3, 1, 7, 2, 5)
    assert h.meta == {"attempt": 2, "note": "x"} and h.schema_version == schemas.MESSAGE_SCHEMA_VERSION
    assert _vb().header.interval == 7


# ------------------------------------------------------------------------------------------------------ zero copy
def test_decode_is_zero_copy_uncompressed():
    env = _vb(n=1000)
    data = encode(env)
    raw = np.frombuffer(data, dtype=np.uint8)
    out = decode(data)
    for name, arr in [("vertex", out.vertex), *out.tensors.items()]:
        assert np.shares_memory(arr, raw), name
        assert not arr.flags.writeable  # a view into the message: read-only
    g = decode(data := encode(gradients("r", 0, 0, {"W": np.ones((64, 64), np.float32)})))
    assert np.shares_memory(g.tensors["W"], np.frombuffer(data, np.uint8))


def test_decode_compressed_views_arrow_buffers():
    out = decode(encode(_vb(n=1000), compression="zstd"))
    h = out.tensors["h"]
    assert h.base is not None and not h.flags.owndata  # a view of the decompressed Arrow buffer, not a copy


def test_encode_is_zero_copy_into_arrow():
    x = np.ones((10, 4), np.float32)
    batch = schemas.to_record_batch(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(10), {"h": x}))
    assert batch.column("h").values.buffers()[1].address == x.ctypes.data


# ----------------------------------------------------------------------------------- readable by pyarrow alone
def test_pyarrow_only_reader():
    env = _vb(n=10)
    data = encode(env, compression="zstd")
    # what a consumer outside the project does: pyarrow.ipc and the schema metadata, nothing else
    table = pa.ipc.open_stream(data).read_all()
    md = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert md["dorylus.schema_version"] == "2" and md["dorylus.type"] == "vertex_block"
    assert (md["dorylus.run_id"], md["dorylus.kind"], int(md["dorylus.epoch"]), int(md["dorylus.interval"])) == \
        ("run-1", "AV", 3, 7)
    assert json.loads(md["dorylus.meta"]) == {"attempt": 2, "note": "x"}
    assert table.column("vertex").to_pylist() == list(range(100, 110))
    h = table.column("h").combine_chunks()
    assert h.type.list_size == 4
    np.testing.assert_array_equal(h.flatten().to_numpy().reshape(10, 4), env.tensors["h"])
    att = table.column("att").combine_chunks()
    row_shape = json.loads(table.schema.field("att").metadata[b"dorylus.row_shape"])
    np.testing.assert_array_equal(att.flatten().to_numpy().reshape(10, *row_shape), env.tensors["att"])
    # parameters: name / shape / data rows
    t = pa.ipc.open_stream(encode(gradients("r", 0, 3, {"W": np.eye(3, dtype=np.float32)}))).read_all()
    row = t.to_pylist()[0]
    assert row["name"] == "W" and row["shape"] == [3, 3] and row["data"] == np.eye(3).ravel().tolist()


def test_foreign_writer_message_decodes():
    """A message written with plain pyarrow (nullable fields, no row_shape metadata) is accepted."""
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    data = _raw([pa.array([7, 8, 9], pa.int64()), _fsl(x)], ["vertex", "h"], _routing_md(meta=None))
    out = decode(data)
    np.testing.assert_array_equal(out.tensors["h"], x)
    assert out.meta == {}


# ----------------------------------------------------------------------------------------------- large messages
@pytest.mark.parametrize("compression", [None, "lz4"])
def test_large_message_round_trip(compression):
    n, d = 50 * 1024 * 1024 // (4 * 256), 256  # 50 MiB of float32
    h = RNG.standard_normal((n, d), dtype=np.float32)
    env = vertex_block("GA", "big", 0, 0, 0, 0, np.arange(n), {"ah": h})
    data = encode(env, compression=compression)
    assert len(data) > 45 * 1024 * 1024
    out = decode(data)
    assert out.tensors["ah"].shape == (n, d)
    np.testing.assert_array_equal(out.tensors["ah"], h)


# ------------------------------------------------------------------------------------------ decode validation
def _vertex_arrays(n=2, d=3):
    return [pa.array(np.arange(n), pa.int64()), _fsl(np.zeros((n, d), np.float32))], ["vertex", "h"]


def _assert_error(data, *needles, fn=decode):
    with pytest.raises(SchemaError) as ei:
        fn(data)
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_error_not_arrow():
    _assert_error(b"definitely not arrow", "not an Arrow IPC stream")
    _assert_error(encode(_vb())[:50], "")  # truncated


def test_error_missing_schema_version():
    arrays, names = _vertex_arrays()
    _assert_error(_raw(arrays, names, None), "schema version")
    _assert_error(_raw(arrays, names, _routing_md(schema_version=None)), "missing schema version")


def test_error_unknown_schema_version():
    arrays, names = _vertex_arrays()
    _assert_error(_raw(arrays, names, _routing_md(schema_version="99")), "unsupported schema version 99")
    _assert_error(_raw(arrays, names, _routing_md(schema_version="one")), "not an integer")


def test_error_message_type():
    arrays, names = _vertex_arrays()
    _assert_error(_raw(arrays, names, _routing_md(type=None)), "missing message type")
    _assert_error(_raw(arrays, names, _routing_md(type="tensor_soup")), "unknown message type 'tensor_soup'")
    _assert_error(encode(_vb()), "expected a edge_block message, got vertex_block",
                  fn=lambda d: decode(d, expect="edge_block"))
    _assert_error(encode(Control("r", "stop")), "not an Envelope")
    _assert_error(encode(_vb()), "expected a watermark message", fn=decode_watermarks)
    _assert_error(encode(_vb()), "expected a control message", fn=decode_control)


@pytest.mark.parametrize("field", ["run_id", "kind", "epoch", "stage", "interval", "partition", "version"])
def test_error_missing_routing_field(field):
    arrays, names = _vertex_arrays()
    _assert_error(_raw(arrays, names, _routing_md(**{field: None})), f"missing routing field {field}")


def test_error_bad_routing_values():
    arrays, names = _vertex_arrays()
    _assert_error(_raw(arrays, names, _routing_md(epoch="3.5")), "routing field epoch", "not an integer")
    _assert_error(_raw(arrays, names, _routing_md(meta="{nope")), "dorylus.meta", "JSON")
    _assert_error(_raw(arrays, names, _routing_md(meta="[1]")), "JSON object")
    _assert_error(_raw(arrays, names, _routing_md(run_id="")), "run_id is empty")


def test_error_missing_id_columns():
    x = _fsl(np.zeros((2, 3), np.float32))
    _assert_error(_raw([x], ["h"], _routing_md()), "missing the id column 'vertex'")
    _assert_error(_raw([pa.array([0, 1], pa.int64()), x], ["src", "h"], _routing_md(type="edge_block")),
                  "missing the id column 'dst'")


def test_error_wrong_dtypes():
    x = _fsl(np.zeros((2, 3), np.float32))
    _assert_error(_raw([pa.array([0, 1], pa.int32()), x], ["vertex", "h"], _routing_md()),
                  "id column 'vertex' has type int32, expected int64")
    _assert_error(_raw([pa.array([0, 1], pa.int64()), _fsl(np.zeros((2, 3)), pa.float64())], ["vertex", "h"],
                       _routing_md()), "tensor column 'h' has element type double, expected float32")
    lst = pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32()))
    _assert_error(_raw([pa.array([0, 1], pa.int64()), lst], ["vertex", "h"], _routing_md()),
                  "tensor column 'h' has type list<item: float>, expected fixed_size_list<float32>")
    _assert_error(_raw([pa.array([0, 1], pa.int64()), pa.array([1.0, 2.0], pa.float32())], ["vertex", "h"],
                       _routing_md()), "tensor column 'h' has type float")


def test_error_wrong_dims():
    # declared row shape [2, 4] = 8 values, but the column is 6 wide
    arrays, names = _vertex_arrays(n=2, d=6)
    fields = [pa.field("vertex", pa.int64()), pa.field("h", arrays[1].type, metadata={"dorylus.row_shape": "[2, 4]"})]
    _assert_error(_raw(arrays, names, _routing_md(), fields=fields),
                  "declared row shape [2, 4] has 8 values but the column width is 6")
    fields[1] = pa.field("h", arrays[1].type, metadata={"dorylus.row_shape": "[0, 6]"})
    _assert_error(_raw(arrays, names, _routing_md(), fields=fields), "positive ints")
    # parameters: declared shape vs data length
    md = _routing_md(type="gradients")
    bad = [pa.array(["W"]), pa.array([[2, 3]], pa.list_(pa.int64())), pa.array([[1.0] * 5], pa.list_(pa.float32()))]
    _assert_error(_raw(bad, ["name", "shape", "data"], md), "parameter 'W': declared shape [2, 3] needs 6 values, "
                                                             "data has 5")
    neg = [bad[0], pa.array([[-1, 5]], pa.list_(pa.int64())), bad[2]]
    _assert_error(_raw(neg, ["name", "shape", "data"], md), "invalid shape [-1, 5]")


def test_error_params_columns():
    md = _routing_md(type="weights")
    name, shape = pa.array(["W", "W"]), pa.array([[1], [1]], pa.list_(pa.int64()))
    data = pa.array([[1.0], [2.0]], pa.list_(pa.float32()))
    _assert_error(_raw([name, shape], ["name", "shape"], md), "weights message is missing column 'data'")
    _assert_error(_raw([name, shape, data, data], ["name", "shape", "data", "extra"], md),
                  "unexpected columns ['extra']")
    _assert_error(_raw([name, shape, pa.array([[1.0], [2.0]], pa.list_(pa.float64()))], ["name", "shape", "data"],
                       md), "column 'data' has type list<item: double>")
    _assert_error(_raw([name, shape, data], ["name", "shape", "data"], md), "repeats parameter names")


def test_error_nulls():
    x = _fsl(np.zeros((2, 3), np.float32))
    _assert_error(_raw([pa.array([0, None], pa.int64()), x], ["vertex", "h"], _routing_md()),
                  "column 'vertex' has 1 nulls")


def test_error_batch_count():
    arrays, names = _vertex_arrays()
    _assert_error(_raw(arrays, names, _routing_md(), batches=2), "more than one record batch")
    _assert_error(_raw(arrays, names, _routing_md(), batches=0), "no record batch")


def test_error_watermark_and_control_columns():
    md = _routing_md(type="watermark")
    _assert_error(_raw([pa.array(["gs0"])], ["producer"], md), "watermark message is missing column 'partition'",
                  fn=decode_watermarks)
    md = _routing_md(type="control")
    _assert_error(_raw([pa.array(["stop"]), pa.array(["[1, 2]"])], ["command", "args"], md),
                  "control args must be a JSON object", fn=decode_control)
    _assert_error(_raw([pa.array(["stop", "go"]), pa.array(["{}", "{}"])], ["command", "args"], md),
                  "exactly one row", fn=decode_control)


# ------------------------------------------------------------------------------------------ encode validation
def test_encode_validation():
    n = 4
    with pytest.raises(SchemaError, match="has 3 rows but the block has 4 vertices"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n), {"h": np.zeros((3, 2), np.float32)}))
    with pytest.raises(SchemaError, match=r"must have shape \(vertices, d, ...\)"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n), {"h": np.zeros(4, np.float32)}))
    with pytest.raises(SchemaError, match="must be float32, got dtype int64"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n), {"h": np.zeros((4, 2), np.int64)}))
    with pytest.raises(SchemaError, match="ids must be int64, got dtype float64"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n, dtype=float), {}))
    with pytest.raises(SchemaError, match="collides with the id column"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n), {"vertex": np.zeros((4, 2), np.float32)}))
    with pytest.raises(SchemaError, match="not a valid name"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n), {"": np.zeros((4, 2), np.float32)}))
    with pytest.raises(SchemaError, match="empty row shape"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n), {"h": np.zeros((4, 0), np.float32)}))
    with pytest.raises(SchemaError, match="routing field epoch must be an integer"):
        encode(vertex_block("AV", "r", 1.5, 0, 0, 0, np.arange(n), {}))
    with pytest.raises(SchemaError, match="run_id must be a non-empty string"):
        encode(vertex_block("AV", "", 0, 0, 0, 0, np.arange(n), {}))
    with pytest.raises(SchemaError, match="meta is not a JSON object"):
        encode(vertex_block("AV", "r", 0, 0, 0, 0, np.arange(n), {}, meta={"x": object()}))
    with pytest.raises(SchemaError, match="4 sources but 3 destinations"):
        encode(edge_block("AE", "r", 0, 0, 0, 0, np.arange(4), np.arange(3)))
    with pytest.raises(SchemaError, match="unknown compression"):
        encode(_vb(), compression="gzip")
    with pytest.raises(SchemaError, match="share a run_id"):
        encode([Watermark("a", "p", 0, 0, 0, "c"), Watermark("b", "p", 0, 0, 0, "c")])
    with pytest.raises(SchemaError, match="cannot encode"):
        encode({"h": 1})
    with pytest.raises(SchemaError, match="unknown message type"):
        encode(Envelope("AV", "r", 0, 0, 0, 0, -1, {}, type="blob"))
    assert issubclass(SchemaError, ValueError)


# -------------------------------------------------------------------------------------------------------- files
def _metrics_row(**over):
    row = {"epoch": 0, "loss": 1.9, "train_acc": 0.3, "val_acc": 0.25, "test_acc": None, "epoch_s": 0.12,
           "lr": 0.01, "custom": "ok"}
    row.update(over)
    return row


def test_metrics_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(files.metrics_line(_metrics_row(epoch=e, loss=2.0 - e)) for e in range(3)) + "\n")
    rows = files.read_metrics_jsonl(path)
    assert [r["epoch"] for r in rows] == [0, 1, 2] and rows[0]["custom"] == "ok"
    t = files.metrics_table(rows)
    assert t.schema.names[:6] == ["epoch", "loss", "train_acc", "val_acc", "test_acc", "epoch_s"]
    assert t.column("epoch").type == pa.int64() and t.column("test_acc").null_count == 3
    assert "lr" in t.schema.names
    files.validate_metrics_row(_metrics_row(loss=float("nan")))  # a diverged run still logs its epochs
    for over, needle in [({"epoch": None}, "'epoch' must be int"), ({"loss": "1.0"}, "'loss' must be"),
                         ({"val_acc": 1.5}, "must lie in [0, 1]"), ({"epoch": -1}, "must be >= 0"),
                         ({"epoch_s": float("inf")}, "epoch_s"), ({"lr": "high"}, "'lr' must be"),
                         ({"extra": [1, 2]}, "JSON scalar"), ({"epoch": True}, "'epoch' must be int")]:
        with pytest.raises(SchemaError) as ei:
            files.validate_metrics_row(_metrics_row(**over))
        assert needle in str(ei.value)
    row = _metrics_row()
    del row["epoch_s"]
    with pytest.raises(SchemaError, match=r"missing \['epoch_s'\]"):
        files.validate_metrics_row(row)
    path.write_text(files.metrics_line(_metrics_row()) + '{"epoch": 1}\n')
    with pytest.raises(SchemaError, match="metrics.jsonl:2: metrics row is missing"):
        files.read_metrics_jsonl(path)


def test_predictions_parquet(tmp_path):
    n, d = 50, 8
    emb = RNG.standard_normal((n, d)).astype(np.float32)
    t = files.predictions_table(np.arange(n), RNG.integers(0, 7, n), emb)
    files.validate_predictions(t, embedding_dim=d)
    pq.write_table(t, tmp_path / "pred.parquet")
    back = pq.read_table(tmp_path / "pred.parquet")
    files.validate_predictions(back, embedding_dim=d)
    assert back.schema.field("embedding").type == pa.list_(pa.field("item", pa.float32(), nullable=False), d)
    np.testing.assert_array_equal(back.column("embedding").combine_chunks().flatten().to_numpy().reshape(n, d), emb)
    # prediction-only file
    files.validate_predictions(files.predictions_table([0, 1], [1, 0]))
    with pytest.raises(SchemaError, match="embedding width is 8, expected 4"):
        files.validate_predictions(t, embedding_dim=4)
    with pytest.raises(SchemaError, match="column 'prediction' has type int64, expected int32"):
        files.validate_predictions(pa.table({"vertex": pa.array([0], pa.int64()), "prediction": pa.array([1])}))
    with pytest.raises(SchemaError, match="missing column 'embedding'"):
        files.validate_predictions(files.predictions_table([0], [1]), embedding_dim=4)
    with pytest.raises(SchemaError, match="unsupported schema version 7"):
        files.validate_predictions(t.replace_schema_metadata({"dorylus.schema_version": "7"}))
    # a list<float> embedding from another writer is normalized to fixed_size_list
    loose = pa.table({"vertex": pa.array([0, 1], pa.int64()), "prediction": pa.array([0, 1], pa.int32()),
                      "embedding": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32()))})
    with pytest.raises(SchemaError, match="expected fixed_size_list"):
        files.validate_predictions(loose)
    files.validate_predictions(files.normalize_table(loose, ["embedding"]), embedding_dim=2)
    ragged = loose.set_column(2, "embedding", pa.array([[1.0], [3.0, 4.0]], pa.list_(pa.float32())))
    with pytest.raises(SchemaError, match="different lengths"):
        files.normalize_table(ragged, ["embedding"])


def test_graph_shards_parquet(tmp_path):
    e = files.edge_shard_table([0, 1, 2], [1, 2, 0], [1.0, 0.5, 0.25])
    files.validate_edge_shard(e)
    pq.write_table(e, tmp_path / "edges-0.parquet")
    files.validate_edge_shard(pq.read_table(tmp_path / "edges-0.parquet"))
    assert files.edge_shard_table([0], [1]).column("weight").to_pylist() == [1.0]
    feats = RNG.standard_normal((3, 5)).astype(np.float32)
    v = files.vertex_shard_table([0, 1, 2], 0, [1, 2, 1], feats, [3, -1, 0],
                                 [files.SPLIT_CODES["train"], files.SPLIT_CODES["none"], files.SPLIT_CODES["test"]])
    pq.write_table(v, tmp_path / "vertices-0.parquet")
    back = files.validate_vertex_shard(pq.read_table(tmp_path / "vertices-0.parquet"), feature_dim=5)
    assert back.column("partition").to_pylist() == [0, 0, 0]
    assert back.schema.metadata[b"dorylus.schema_version"] == b"1"
    with pytest.raises(SchemaError, match="feature width is 5, expected 6"):
        files.validate_vertex_shard(v, feature_dim=6)
    with pytest.raises(SchemaError, match="column 'split' has values in"):
        files.vertex_shard_table([0], 0, [1], feats[:1], [0], [5])
    with pytest.raises(SchemaError, match="column 'label' has values in"):
        files.vertex_shard_table([0], 0, [1], feats[:1], [-2], [0])
    with pytest.raises(SchemaError, match="edge shard is missing column 'weight'"):
        files.validate_edge_shard(pa.table({"src": pa.array([0], pa.int64()), "dst": pa.array([1], pa.int64())}))
    with pytest.raises(SchemaError, match="column 'src' has type int32"):
        files.validate_edge_shard(pa.table({"src": pa.array([0], pa.int32()), "dst": pa.array([1], pa.int64()),
                                            "weight": pa.array([1.0], pa.float32())}))
    with pytest.raises(SchemaError, match="negative vertex ids"):
        files.validate_edge_shard(
            pa.table({"src": pa.array([-1], pa.int64()), "dst": pa.array([1], pa.int64()),
                      "weight": pa.array([1.0], pa.float32())}))
    with pytest.raises(SchemaError, match="features must have shape"):
        files.vertex_shard_table([0, 1], 0, [1, 1], feats, [0, 0], [0, 0])


def _manifest():
    return {"schema_version": 1, "name": "cora", "num_vertices": 10, "num_edges": 30, "num_partitions": 2,
            "feature_dim": 4, "num_classes": 3, "normalization": "sym",
            "partitions": [{"partition": 0, "vertices": "vertices-0.parquet", "edges": "edges-0.parquet",
                            "num_vertices": 6, "num_edges": 20},
                           {"partition": 1, "vertices": "vertices-1.parquet", "edges": "edges-1.parquet",
                            "num_vertices": 4, "num_edges": 10}]}


def test_manifest(tmp_path):
    m = files.validate_manifest(_manifest())
    assert m["normalization"] == "sym"
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(_manifest()))
    assert files.validate_manifest(p)["name"] == "cora"
    cases = [
        (lambda m: m.pop("feature_dim"), r"missing \['feature_dim'\]"),
        (lambda m: m.update(num_vertices="10"), "'num_vertices' must be int"),
        (lambda m: m.update(schema_version=2), "unsupported schema version 2"),
        (lambda m: m.update(num_partitions=3), "lists 2 partitions but num_partitions is 3"),
        (lambda m: m["partitions"][1].pop("edges"), r"partitions\[1\] is missing \['edges'\]"),
        (lambda m: m["partitions"][1].update(partition=0), "out of range or repeated"),
        (lambda m: m["partitions"][1].update(num_vertices=5), "sum to 11"),
    ]
    for mutate, needle in cases:
        bad = _manifest()
        mutate(bad)
        with pytest.raises(SchemaError, match=needle):
            files.validate_manifest(bad)
    p.write_text("{")
    with pytest.raises(SchemaError, match="not JSON"):
        files.validate_manifest(p)


def test_version_1_messages_still_decode():
    """Version 1 named the stage index ``layer`` (metadata key and watermark column); it decodes the same."""
    arrays, names = _vertex_arrays()
    md = _routing_md(schema_version="1", stage=None, layer="4", kind="AV")
    env = decode(_raw(arrays, names, md))
    assert env.stage == 4 and env.kind == "AV"
    h = peek_header(_raw(arrays, names, md))
    assert h.schema_version == 1 and h.stage == 4
    assert decode(encode(env)).stage == 4 and peek_header(encode(env)).schema_version == 2  # re-encoded as v2
    _assert_error(_raw(arrays, names, _routing_md(schema_version="1")), "missing routing field stage")
    v1 = pa.schema([pa.field("producer", pa.string(), nullable=False), pa.field("partition", pa.int32(), nullable=False),
                    pa.field("epoch", pa.int64(), nullable=False), pa.field("layer", pa.int32(), nullable=False),
                    pa.field("channel", pa.string(), nullable=False)])
    wm_md = _routing_md(schema_version="1", stage=None, layer="-1", type="watermark", kind="WM")
    batch = pa.RecordBatch.from_pylist([{"producer": "gs0", "partition": 0, "epoch": 3, "layer": 2,
                                         "channel": "ghosts"}], schema=v1.with_metadata(wm_md))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    assert decode_watermarks(sink.getvalue().to_pybytes()) == [Watermark("r", "gs0", 0, 3, 2, "ghosts")]
