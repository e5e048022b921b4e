"""Repeated tensor-task arrays cross Kafka once per partition (pipelines.transports.blobs), bit-exactly."""
import collections
import threading
from typing import NamedTuple

import numpy as np
import pytest

from pipelines.transports import blobs, codec
from pipelines.transports.kafka import KafkaTransport
from schemas.tasks import Channel, Message


class _Record(NamedTuple):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


class _Future:
    def add_callback(self, fn, *args):
        fn(*args, None)

    def add_errback(self, *_):
        pass


class _Producer:
    """Records what the transport hands kafka-python, with the offsets a partition would give."""

    def __init__(self):
        self.records = []
        self.next = collections.Counter()

    def send(self, topic, value=None, key=None, headers=None, partition=None):
        self.records.append(_Record(topic, partition, self.next[(topic, partition)], key, bytes(value)))
        self.next[(topic, partition)] += 1
        return _Future()


def _transport(run_id="run-b", partitions=2) -> KafkaTransport:
    """The transport's send and receive paths without a broker behind them."""
    t = KafkaTransport.__new__(KafkaTransport)
    t.run_id, t.partitions, t.compression, t.max_message_bytes = run_id, partitions, "lz4", 64 * 2**20
    t._lock, t._blob_lock = threading.Lock(), threading.Lock()
    t._error = t._lost = None
    for name in ("_sent", "_acked", "_acked_bytes", "_payload_bytes", "_redelivered", "_consumed", "_dead", "_failed"):
        setattr(t, name, collections.Counter())
    t._high, t._dead_reasons, t._skip_compression = {}, [], collections.Counter()
    t._blobs, t._read_blobs = blobs.SenderBlobs(budget=3 * 2**20), blobs.ReaderBlobs(budget=3 * 2**20)
    t._producer = _Producer()
    return t


def _tasks(rng, epochs=4, intervals=3):
    """Tensor tasks shaped like a GCN's: a static first-layer input sent forward and backward every epoch, fresh
    activations and gradients, small arrays that always travel."""
    static = {i: rng.standard_normal((300, 128)).astype(np.float32) for i in range(intervals)}
    for e in range(epochs):
        for i in range(intervals):
            gids = np.arange(300 * i, 300 * (i + 1), dtype=np.int32)
            yield Message("AV", e, 1, i, i % 2, e, arrays={"h": static[i], "row_gids": gids}, meta={"seed": e})
            g = rng.standard_normal((300, 64)).astype(np.float32)
            yield Message("AV_BWD", e, 1, i, i % 2, e, arrays={"h": static[i], "g_h": g, "row_gids": gids},
                          meta={"wrt": []})


def test_repeated_arrays_cross_once_and_every_message_arrives_bit_exact():
    t = _transport()
    sent = list(_tasks(np.random.default_rng(0)))
    for m in sent:
        t.send(Channel.TENSOR_TASKS, 0, m)
    got = t.decode_records(t._producer.records, "tensor-workers")
    assert len(got) == len(sent) and not t._dead
    for a, b in zip(sent, got):
        assert (a.kind, a.epoch, a.interval, a.partition, a.meta) == (b.kind, b.epoch, b.interval, b.partition, b.meta)
        assert sorted(a.arrays) == sorted(b.arrays)
        for k in a.arrays:
            assert a.arrays[k].dtype == b.arrays[k].dtype and np.array_equal(a.arrays[k], b.arrays[k]), k
    # each interval's static input crossed once; every later copy was a reference
    static = 300 * 128 * 4
    st = t.stats()
    assert st["deduplicated_bytes"][Channel.TENSOR_TASKS] == (len(sent) - 3) * static
    assert st["payload_bytes"][Channel.TENSOR_TASKS] == sum(m.nbytes() for m in sent) - (len(sent) - 3) * static


def test_a_small_budget_evicts_on_both_sides_alike():
    t = _transport()
    t._blobs, t._read_blobs = blobs.SenderBlobs(budget=2 * 2**20), blobs.ReaderBlobs(budget=2 * 2**20)
    rng = np.random.default_rng(1)
    pool = [rng.standard_normal((200 + k, 300)).astype(np.float32) for k in range(6)]  # ~0.25 MB each
    sent = [Message("AV", 0, 0, k, 0, 0, arrays={"h": pool[j]}) for k, j in enumerate(rng.integers(0, 6, 60))]
    for m in sent:
        t.send(Channel.TENSOR_TASKS, 0, m)
    got = t.decode_records(t._producer.records, "tensor-workers")
    assert len(got) == 60 and all(np.array_equal(a.arrays["h"], b.arrays["h"]) for a, b in zip(sent, got))
    assert 0 < t.stats()["deduplicated_bytes"][Channel.TENSOR_TASKS]
    [table] = t._read_blobs.tables.values()
    assert table.bytes <= 2 * 2**20 and list(table.items) == list(t._blobs.tables[(Channel.TENSOR_TASKS, 0)].items)


def test_other_channels_and_small_arrays_travel_in_full():
    t = _transport()
    h = np.ones((300, 128), np.float32)
    for _ in range(2):
        t.send(Channel.TENSOR_RESULTS, 1, Message("AV", 0, 1, 0, 1, 0, arrays={"h": h}))
        t.send(Channel.TENSOR_TASKS, 0, Message("AV", 0, 1, 0, 1, 0, arrays={"x": np.ones(10, np.float32)}))
    assert not t.stats()["deduplicated_bytes"]
    assert all(blobs.META_KEY not in codec.decode(r.value).meta for r in t._producer.records)


def test_a_reader_that_missed_the_start_dead_letters_a_reference(capsys):
    t = _transport()
    sent = list(_tasks(np.random.default_rng(2), epochs=2, intervals=1))
    for m in sent:
        t.send(Channel.TENSOR_TASKS, 0, m)
    recs = list(t._producer.records)
    assert t.decode_records(recs[1:], "late-group") == []  # each refers to the first record's array
    assert t._dead == {(Channel.TENSOR_TASKS, 0): 3} and "BlobMissing" in capsys.readouterr().err
    # a record read again (after a reconnect) resolves from the table as it is now, and changes nothing
    assert len(t.decode_records(recs, "g")) == len(sent)
    [again] = t.decode_records([recs[1]], "g")
    assert np.array_equal(again.arrays["h"], sent[1].arrays["h"]) and t._dead == {(Channel.TENSOR_TASKS, 0): 3}


def test_the_sender_plans_nothing_for_a_message_it_cannot_send():
    t = _transport()
    t.max_message_bytes = 128 * 2**10  # the limit less the record overhead is below one encoded task
    with pytest.raises(Exception, match="over the Kafka message limit"):
        t.send(Channel.TENSOR_TASKS, 0, next(_tasks(np.random.default_rng(3))))
    assert not any(tb.items for tb in t._blobs.tables.values()) and not t._producer.records


def test_streams_that_do_not_compress_are_sent_uncompressed():
    t = _transport()
    rng = np.random.default_rng(4)
    dense = [rng.standard_normal((400, 64)).astype(np.float32) for _ in range(3)]
    sparse = [np.zeros((400, 64), np.float32) for _ in range(3)]
    for d, z in zip(dense, sparse):
        t.send(Channel.TENSOR_RESULTS, 0, Message("AV", 0, 1, 0, 0, 0, arrays={"h": d}))
        t.send(Channel.TENSOR_RESULTS, 0, Message("LOSS", 0, 3, 0, 0, 0, arrays={"dh": z}))
    sizes = [len(r.value) for r in t._producer.records]
    assert sizes[0] > 0.9 * dense[0].nbytes and all(s < 0.1 * dense[0].nbytes for s in sizes[1::2])  # lz4 on zeros
    assert t._skip_compression[(Channel.TENSOR_RESULTS, "AV", 1)] == 32 - 2 and not t._skip_compression[
        (Channel.TENSOR_RESULTS, "LOSS", 3)]
    got = t.decode_records(t._producer.records, "g")
    assert all(np.array_equal(a, b.arrays["h"]) for a, b in zip(dense, got[0::2]))
