"""The Kafka transport against a real broker: channels, groups, commits, dead letters, size limit, bad bootstrap."""
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("kafka")
from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # noqa: E402

from pipelines.engine import messages as M  # noqa: E402
from pipelines.engine.messages import Message  # noqa: E402
from pipelines.transports import codec  # noqa: E402
from pipelines.transports.base import TransportError  # noqa: E402
from pipelines.transports.kafka import KafkaTransport, topic_name  # noqa: E402

pytestmark = pytest.mark.kafka


def _run_id(tag: str) -> str:
    return f"t-{tag}-{uuid.uuid4().hex[:8]}"


def _poll_n(consumer, n: int, timeout: float = 30.0, commit: bool = True, poll_s: float = 0.2) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += consumer.poll(poll_s)
        if commit:
            consumer.commit()
    return got


def _task(p: int, i: int, epoch: int = 0) -> Message:
    return Message("AV", epoch, 1, i, p, 0, arrays={"h": np.full((4, 3), p * 10 + i, np.float32),
                                                   "row_gids": np.arange(4, dtype=np.int64)}, meta={"seed": i})


def test_channels_groups_and_the_tensor_work_queue(kafka_bootstrap):
    t = KafkaTransport(kafka_bootstrap, _run_id("chan"), 2)
    try:
        only1 = t.consumer([(M.TENSOR_RESULTS, 1)], group="gs-1")
        also1 = t.consumer([(M.TENSOR_RESULTS, 1)], group="other")
        w1 = t.consumer([(M.TENSOR_TASKS, 0)], group="workers")
        w2 = t.consumer([(M.TENSOR_TASKS, 0)], group="workers")
        for i in range(3):
            t.send(M.TENSOR_RESULTS, 0, _task(0, i))
            t.send(M.TENSOR_RESULTS, 1, _task(1, i))
        for p in range(2):  # graph servers send every task to the one work-queue channel
            for i in range(4):
                t.send(M.TENSOR_TASKS, 0, _task(p, i))
        t.flush()
        got = _poll_n(only1, 3)
        assert [(m.partition, m.interval) for m in got] == [(1, 0), (1, 1), (1, 2)]
        np.testing.assert_array_equal(got[2].arrays["h"], np.full((4, 3), 12, np.float32))
        assert len(_poll_n(also1, 3)) == 3  # another group sees every message too
        tasks, deadline = [], time.monotonic() + 30
        while len(tasks) < 8 and time.monotonic() < deadline:
            for w in (w1, w2):
                tasks += w.poll(0.1, max_messages=1)
                w.commit()
        assert sorted((m.partition, m.interval) for m in tasks) == [(p, i) for p in range(2) for i in range(4)]
        st = t.stats()
        # the work queue is spread over the topic's partitions by the sending graph server
        assert st["channels"]["tensor/0"]["produced"] == 4 and st["channels"]["tensor/1"]["produced"] == 4
        assert st["channels"]["tensor.out/1"]["consumed"] == {"gs-1": 3, "other": 3}
        with pytest.raises(TransportError, match="does not exist"):
            t.send(M.GHOSTS, 5, _task(0, 0))
    finally:
        t.close()


def test_work_queue_members_read_their_share_from_the_first_zero_timeout_poll(kafka_bootstrap):
    # Regression: with Kafka group membership (kafka-python 3.0) a member whose join completed between two
    # zero-timeout polls lost its assignment and fetched nothing until its session expired; tensor workers
    # stalled the run at epoch 0. Each process now reads a static share of the partitions.
    run = _run_id("share")
    t = KafkaTransport(kafka_bootstrap, run, 3)
    try:
        for p in range(3):
            for i in range(3):
                t.send(M.TENSOR_TASKS, 0, _task(p, i))  # one work-queue channel, spread by the sending server
        t.flush()
        everything = [(p, i) for p in range(3) for i in range(3)]
        for g in range(4):  # each group a fresh reader
            got = _poll_n(t.consumer([(M.TENSOR_TASKS, 0)], group=f"workers-{g}"), 9, timeout=40, poll_s=0.0)
            assert sorted((m.partition, m.interval) for m in got) == everything, g
        # two worker processes, W = 2: process 0 reads graph servers 0 and 2, process 1 reads graph server 1
        shares = {}
        for k in range(2):
            tk = KafkaTransport(kafka_bootstrap, run, 3, work_share=(k, 2), create_topics=False)
            try:
                got = _poll_n(tk.consumer([(M.TENSOR_TASKS, 0)], group="pair"), 6 if k == 0 else 3, timeout=20)
                shares[k] = sorted((m.partition, m.interval) for m in got)
            finally:
                tk.close()
        assert shares[0] == [(p, i) for p in (0, 2) for i in range(3)]
        assert shares[1] == [(1, i) for i in range(3)]
        with pytest.raises(TransportError, match="work share 2 of 2"):
            KafkaTransport(kafka_bootstrap, run, 3, work_share=(2, 2), create_topics=False)
    finally:
        t.close()


def test_a_group_resumes_after_the_last_commit(kafka_bootstrap):
    run = _run_id("commit")
    t = KafkaTransport(kafka_bootstrap, run, 1)
    try:
        for i in range(6):
            t.send(M.GHOSTS, 0, Message("SC", i, 0, -1, 0, -1, arrays={"h": np.ones((2, 2), np.float32),
                                                                       "vertex": np.arange(2)},
                                        meta={"name": "h"}))
        t.flush()
        c = t.consumer([(M.GHOSTS, 0)], group="g")
        first = []
        while len(first) < 4:
            first += c.poll(0.5, max_messages=4 - len(first))
        c.commit()
        c.close()  # commits synchronously what was handled
        c2 = t.consumer([(M.GHOSTS, 0)], group="g")
        rest = _poll_n(c2, 2)
        assert [m.epoch for m in first] == [0, 1, 2, 3] and [m.epoch for m in rest] == [4, 5]
        assert rest[0].arrays["vertex"].dtype == np.int64
        c2.close()
    finally:
        t.close()


def _ghost(epoch: int) -> Message:
    return Message("SC", epoch, 0, -1, 0, -1, arrays={"h": np.full((2, 2), epoch, np.float32),
                                                      "vertex": np.arange(2)}, meta={"name": "h"})


@pytest.mark.parametrize("kind", [M.GHOSTS, M.TENSOR_TASKS])
def test_a_consumer_that_stops_fetching_is_replaced_and_reads_on_exactly_once(kafka_bootstrap, monkeypatch, capsys,
                                                                              kind):
    # A Kafka consumer whose client state a failover left stuck fetches nothing again while records wait (the
    # suspect of a run stalled for 300 s after a leader kill in CI); here its partitions are paused behind the
    # reader's back, which stops fetching the same way. Both readers (a fixed-partition reader and the work
    # queue's shared one) replace it and go on from the next offset.
    from pipelines.transports import kafka_readers

    monkeypatch.setattr(kafka_readers, "READER_STUCK_S", 4.0)
    t = KafkaTransport(kafka_bootstrap, _run_id("stuck"), 1)
    try:
        c = t.consumer([(kind, 0)], group="g")
        for e in range(3):
            t.send(kind, 0, _ghost(e))
        t.flush()
        first = _poll_n(c, 3)
        reader = c.shared if kind == M.TENSOR_TASKS else c
        stuck = reader.kc
        stuck.pause(*stuck.assignment())
        for e in range(3, 6):
            t.send(kind, 0, _ghost(e))
        t.flush()
        rest = _poll_n(c, 3, timeout=60)
        assert [m.epoch for m in first + rest] == list(range(6))
        assert reader.kc is not stuck and reader._watch.rebuilds == 1
        assert "read nothing for 4s while 3 records wait" in capsys.readouterr().err
        assert t.stats()["channels"][f"{kind}/0"].get("redelivered", {}) == {}  # nothing read twice
    finally:
        t.close()


def test_undecodable_values_go_to_the_dead_letter_topic(kafka_bootstrap, capsys):
    run = _run_id("dead")
    t = KafkaTransport(kafka_bootstrap, run, 1)
    raw = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        topic = topic_name(run, M.GHOSTS)
        raw.send(topic, b"\x00\x01 not arrow at all", partition=0)
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        batch = pa.record_batch([pa.array([1.0, 2.0])], names=["x"])
        with pa.ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
        raw.send(topic, sink.getvalue().to_pybytes(), partition=0)  # Arrow, but not a dorylus message
        raw.send(topic, codec.encode(Message("WM", 0, 0, -1, 0, -1, meta={"dir": "F"}), "some-other-run"),
                 partition=0)
        raw.flush()
        good = Message("WM", 1, 0, -1, 0, -1, meta={"dir": "F"})
        t.send(M.GHOSTS, 0, good)
        t.flush()
        c = t.consumer([(M.GHOSTS, 0)], group="g")
        got = _poll_n(c, 1)
        assert [m.epoch for m in got] == [1]
        st = t.stats()
        assert st["dead_letters"] == {"ghosts/0": 3}
        assert st["channels"]["ghosts/0"]["consumed"] == {"g": 1}
        deadline = time.monotonic() + 20
        while t.dead_letter_count() != 3 and time.monotonic() < deadline:
            t.flush()
            time.sleep(0.2)
        assert t.dead_letter_count() == 3
        dl = KafkaConsumer(bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                           consumer_timeout_ms=10000)
        dl.assign([TopicPartition(topic_name(run, "dead-letter"), 0)])
        recs = [r for _, r in zip(range(3), dl)]
        dl.close()
        reasons = [dict(r.headers)["dorylus.error"].decode() for r in recs]
        assert "not an Arrow IPC stream" in reasons[0]
        assert "schema version" in reasons[1]
        assert "some-other-run" in reasons[2]
        assert recs[0].value == b"\x00\x01 not arrow at all"
        assert dict(recs[0].headers)["dorylus.source.topic"].decode() == topic
        assert "dead letter" in capsys.readouterr().err  # and each one is logged, never silent
    finally:
        raw.close()
        t.close()


def test_a_message_over_the_size_limit_is_a_clear_error(kafka_bootstrap):
    t = KafkaTransport(kafka_bootstrap, _run_id("big"), 1, max_message_bytes=1 << 20)
    try:
        big = Message("AV", 0, 0, 0, 0, 0, arrays={
            "h": np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)})
        with pytest.raises(TransportError, match=r"MiB encoded, over the Kafka message limit.*intervals"):
            t.send(M.TENSOR_TASKS, 0, big)
        small = Message("AV", 0, 0, 0, 0, 0, arrays={"h": np.zeros((512, 1024), np.float32)})
        t.send(M.TENSOR_TASKS, 0, small)  # compresses far below the limit
        t.flush()
    finally:
        t.close()


def test_an_unreachable_broker_is_one_line_and_exit_2_within_bounded_time(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", "--transport", "kafka", "--bootstrap",
                           "127.0.0.1:1", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0] and "unreachable" in lines[0]
    assert took < 20, took
    assert not (tmp_path / "run").exists()  # nothing written before the broker answered
    with pytest.raises(TransportError, match="unreachable"):
        KafkaTransport("127.0.0.1:1", "x", 1, connect_timeout_s=2)
