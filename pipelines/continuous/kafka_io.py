"""Small kafka-python helpers for the stream: clients sized for Arrow batches, topic creation.

Every client takes the TLS/SASL settings of the environment (`pipelines.transports.kafka_security`). Producers
are idempotent with ``acks=all`` and retry until their delivery timeout, so a broker crash or a leader change
neither loses nor duplicates an event; topics are replicated on a cluster of three or more brokers
(`pipelines.transports.kafka.cluster_replication`)."""
from __future__ import annotations

import time

from pipelines.transports.kafka import admin_call, cluster_replication
from pipelines.transports.kafka_security import client_settings

MAX_BYTES = 64 * 1024 * 1024  # the local broker's message.max.bytes


def producer(bootstrap: str, **kw):
    from kafka import KafkaProducer

    opts = dict(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5,
                max_request_size=MAX_BYTES, retries=float("inf"), max_in_flight_requests_per_connection=5,
                request_timeout_ms=30000, delivery_timeout_ms=180000, reconnect_backoff_max_ms=1000,
                **client_settings())
    opts.update(kw)
    return KafkaProducer(**opts)


def consumer(bootstrap: str, **kw):
    from kafka import KafkaConsumer

    opts = dict(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                auto_offset_reset="earliest", fetch_max_bytes=MAX_BYTES, max_partition_fetch_bytes=MAX_BYTES,
                receive_buffer_bytes=4 * 1024 * 1024, reconnect_backoff_max_ms=1000, **client_settings())
    opts.update(kw)
    return KafkaConsumer(**opts)


def ensure_topics(bootstrap: str, topics: dict[str, int], timeout_s: float = 30.0) -> None:
    """Create the topics (name -> partitions) that do not exist yet (replicated on 3+ brokers)."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                             **client_settings())
    try:
        existing = set(admin_call(admin.list_topics))
        rf, configs = cluster_replication(admin)
        new = [NewTopic(name, num_partitions=n, replication_factor=rf, topic_configs=configs)
               for name, n in topics.items() if name not in existing]
        if new:
            try:
                admin_call(admin.create_topics, new, timeout_ms=int(timeout_s * 1000))
            except TopicAlreadyExistsError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # wait until the metadata shows them
            if set(topics) <= set(admin_call(admin.list_topics)):
                return
            time.sleep(0.1)
    finally:
        admin.close()


def topic_partitions(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[int] | None:
    """The partition ids of a topic, or None when it does not exist (from a consumer's metadata request: the
    admin client's describe_topics answers differ across kafka-python versions). A connection lost during the
    request (a broker of the bootstrap list crashed: kafka-python raises rather than asking the next one) is
    retried with a new client for up to timeout_s."""
    from kafka.errors import KafkaConnectionError

    deadline = time.monotonic() + timeout_s
    while True:
        c = consumer(bootstrap)  # no broker reachable at all: the caller's error, at once
        try:
            parts = c.partitions_for_topic(topic)
            if parts is None:
                c.topics()
                parts = c.partitions_for_topic(topic)
            return sorted(parts) if parts else None
        except KafkaConnectionError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
        finally:
            c.close()
