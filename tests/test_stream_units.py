"""Continuous training, without Kafka: event schema, the partitioned evolving graph, watermarks, checkpoints,
and the replay's slices."""
import numpy as np
import pyarrow as pa
import pytest

from pipelines.config import TrainConfig
from pipelines.continuous import checkpoint as ckpt
from pipelines.continuous.dedupe import Dedupe, id_hashes
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
def test_graph_updates_partitions_and_arrays_roundtrip():
    g = StreamGraph(partitions=3, feature_dim=2)
    for v in range(12):
        g.add_vertex(v, [v, v])
    pairs = [(0, 1), (1, 2), (2, 3), (0, 5), (5, 7), (7, 11), (3, 9), (4, 8)]
    for u, v in pairs:
        assert g.add_edge(u, v)
    assert not g.add_edge(1, 0)  # already there (undirected)
    g.check_invariants()
    g.update_features(9, [42, 43])
    u, v = next((u, v) for u, v in pairs if owner_of(u, 3) != owner_of(v, 3))
    assert g.remove_edge(u, v) and not g.remove_edge(u, v) and not g.has_edge(v, u)
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
    assert list(ids) == list(range(12)) and np.array_equal(graph.features[9], [42, 43])
    assert graph.num_edges == 2 * g.num_edges and (graph.adj != graph.adj.T).nnz == 0
    assert graph.train_mask[3] and graph.test_mask[4] and graph.labels[5] == -1
    st = g.partition_stats()  # ghosts: the remote ends of cut edges, per partition
    own = owner_of(np.arange(12), 3)
    src, dst = g.arrays()["src"], g.arrays()["dst"]
    cut = own[src] != own[dst]
    want = [len({int(b) for a, b in zip(np.r_[src[cut], dst[cut]], np.r_[dst[cut], src[cut]]) if own[a] == p})
            for p in range(3)]
    assert st["ghosts"] == want and sum(st["owned"]) == 12 and st["edge_cut"] == cut.mean()
    h = StreamGraph.from_arrays(g.arrays(), 3)  # the checkpoint's base
    h.check_invariants()
    a, b = g.arrays(), h.arrays()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def _apply_one_by_one(events):
    """The reference: the event semantics written as a loop over events, on dicts and sets."""
    feats, labels, adj, out = {}, {}, {}, []
    for c, v, d, f, lab in events:
        ok = "applied"
        if c == OP_RANK["add_vertex"]:
            ok = "rejected" if v in feats else ok
            if v not in feats:
                feats[v], adj[v] = f, set()
        elif v not in feats:
            ok = "rejected"
        elif c == OP_RANK["update_features"]:
            feats[v] = f
        elif c == OP_RANK["set_label"]:
            labels[v] = lab
        elif d not in feats:
            ok = "rejected"
        elif c == OP_RANK["add_edge"]:
            ok = "noop" if d in adj[v] else ok
            adj[v].add(d), adj[d].add(v)
        else:
            ok = "applied" if d in adj[v] else "noop"
            adj[v].discard(d), adj[d].discard(v)
        out.append(ok)
    return feats, labels, {(min(u, w), max(u, w)) for u in adj for w in adj[u]}, out


def test_batch_apply_equals_events_one_by_one():
    rng = np.random.default_rng(7)
    g = StreamGraph(2, 3)
    ref_events = []
    for rnd in range(4):  # several batches: state carried across them, as across rounds
        n = 400
        code = rng.choice([0, 1, 2, 2, 2, 3, 4], n).astype(np.int8)
        v = rng.integers(0, 60, n)
        d = rng.integers(0, 60, n)
        d[d == v] = (d[d == v] + 1) % 60
        f = rng.normal(size=(n, 3)).astype(np.float32)
        lab = rng.integers(0, 4, n).astype(np.int32)
        rows = (code == 0) | (code == 1)
        res = g.apply(code, v, np.where((code == 2) | (code == 3), d, -1), f[rows], lab, np.ones(n, np.int8))
        batch = list(zip(code.tolist(), v.tolist(), d.tolist(), list(f), lab.tolist()))
        ref_events += batch
        _, _, _, want = _apply_one_by_one(ref_events)
        got = [["applied", "noop", "rejected"][o] for o in res.outcome]
        assert got == want[-n:], rnd
        g.check_invariants()
    feats, labels, edges, _ = _apply_one_by_one(ref_events)
    a = g.arrays()
    assert {(int(x), int(y)) for x, y in zip(a["src"], a["dst"])} == edges
    assert a["vertex"].tolist() == sorted(feats)
    assert all(np.array_equal(a["features"][i], feats[vv]) for i, vv in enumerate(a["vertex"].tolist()))
    assert {int(vv): int(lb) for vv, lb in zip(a["vertex"], a["label"]) if lb >= 0} == labels


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


# ------------------------------------------------------------------------------------------------ dedupe
def test_dedupe_drops_repeats_and_stays_bounded():
    d = Dedupe(window_ms=1000, retention_ms=2000)
    ids = pa.array([f"e{i}" for i in range(5000)])
    t = np.arange(5000, dtype=np.int64)  # 5 windows of event time
    new, exp = d.take(ids, t)
    assert new.all() and not exp.any() and d.size == 5000
    new, exp = d.take(pa.array(["e10", "e4999", "x", "x", "e10"]), np.array([10, 4999, 5, 5, 10]))
    assert new.tolist() == [False, False, True, False, False]  # a repeat inside the batch counts once
    d.advance(4500)  # horizon 2500: windows [0, 1000) and [1000, 2000) go
    assert d.size == 5001 - 2000 - 1 and d.horizon == 2500  # (x was in window 0)
    new, exp = d.take(pa.array(["e0", "e3000", "late"]), np.array([0, 3000, 2600]))
    assert exp.tolist() == [True, False, False] and new.tolist() == [False, False, True]
    snap = d.snapshot()
    e = Dedupe(1000, 2000)
    e.restore(snap, d.horizon)
    assert e.size == d.size and not e.take(pa.array(["e3000"]), np.array([3000]))[0].any()


def test_dedupe_keys_with_equal_first_hash_stay_apart(monkeypatch):
    """The sort keys clear the first hash's low bits: keys equal there (rare, forced here) must still be told
    apart by the second hash, inside a batch and against held keys."""
    import pipelines.continuous.dedupe as dd

    real = dd.id_hashes
    monkeypatch.setattr(dd, "id_hashes", lambda ids: (np.full(len(ids), 5 << 40, np.uint64), real(ids)[1]))
    d = Dedupe(window_ms=1000, retention_ms=2000)
    new, _ = d.take(pa.array(["a", "b", "a", "c", "b"]), np.zeros(5, np.int64))
    assert new.tolist() == [True, True, False, True, False]
    new, _ = d.take(pa.array(["c", "d", "a"]), np.zeros(3, np.int64))
    assert new.tolist() == [False, True, False] and d.size == 4


def test_id_hashes_separate_near_ids():
    ids = pa.array(["a", "b", "ab", "ba", "", "a" * 40, "a" * 41] + [f"cora/e/{i}-{i + 1}" for i in range(2000)])
    h1, h2 = id_hashes(ids)
    assert np.unique(h1).size == len(ids) and np.unique(h2).size == len(ids)
    s1, _ = id_hashes(ids.slice(3, 4))  # a slice hashes as its values
    assert np.array_equal(s1, h1[3:7])
    # an id's hashes do not depend on the longest id of its batch (they did: a repeat sent in a batch of other
    # lengths was taken again)
    for i in (0, 2, 5, 7):
        a1, a2 = id_hashes(ids.slice(i, 1))
        assert a1[0] == h1[i] and a2[0] == h2[i]
    d = Dedupe(window_ms=1000, retention_ms=2000)
    d.take(pa.array(["cora/v/7", "cora/e/1-2"]), np.zeros(2, np.int64))
    new, _ = d.take(pa.array(["cora/v/7", "cora/e/123456-234567"]), np.zeros(2, np.int64))
    assert new.tolist() == [False, True]


# ------------------------------------------------------------------------------------------------ checkpoint
def test_incremental_checkpoint_chain_restores_and_compacts(tmp_path):
    g = StreamGraph(2, 3)
    for v in (5, 9, 11):
        g.add_vertex(v, [v, 0, 1])
    keys = {"h1": np.array([1, 2], np.uint64), "h2": np.array([3, 4], np.uint64), "window": np.array([0, 0])}
    params = {"l0": {"w": np.ones((3, 2), np.float32)}}
    base = ckpt.save(tmp_path, meta={"round": 1}, params=params, opt_leaves=[np.zeros(2)], keys=keys,
                     pending=EVENT_SCHEMA.empty_table(), graph=g.arrays())
    pending = pa.Table.from_batches([_mixed()])
    delta_events = pa.Table.from_batches([events_batch(["x"], 5, "add_edge", [5], dst=[11])])
    seen = []
    delta = ckpt.save(tmp_path, meta={"round": 2, "positions": {"0": 17}}, params=params,
                      opt_leaves=[np.zeros(2), np.array(3, np.int32)], pending=pending, keys=keys,
                      events=delta_events, before_commit=seen.append)
    assert base["kind"] == "base" and delta["kind"] == "delta" and seen == [delta]
    assert delta["bytes"] < base["bytes"] + pending.nbytes + 4096
    s = ckpt.load(tmp_path)
    assert s["meta"]["round"] == 2 and s["meta"]["positions"] == {"0": 17} and len(s["keys"]) == 2
    assert len(s["opt_leaves"]) == 2 and int(s["opt_leaves"][1]) == 3
    assert s["pending"].column("event_id").equals(pending.column("event_id"))
    assert s["deltas"][0].column("event_id").to_pylist() == ["x"]
    h = StreamGraph.from_arrays(s["graph"], 2)
    assert h.has_vertex(9) and not h.has_edge(5, 11)
    orphan = tmp_path / ckpt.DIR / "00000009.delta.npz"
    orphan.write_bytes(b"a crashed checkpoint's file")
    assert ckpt.load(tmp_path)["chain"] == s["chain"] and not orphan.exists()
    ckpt.save(tmp_path, meta={"round": 3}, params=params, opt_leaves=None, keys=keys,
              pending=EVENT_SCHEMA.empty_table(), graph=h.arrays())  # compaction: a new base, the chain goes
    assert sorted(f.name for f in (tmp_path / ckpt.DIR).glob("*.npz")) == ["00000003.base.npz"]
    assert not list((tmp_path / ckpt.DIR).glob(".*tmp"))  # no temp file left behind


def test_growing_small_graph_buckets_lead_the_growth_and_prefer_shapes_compiled_ahead():
    from pipelines.continuous import trainer as T

    tr = T.RoundTrainer(TrainConfig().resolved())
    # no growth measured yet: the plain buckets
    assert tr._shape_for((1000, 5000)) == (T.capacity(1000), T.capacity(5000))
    tr.shape = tr._shape_for((1000, 5000))
    tr._sizes = [(0.0, 1000, 5000), (1.0, 1100, 6000)]  # +100 vertices, +1000 entries a second
    assert tr._shape_for((1100, 5500)) == tr.shape      # still fits: no growth
    lead = max(T.LEAD_MIN_S, T.LEAD * tr.compile_s)
    n, e = tr._shape_for((1500, 9000))                   # outgrown: room for `lead` seconds of growth, <= 2x
    assert n == T.capacity(int(1500 + 100 * lead)) and e == T.capacity(min(int(9000 + 1000 * lead), 18000))
    assert T.capacity(1500) < n and e <= T.capacity(18000)
    ahead = (T.capacity(1600), T.capacity(12000))       # a shape compiled ahead that fits is taken instead
    tr._warmed.add(ahead)
    assert tr._shape_for((1500, 9000)) == ahead
    tr._sizes = [(0.0, 10, 3 << 21), (1.0, 20, 4 << 21)]  # big graphs: plain buckets (a compile is cheap there)
    tr.shape, tr._warmed = None, set()
    assert tr._shape_for((20, 4 << 21)) == (T.capacity(20), T.capacity(4 << 21))
