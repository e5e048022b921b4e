"""The local Apache Kafka broker (infra/local/kafka.sh) works with kafka-python, and survives a restart;
its MSK-like mode (SASL_SSL + SCRAM-SHA-512) authenticates and encrypts."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

kafka = pytest.importorskip("kafka")
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition  # noqa: E402
from kafka.admin import NewTopic  # noqa: E402
from kafka.errors import KafkaError  # noqa: E402

from tests.support.kafka import KAFKA_SH  # noqa: E402

pytestmark = pytest.mark.kafka


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _create(bootstrap: str, name: str, partitions: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000)
    try:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()


def _consume(bootstrap: str, topic: str, n: int, group: str | None = None, timeout_ms: int = 20000):
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=timeout_ms)
    out = []
    try:
        for msg in consumer:
            out.append(msg)
            if len(out) >= n:
                break
        if group is not None:
            consumer.commit()
    finally:
        consumer.close()
    return out


def test_crc32c_accelerated():
    # kafka-python checks record-batch CRCs with the C crc32c package when installed
    from kafka.record import util

    assert util.crc32c_c is not None


def test_admin_creates_topic_with_four_partitions(kafka_bootstrap):
    name = _topic("four")
    _create(kafka_bootstrap, name, 4)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        (desc,) = admin.describe_topics([name])
        assert desc["error_code"] == 0
        assert sorted(p.get("partition_index", p.get("partition")) for p in desc["partitions"]) == [0, 1, 2, 3]
        assert name in admin.list_topics()
    finally:
        admin.close()


def test_auto_topic_creation_is_off(kafka_bootstrap):
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap)
    try:
        missing = _topic("missing")
        consumer.partitions_for_topic(missing)  # a metadata request for the topic must not create it
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            assert missing not in admin.list_topics()
        finally:
            admin.close()
    finally:
        consumer.close()


def test_produce_consume_1000(kafka_bootstrap):
    name = _topic("thousand")
    _create(kafka_bootstrap, name, 4)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=5)
    try:
        for i in range(1000):
            producer.send(name, key=str(i % 4).encode(), value=f"m{i}".encode(), partition=i % 4)
        producer.flush(timeout=30)
    finally:
        producer.close()
    got = _consume(kafka_bootstrap, name, 1000)
    assert len(got) == 1000
    assert sorted(int(m.value[1:]) for m in got) == list(range(1000))
    # per partition, order is kept
    for p in range(4):
        seq = [int(m.value[1:]) for m in got if m.partition == p]
        assert seq == list(range(p, 1000, 4))


def test_large_message(kafka_bootstrap):
    """A 20 MB value (one big Arrow batch) goes through: message.max.bytes is 64 MiB."""
    name = _topic("large")
    _create(kafka_bootstrap, name, 1)
    payload = os.urandom(20 * 1024 * 1024)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", max_request_size=64 * 1024 * 1024)
    try:
        producer.send(name, payload).get(timeout=60)
    finally:
        producer.close()
    consumer = KafkaConsumer(name, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=30000, fetch_max_bytes=64 * 1024 * 1024,
                             max_partition_fetch_bytes=64 * 1024 * 1024)
    try:
        msg = next(iter(consumer))
    finally:
        consumer.close()
    assert msg.value == payload


def test_status_reports_running(kafka_bootstrap, kafka_broker):
    out = subprocess.run(["bash", str(KAFKA_SH), "status", "--state-dir", str(kafka_broker.state_dir)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and kafka_bootstrap in out.stdout


def test_restart_keeps_committed_data(kafka_bootstrap, kafka_broker):
    name = _topic("durable")
    group = _topic("group")
    _create(kafka_bootstrap, name, 2)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    try:
        for i in range(200):
            producer.send(name, value=f"a{i}".encode(), partition=i % 2)
        producer.flush(timeout=30)
    finally:
        producer.close()
    # the group reads and commits the first 100 of them
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset="earliest")
    tps = [TopicPartition(name, 0), TopicPartition(name, 1)]
    try:
        consumer.assign(tps)
        consumer.seek_to_beginning()
        from kafka.structs import OffsetAndMetadata

        consumer.commit({tp: OffsetAndMetadata(50, "", -1) for tp in tps})
    finally:
        consumer.close()

    bootstrap = kafka_broker.restart()
    assert bootstrap == kafka_bootstrap  # same port

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=20000)
    try:
        assert consumer.end_offsets(tps) == {tps[0]: 100, tps[1]: 100}
        assert [consumer.committed(tp) for tp in tps] == [50, 50]
        consumer.assign(tps)
        rest = []
        for msg in consumer:  # resumes from the committed offsets
            rest.append(msg)
            if len(rest) >= 100:
                break
    finally:
        consumer.close()
    assert len(rest) == 100
    assert sorted(int(m.value[1:]) for m in rest) == sorted(i for i in range(200) if i // 2 >= 50)


def test_sasl_ssl_scram_broker(kafka_scram):
    """MSK-like broker: SCRAM-SHA-512 over TLS works; a wrong password and a plaintext client are refused."""
    boot = kafka_scram["bootstrap"]
    assert kafka_scram["security_protocol"] == "SASL_SSL" and kafka_scram["sasl_mechanism"] == "SCRAM-SHA-512"
    sec = dict(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
               sasl_plain_username=kafka_scram["username"], sasl_plain_password=kafka_scram["password"],
               ssl_cafile=kafka_scram["cafile"])
    limits = dict(bootstrap_timeout_ms=20000, request_timeout_ms=20000)
    name = _topic("scram")
    admin = KafkaAdminClient(bootstrap_servers=boot, **limits, **sec)
    try:
        admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
        assert name in admin.list_topics()
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=boot, acks="all", max_block_ms=20000, **limits, **sec)
    try:
        for i in range(10):
            producer.send(name, value=f"s{i}".encode(), partition=i % 2)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)
    consumer = KafkaConsumer(name, bootstrap_servers=boot, auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=20000, **limits, **sec)
    got = []
    try:
        for msg in consumer:
            got.append(msg.value)
            if len(got) >= 10:
                break
    finally:
        consumer.close()
    assert sorted(got) == sorted(f"s{i}".encode() for i in range(10))

    # a wrong password: the broker refuses the SASL handshake (kafka-python logs SaslAuthenticationFailedError, or
    # only sees the connection closed, on each bootstrap attempt) and the client gives up at bootstrap_timeout_ms
    with pytest.raises(KafkaError):
        bad = KafkaProducer(bootstrap_servers=boot, max_block_ms=8000, bootstrap_timeout_ms=8000,
                            request_timeout_ms=8000, **{**sec, "sasl_plain_password": "not-the-password"})
        try:
            bad.send(name, b"never").get(timeout=10)
        finally:
            bad.close(timeout=5)

    # a plaintext client on the SASL_SSL port gets no metadata
    with pytest.raises(KafkaError):
        plain = KafkaConsumer(bootstrap_servers=boot, bootstrap_timeout_ms=8000, request_timeout_ms=8000)
        try:
            plain.topics()
        finally:
            plain.close()
