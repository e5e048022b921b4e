"""Continuous training against a real Kafka broker: Cora streamed in 10 slices reaches batch accuracy; bad events
go to the dead-letter topic and never stop the stream; late events are applied by the next round."""
import json
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest

from pipelines.config import TrainConfig
from pipelines.continuous import kafka_io
from pipelines.continuous.replay import replay
from pipelines.continuous.stream import Stream, StreamOptions, read_applied
from schemas import decode_control
from schemas.events import encode_events, events_batch

pytestmark = pytest.mark.kafka

START_MS = 1_700_000_000_000  # a whole number of seconds: slice k is exactly round window k


def _topic(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _consume_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 20.0) -> list:
    c = kafka_io.consumer(bootstrap)
    from kafka import TopicPartition

    tp = TopicPartition(topic, 0)
    c.assign([tp])
    c.seek_to_beginning(tp)
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < expect and time.monotonic() < deadline:
        for msgs in c.poll(timeout_ms=200).values():
            out.extend(msgs)
    # and nothing more than expected
    for msgs in c.poll(timeout_ms=500).values():
        out.extend(msgs)
    c.close()
    return out


@pytest.fixture(scope="module")
def cora(data_dir):
    from pipelines.data.registry import load_dataset

    return load_dataset("cora", data_dir)


@pytest.fixture(scope="module")
def batch_acc(cora):
    from pipelines.train import train

    cfg = TrainConfig(dataset="cora").resolved()
    return train(cfg, cora).summary["test_acc"]


def test_cora_in_ten_slices_reaches_batch_accuracy(kafka_bootstrap, cora, batch_acc, tmp_path):
    topic = _topic("cora-events")
    sent = replay(cora, kafka_bootstrap, topic, slices=10, slice_s=1.0, start_ms=START_MS, topic_partitions=3)
    cfg = TrainConfig(dataset="cora").resolved()
    models = _topic("models")
    opts = StreamOptions(bootstrap=kafka_bootstrap, events_topic=topic, out=str(tmp_path), models_topic=models,
                         round_interval_s=1.0, first_round_epochs=100, round_epochs=50, until_idle_s=2.0,
                         num_classes=7, name="cora-stream")
    s = Stream(opts, cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # round 1 (15 train labels of 6 classes) waits for labels of every class; rounds 2..10 train
    assert s["status"] == "complete" and len(rows) == 10 and s["version"] == 9
    assert "test_acc" not in rows[0] and all("test_acc" in r for r in rows[1:])
    assert [r["cut_ms"] for r in rows[:9]] == [START_MS + 1000 * (k + 1) for k in range(9)]
    assert rows[-1]["final"] and rows[-1]["nodes"] == cora.num_nodes and rows[-1]["edges"] == cora.num_edges // 2
    assert np.all(np.diff([r["nodes"] for r in rows]) >= 0)
    c = s["counters"]
    assert c["applied"] == sent["events"] and c["duplicates"] == c["late"] == c["dead_letters"] == 0
    applied = read_applied(tmp_path)
    assert applied.num_rows == sent["events"] == len(set(applied.column("event_id").to_pylist()))
    final = rows[-1]["test_acc"]
    print(f"stream final test acc {final:.4f} vs batch {batch_acc:.4f}")
    assert abs(final - batch_acc) <= 0.015
    # every version was announced on the models topic
    ann = [decode_control(m.value) for m in _consume_all(kafka_bootstrap, models, 9)]
    assert [a.args["version"] for a in ann] == list(range(1, 10))
    assert [a.args["round"] for a in ann] == list(range(2, 11))
    assert ann[-1].command == "MODEL_VERSION" and (tmp_path / ann[-1].args["path"]).exists()


def _tiny(n=40, dim=4, t=1000):
    feats = np.random.default_rng(0).normal(size=(n, dim)).astype(np.float32)
    verts = events_batch([f"v{i}" for i in range(n)], t, "add_vertex", np.arange(n), features=feats)
    ring = events_batch([f"e{i}" for i in range(n)], t + 500, "add_edge", np.arange(n),
                        dst=(np.arange(n) + 1) % n)
    split = ["train" if i % 4 == 0 else "val" if i % 4 == 1 else "test" for i in range(n)]
    labels = events_batch([f"l{i}" for i in range(n)], t + 600, "set_label", np.arange(n),
                          label=np.arange(n) % 3, split=split)
    return verts, ring, labels


def test_bad_events_go_to_the_dead_letter_topic(kafka_bootstrap, tmp_path):
    topic = _topic("bad-events")
    kafka_io.ensure_topics(kafka_bootstrap, {topic: 1})
    verts, ring, labels = _tiny()
    bad_rows = events_batch(["bad-nan", "bad-op"], 1000, ["add_vertex", "explode"], [100, 101],
                            features=[[1.0, np.nan, 0, 0], [0, 0, 0, 0]])
    unknown = events_batch(["bad-unknown", "bad-loop"], 1550, "add_edge", [3, 5], dst=[999, 5])
    bad_label = events_batch(["bad-label"], 1600, "set_label", [7], label=[5], split=["train"])
    no_vertex = pa.table({"event_id": ["x"], "op": ["add_edge"],
                          "event_time": pa.array([1000], pa.int64()).cast(pa.timestamp("ms", "UTC"))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, no_vertex.schema) as w:
        w.write_table(no_vertex)
    p = kafka_io.producer(kafka_bootstrap)
    for value in [b"\x00 not arrow at all", sink.getvalue().to_pybytes(),
                  encode_events(pa.Table.from_batches([verts, bad_rows])), encode_events(ring),
                  encode_events(unknown), encode_events(labels), encode_events(bad_label),
                  encode_events(ring)]:  # the last one again: duplicates, dropped
        p.send(topic, value=value, partition=0)
    p.flush()
    p.close()
    dlq = _topic("bad-events-dlq")
    opts = StreamOptions(bootstrap=kafka_bootstrap, events_topic=topic, out=str(tmp_path), dead_letter_topic=dlq,
                         models_topic=_topic("models"), round_interval_s=1.0, first_round_epochs=5,
                         until_idle_s=1.5, num_classes=3)
    s = Stream(opts, TrainConfig(epochs=5).resolved()).run()
    c = s["counters"]
    assert s["status"] == "complete" and s["version"] == 1  # trained despite everything
    assert c["bad_messages"] == 2 and c["rejected_rows"] == 4 and c["apply_rejected"] == 1
    assert c["dead_letters"] == 7 and c["duplicates"] == 40 and c["applied"] == 120
    recs = _consume_all(kafka_bootstrap, dlq, 6)
    assert len(recs) == 6  # 2 whole messages + 3 messages' bad rows + 1 batch rejected when applied
    reasons = []
    for r in recs:
        h = dict(r.headers)
        assert h["dorylus.source"].decode().startswith(f"{topic}/")
        if h["dorylus.kind"] == b"message":
            reasons.append(h["dorylus.reason"].decode())
        else:
            reasons += pa.ipc.open_stream(r.value).read_all().column("reason").to_pylist()
    text = " | ".join(reasons)
    for want in ["not an Arrow IPC stream", "'vertex' is missing", "NaN", "unknown op 'explode'",
                 "self-loop", "label 5 out of range", "unknown vertex 999"]:
        assert want in text, (want, text)
    outcomes = read_applied(tmp_path).column("outcome").to_pylist()
    assert outcomes.count("rejected") == 1 and outcomes.count("applied") == 120


def test_late_events_are_applied_by_the_next_round_with_the_engine(kafka_bootstrap, tmp_path):
    topic = _topic("late-events")
    kafka_io.ensure_topics(kafka_bootstrap, {topic: 1})
    verts, ring, labels = _tiny()
    p = kafka_io.producer(kafka_bootstrap)

    def send(*batches):
        for b in batches:
            p.send(topic, value=encode_events(b), partition=0)
        p.flush()

    send(verts, ring, labels, events_batch(["w1"], 2100, "add_edge", [0], dst=[2]))
    # Row-normalized features, with which the warm-start bound below was set (raw ones, "auto"'s choice for
    # these random features, keep less of round 0's progress at round 1's first epoch: 1.04 against 1.02).
    cfg = TrainConfig(epochs=4, partitions=2, staleness=1, feature_norm="row", sync_warmup=0).resolved()
    opts = StreamOptions(bootstrap=kafka_bootstrap, events_topic=topic, out=str(tmp_path),
                         models_topic=_topic("models"), round_interval_s=1.0, first_round_epochs=40,
                         round_epochs=4, until_idle_s=4.0, num_classes=3)
    stream = Stream(opts, cfg)
    result = {}
    th = threading.Thread(target=lambda: result.update(stream.run()))
    th.start()
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    # when round 1 is done the late events must arrive within until_idle_s, or the stream ends first
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    send(events_batch(["late"], 1200, "add_edge", [0], dst=[20]),      # behind the cut of round 1
         events_batch(["w2"], 3100, "add_edge", [1], dst=[21]))        # moves the watermark past 3000
    th.join(timeout=180)
    p.close()
    assert not th.is_alive() and result["status"] == "complete"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["cut_ms"] for r in rows] == [2000, 3000, None]
    assert rows[0]["events"] == 120 and rows[0]["late_in_round"] == 0
    assert rows[1]["events"] == 2 and rows[1]["late_in_round"] == 1  # the late edge and w1
    assert rows[2]["events"] == 1 and result["counters"]["late"] == 1
    assert all(r["engine"] == "pipelined" for r in rows)
    # warm-started: round 2 starts about where round 1 ended, far below where round 1 started
    assert rows[1]["first_loss"] < rows[0]["first_loss"] - 0.5 * (rows[0]["first_loss"] - rows[0]["loss"])
    assert stream.graph.has_edge(0, 20) and stream.graph.has_edge(21, 1)
