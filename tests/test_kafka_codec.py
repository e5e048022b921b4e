"""The engine's messages on the wire (pipelines.transports.codec): exact round trips, Arrow types, foreign readers.

No broker needed: these check the bytes the Kafka transport writes."""
import json

import numpy as np
import pyarrow as pa
import pytest

from pipelines.engine.messages import Message
from pipelines.transports import codec
from schemas.messages import SchemaError

RNG = np.random.default_rng(0)

MESSAGES = [
    # a tensor task: float rows, int64 ids, int32 labels, bool mask, JSON meta with the model spec
    Message("LAST", 3, 4, 2, 1, 3, arrays={
        "h": RNG.standard_normal((6, 5)).astype(np.float32), "row_gids": np.arange(6, dtype=np.int64),
        "labels": np.arange(6, dtype=np.int32), "mask": np.array([1, 0, 1, 0, 1, 0], bool)},
        meta={"model": {"name": "gcn", "hidden": [16], "dropout": 0.5}, "seed": 123, "attempt": 0,
              "scale": 1 / 140}),
    # an AE task: CSR block arrays of different lengths and dtypes
    Message("AE", 0, 1, 0, 0, 0, arrays={
        "s_src": RNG.standard_normal((9, 8)).astype(np.float32), "s_dst": RNG.standard_normal((4, 8)).astype(
            np.float32), "indptr": np.array([0, 2, 5, 7, 9], np.int32), "indices": np.arange(9, dtype=np.int32),
        "data": np.ones(9, np.float32), "row_ids": np.zeros(12, np.int32)}, meta={"seed": 7}),
    Message("SC", 2, 0, -1, 1, -1, arrays={"h": RNG.standard_normal((4, 3)).astype(np.float32),
                                          "vertex": np.array([5, 9, 11, 40], np.int64)}, meta={"name": "h"}),
    Message("SC_BWD", 2, 3, -1, 0, -1, arrays={"z": RNG.standard_normal((2, 2, 4)).astype(np.float32),
                                              "vertex": np.array([1, 2], np.int64)}, meta={"name": "z"}),
    Message("GRAD", 2, 1, 0, 1, 2, arrays={"av0/w": RNG.standard_normal((3, 2)).astype(np.float32),
                                          "av0/b": np.zeros(2, np.float32)}, meta={"stage_name": "av0"}),
    Message("WEIGHTS", 1, -1, -1, 0, 2, arrays={"av0/w": np.ones((3, 2), np.float32),
                                               "loss/b_in": np.zeros(7, np.float32)}, meta={"retire_below": 0}),
    Message("WM", 4, 2, -1, 1, -1, meta={"dir": "F"}),
    Message("WM", 4, 2, -1, 0, -1, meta={"dir": "B"}),
    Message("STOP_AFTER", 4, -1, -1, 1, -1),
    Message("STOP", 9, -1, -1, 2, -1),
    Message("EPOCH", 4, -1, -1, 1, -1, meta={"loss_sum": float("nan"), "count": 140.0, "busy_s": {"GA": 0.1},
                                            "interval_epochs": [4, 5]}),
    Message("ERROR", 1, 0, 3, 1, 1, meta={"error": "injected failure", "retryable": True, "task": "AV"}),
    Message("ODD", 0, 0, 0, 0, 0, arrays={"empty": np.zeros((0, 3), np.float32), "scalar": np.array(2.5),
                                         "u": np.arange(3, dtype=np.uint32), "f16": np.ones(2, np.float16)}),
    # a ghost message that does not fit a vertex block exactly (float64) travels as a tensor batch, unchanged
    Message("SC", 1, 0, -1, 0, -1, arrays={"h": np.ones((2, 2)), "vertex": np.array([0, 1], np.int64)},
            meta={"name": "h"}),
]


def _same(a: Message, b: Message) -> None:
    assert (a.kind, a.epoch, a.stage, a.interval, a.partition, a.version) == \
        (b.kind, b.epoch, b.stage, b.interval, b.partition, b.version)
    assert list(a.arrays) == list(b.arrays) or set(a.arrays) == set(b.arrays)
    for k, x in a.arrays.items():
        x, y = np.asarray(x), b.arrays[k]
        assert y.dtype == x.dtype and y.shape == x.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(x, y, equal_nan=True), k
    assert json.dumps(a.meta, sort_keys=True) == json.dumps(b.meta, sort_keys=True)


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
@pytest.mark.parametrize("i", range(len(MESSAGES)))
def test_every_engine_message_round_trips_exactly(i, compression):
    msg = MESSAGES[i]
    _same(msg, codec.decode(codec.encode(msg, "run-1", compression), "run-1"))


def test_each_kind_travels_as_its_arrow_message_type():
    types = {}
    for m in MESSAGES:
        obj = codec.to_arrow(m, "r")
        types.setdefault(m.kind, set()).add(type(obj).__name__ + ":" + str(getattr(obj, "type", "")))
    assert types["SC"] == {"Envelope:vertex_block", "Envelope:tensor_batch"}
    assert types["SC_BWD"] == {"Envelope:vertex_block"}
    assert types["GRAD"] == {"Envelope:gradients"} and types["WEIGHTS"] == {"Envelope:weights"}
    assert types["WM"] == {"Watermark:"} and types["STOP"] == {"Control:"}
    assert types["LAST"] == {"Envelope:tensor_batch"} and types["EPOCH"] == {"Envelope:tensor_batch"}


def test_ghost_rows_are_a_plain_vertex_block_for_any_arrow_reader():
    msg = MESSAGES[2]
    table = pa.ipc.open_stream(codec.encode(msg, "run-1", "lz4")).read_all()
    assert table.schema.field("vertex").type == pa.int64()
    assert table.schema.field("h").type == pa.list_(pa.field("item", pa.float32(), nullable=False), 3)
    assert table.column("vertex").to_pylist() == [5, 9, 11, 40]
    md = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert md["dorylus.type"] == "vertex_block" and md["dorylus.kind"] == "SC" and md["dorylus.stage"] == "0"
    assert md["dorylus.run_id"] == "run-1" and md["dorylus.epoch"] == "2"
    flat = np.asarray(table.column("h").combine_chunks().flatten())
    np.testing.assert_array_equal(flat.reshape(4, 3), msg.arrays["h"])


def test_foreign_and_corrupt_values_are_schema_errors():
    good = codec.encode(MESSAGES[0], "run-1")
    with pytest.raises(SchemaError):
        codec.decode(b"\x00garbage\xff" * 10)
    with pytest.raises(SchemaError):
        codec.decode(good[: len(good) // 2])
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([pa.array([1, 2])], names=["x"])
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    with pytest.raises(SchemaError, match="schema"):
        codec.decode(sink.getvalue().to_pybytes())
    with pytest.raises(SchemaError, match="run"):
        codec.decode(good, "another-run")


def test_decoded_arrays_are_read_only_views():
    got = codec.decode(codec.encode(MESSAGES[2], "r"))
    with pytest.raises(ValueError):
        got.arrays["h"][0, 0] = 1.0


def test_role_commands_name_every_process(tmp_path):
    from pipelines.cli import build_parser
    from pipelines.config import TrainConfig
    from pipelines.launch import role_commands

    cfg = tmp_path / "config.toml"
    cfg.write_text(TrainConfig(partitions=3, intervals=2, transport="kafka", bootstrap="h:9092").resolved().to_toml())
    cmds = role_commands(cfg, "h:9092", "run-r1", out=tmp_path, workers=2, start_epoch=7, owner_pid=42,
                         entry=["dorylus"])
    assert sorted(cmds) == ["graph-server-0", "graph-server-1", "graph-server-2", "param-server",
                            "tensor-worker-0", "tensor-worker-1"]
    assert cmds["graph-server-2"][:4] == ["dorylus", "graph-server", "--partition", "2"]
    for argv in cmds.values():  # every command line parses with the real CLI
        args = build_parser().parse_args(argv[1:])
        assert (args.run_id, args.bootstrap, args.start_epoch, args.owner_pid) == ("run-r1", "h:9092", 7, 42)
        assert args.config == str(cfg) and args.out == str(tmp_path)
