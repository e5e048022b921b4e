"""Continuous training, without Kafka: event schema, the partitioned evolving graph, watermarks, checkpoints,
and the replay's slices."""
import numpy as np
import pyarrow as pa
import pytest

from pipelines.continuous import checkpoint as ckpt
from pipelines.continuous.replay import dataset_slices
from pipelines.continuous.state import ApplyError, StreamGraph, owner_of
from pipelines.continuous.watermark import NO_TIME, WatermarkTracker, next_cut, window_end
from pipelines.data.synthetic import planted_partition
from schemas import SchemaError
from schemas.events import (EVENT_SCHEMA, OP_RANK, dead_letter_batch, decode_events, encode_events, events_batch,
                            validate_rows)


# ------------------------------------------------------------------------------------------------ event schema
def _mixed():
    return events_batch(
        ["a", "b", "c", "d", "e", "f", "g", "h", "", "j"], np.arange(10) * 1000,
        ["add_vertex", "add_edge", "set_label", "bogus", "update_features", "add_edge", "set_label",
         "add_vertex", "remove_edge", "set_label"],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        dst=[None, 3, None, None, None, None, None, None, 4, None],
        features=[[1, 2, 3], None, None, None, [1, 2], None, None, [1, np.nan, 3], None, None],
        label=[None, None, 2, None, None, None, 9, None, None, -1],
        split=[None, None, "train", None, None, None, "val", None, None, "test"])


def test_events_roundtrip_and_row_validation():
    b = _mixed()
    assert b.schema.equals(EVENT_SCHEMA, check_metadata=True)
    d = decode_events(encode_events(b))
    for name in EVENT_SCHEMA.names:  # (features hold a NaN, which equals() never matches)
        if name != "features":
            assert d.column(name).equals(b.column(name)), name
    assert np.array_equal(np.asarray(d.column("features").values), np.asarray(b.column("features").values),
                          equal_nan=True)
    assert d.column("event_time").cast(pa.int64()).to_pylist()[:3] == [0, 1000, 2000]
    reasons = validate_rows(d, feature_dim=3, num_classes=7)
    assert reasons[0] is None and reasons[1] is None and reasons[2] is None
    assert "unknown op" in reasons[3]
    assert "2 values, expected 3" in reasons[4]
    assert "without dst" in reasons[5]
    assert "out of range" in reasons[6]
    assert "NaN" in reasons[7]
    assert reasons[8] == "empty event_id"
    assert "unlabelled" in reasons[9]
    dl = dead_letter_batch(d.slice(3, 2), reasons[3:5])
    assert dl.column("reason").to_pylist() == reasons[3:5]


def test_decode_rejects_schema_violations():
    with pytest.raises(SchemaError, match="not an Arrow IPC stream"):
        decode_events(b"definitely not arrow")
    t = pa.table({"event_id": ["x"], "op": ["add_edge"], "vertex": [1]})  # no event_time
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    with pytest.raises(SchemaError, match="event_time"):
        decode_events(sink.getvalue())
    b = _mixed()
    extra = pa.RecordBatch.from_arrays(b.columns + [pa.array([1] * b.num_rows)], names=b.schema.names + ["x"])
    with pytest.raises(SchemaError, match="unknown events column"):
        decode_events(encode_events(extra))
    bad_type = pa.RecordBatch.from_arrays([b.column(0), b.column(1), b.column(2),
                                           pa.array([str(i) for i in range(b.num_rows)])],
                                          names=["event_id", "event_time", "op", "vertex"])
    with pytest.raises(SchemaError, match="vertex"):
        decode_events(encode_events(bad_type))


def test_optional_columns_may_be_left_out():
    t = pa.table({"event_id": ["e1"], "event_time": pa.array([5], pa.int64()).cast(pa.timestamp("ms", "UTC")),
                  "op": ["add_edge"], "vertex": [1], "dst": [2]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    d = decode_events(sink.getvalue())
    assert d.schema.names == EVENT_SCHEMA.names and d.column("features").null_count == 1
    assert validate_rows(d) == [None]


# ------------------------------------------------------------------------------------------ evolving graph
def test_partitioned_graph_ghosts_and_updates():
    g = StreamGraph(partitions=3, feature_dim=2)
    for v in range(12):
        g.add_vertex(v, [v, v])
    pairs = [(0, 1), (1, 2), (2, 3), (0, 5), (5, 7), (7, 11), (3, 9), (4, 8)]
    for u, v in pairs:
        assert g.add_edge(u, v)
    assert not g.add_edge(1, 0)  # already there (undirected)
    g.check_invariants()
    # a vertex that is a ghost somewhere: its feature update reaches the mirror
    u, v = next((u, v) for u, v in pairs if owner_of(u, 3) != owner_of(v, 3))
    g.update_features(v, [42, 43])
    assert np.array_equal(g.parts[owner_of(u, 3)].ghost_features[v], [42, 43])
    g.check_invariants()
    assert g.remove_edge(u, v) and not g.remove_edge(u, v)
    g.check_invariants()
    with pytest.raises(ApplyError, match="unknown vertex 99"):
        g.add_edge(1, 99)
    with pytest.raises(ApplyError, match="already exists"):
        g.add_vertex(1, [0, 0])
    with pytest.raises(ApplyError, match="expected 2"):
        g.update_features(1, [0, 0, 0])
    g.set_label(3, 1, "train")
    g.set_label(4, 0, "test")
    graph, ids = g.materialize("t", 2)
    assert list(ids) == list(range(12))
    assert graph.num_edges == 2 * g.num_edges and (graph.adj != graph.adj.T).nnz == 0
    assert graph.train_mask[3] and graph.test_mask[4] and graph.labels[5] == -1
    # the state survives arrays -> from_arrays (the checkpoint's graph)
    h = StreamGraph.from_arrays(g.arrays(), 3)
    h.check_invariants()
    a, b = g.arrays(), h.arrays()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_replay_slices_rebuild_the_dataset():
    graph = planted_partition(num_nodes=300, num_classes=3, avg_degree=6, feature_dim=16, seed=3)
    slices = dataset_slices(graph, 5, 10_000, 1000, seed=1)
    assert [s.start_ms for s in slices] == [10_000 + 1000 * i for i in range(5)]
    g = StreamGraph(2)
    ids = []
    for s in slices:
        t = s.events
        times = t.column("event_time").cast(pa.int64()).to_numpy()
        assert times.min() >= s.start_ms and times.max() < s.start_ms + 1000
        rows = sorted(t.to_pylist(), key=lambda e: (e["event_time"], OP_RANK[e["op"]], e["event_id"]))
        for e in rows:
            ids.append(e["event_id"])
            if e["op"] == "add_vertex":
                g.add_vertex(e["vertex"], e["features"])
            elif e["op"] == "add_edge":
                g.add_edge(e["vertex"], e["dst"])
            else:
                g.set_label(e["vertex"], e["label"], e["split"])
    assert len(ids) == len(set(ids))
    rebuilt, vid = g.materialize(graph.name, graph.num_classes)
    assert np.array_equal(vid, np.arange(graph.num_nodes))
    assert (rebuilt.adj != graph.adj).nnz == 0
    assert np.array_equal(rebuilt.features, graph.features) and np.array_equal(rebuilt.labels, graph.labels)
    for m in ("train_mask", "val_mask", "test_mask"):
        assert np.array_equal(getattr(rebuilt, m), getattr(graph, m))


# ------------------------------------------------------------------------------------------------ watermarks
def test_watermark_min_over_partitions_and_lateness():
    wm = WatermarkTracker(lateness_ms=100)
    assert wm.watermark([0, 1]) == NO_TIME  # nothing read
    wm.observe(0, 5000)
    wm.set_caught_up(1, True)
    assert wm.watermark([0, 1]) == NO_TIME  # partition 1 has no event yet: its first one may be the oldest
    wm.observe(1, 3000)
    wm.observe(1, 2000)  # out of order: the max stays
    assert wm.watermark([0, 1]) == 2900
    idle = WatermarkTracker(idle_s=0.0)
    idle.observe(0, 9000)
    idle.set_caught_up(1, True)
    assert idle.watermark([0, 1]) == 9000  # an empty, caught-up partition is idle after idle_s
    idle.observe(1, 1000)
    assert idle.watermark([0, 1]) == 9000  # and so is a caught-up, silent one
    idle.set_caught_up(1, False)
    assert idle.watermark([0, 1]) == 9000  # unread records hold it again, but it never goes back
    idle.observe(0, 9500)
    assert idle.watermark([0, 1]) == 9000
    idle.observe(1, 9700)
    assert idle.watermark([0, 1]) == 9500
    idle.set_caught_up(0, True)
    idle.set_caught_up(1, True)
    assert idle.watermark([0, 1]) == 9500  # everything idle: it stays
    slow = WatermarkTracker(idle_s=3600.0)
    slow.observe(0, 9000)
    slow.set_caught_up(1, True)
    assert slow.watermark([0, 1]) == NO_TIME  # not idle long enough


def test_round_cuts():
    iv = 1000
    assert window_end(0, iv) == 1000 and window_end(999, iv) == 1000 and window_end(1000, iv) == 2000
    assert next_cut(NO_TIME, 100, None, iv) is None
    assert next_cut(999, 100, None, iv) is None
    assert next_cut(1000, 100, None, iv) == 1000
    assert next_cut(5500, 100, None, iv) == 1000  # one window per round
    assert next_cut(5500, 100, None, iv, "skip") == 5000  # or straight to the last complete window
    assert next_cut(5500, 3200, 1000, iv) == 4000  # empty windows are skipped
    assert next_cut(1500, 400, 1000, iv) is None  # a late event waits for the next round ...
    assert next_cut(2000, 400, 1000, iv) == 2000  # ... which applies it
    assert next_cut(5500, None, 1000, iv) is None


# ------------------------------------------------------------------------------------------------ checkpoint
def test_checkpoint_roundtrip(tmp_path):
    g = StreamGraph(2, 3)
    for v in (5, 9, 11):
        g.add_vertex(v, [v, 0, 1])
    g.add_edge(5, 11)
    g.set_label(9, 2, "val")
    pending = pa.Table.from_batches([_mixed()])
    params = {"l0": {"w": np.ones((3, 2), np.float32)}}
    ckpt.save(tmp_path, meta={"round": 4, "positions": {"0": 17}}, params=params,
              opt_leaves=[np.zeros(2), np.array(3, np.int32)], graph=g.arrays(), pending=pending, seen=["a", "b"])
    s = ckpt.load(tmp_path)
    assert s["meta"]["round"] == 4 and s["meta"]["positions"] == {"0": 17}
    assert np.array_equal(s["params"]["l0"]["w"], params["l0"]["w"])
    assert len(s["opt_leaves"]) == 2 and int(s["opt_leaves"][1]) == 3
    assert s["pending"].column("event_id").equals(pending.column("event_id"))
    assert s["pending"].schema.equals(EVENT_SCHEMA)
    assert s["seen"] == ["a", "b"]
    h = StreamGraph.from_arrays(s["graph"], 2)
    assert h.has_edge(11, 5) and h.parts[owner_of(9, 2)].labels[9] == 2
    assert not list(tmp_path.glob(".*tmp"))  # no temp file left behind
