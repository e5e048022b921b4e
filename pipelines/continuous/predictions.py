"""Predictions out: the logits of the vertices whose k-hop neighbourhood changed, as Arrow batches
(:mod:`schemas.predictions`) on a predictions topic, each round by the newest version on the new graph before
training and by the new version after it; and the reader behind `dorylus predictions`.

A vertex's output of a k-layer model depends on its k-hop neighbourhood: its features, its edges and the
degrees and features of vertices up to k hops away. So the vertices to publish after a version are those within
k hops (in the new graph) of a vertex whose features or edges changed since the previous version (a removed
edge's ends are among them; labels are not inputs). The `refresh` option publishes every vertex instead (the
weights of a new version change every output).
"""
from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from schemas.predictions import decode_predictions, encode_predictions, predictions_batch

ROWS_PER_MESSAGE = 20000


def khop(adj: sp.csr_matrix, rows: np.ndarray, k: int) -> np.ndarray:
    """The rows within k hops of `rows` (included), sorted."""
    n = adj.shape[0]
    mask = np.zeros(n, bool)
    mask[rows] = True
    frontier = mask.copy()
    for _ in range(k):
        if not frontier.any():
            break
        reach = (adj @ frontier.astype(np.float32)) > 0  # the adjacency is symmetric
        frontier = reach & ~mask
        mask |= reach
    return np.flatnonzero(mask)


def partition_of(vertex: np.ndarray, partitions: int) -> np.ndarray:
    return np.asarray(vertex, np.int64) % partitions


class Publisher:
    """Sends a version's predictions to the topic, rows grouped by topic partition (vertex mod partitions)."""

    def __init__(self, producer, topic: str, partitions: int):
        self.producer = producer
        self.topic = topic
        self.partitions = partitions

    def publish(self, vertex: np.ndarray, logits: np.ndarray, version: int, watermark_ms: int) -> dict:
        part = partition_of(vertex, self.partitions)
        messages = 0
        for p in range(self.partitions):
            idx = np.flatnonzero(part == p)
            for j in range(0, idx.size, ROWS_PER_MESSAGE):
                sel = idx[j:j + ROWS_PER_MESSAGE]
                value = encode_predictions(predictions_batch(vertex[sel], logits[sel], version, watermark_ms))
                self.producer.send(self.topic, value=value, partition=p)
                messages += 1
        self.producer.flush(timeout=60)
        return {"rows": int(vertex.size), "messages": messages, "published_ms": int(time.time() * 1000)}


def read_newest(bootstrap: str, topic: str, vertex: int, timeout_s: float = 10.0) -> dict | None:
    """The newest prediction of `vertex` on the topic (reads the vertex's partition to its end), or None."""
    from kafka import TopicPartition

    from pipelines.continuous import kafka_io

    parts = kafka_io.topic_partitions(bootstrap, topic)
    if not parts:
        raise LookupError(f"topic {topic!r} does not exist")
    c = kafka_io.consumer(bootstrap)
    try:
        tp = TopicPartition(topic, int(partition_of(np.array([vertex]), len(parts))[0]))
        c.assign([tp])
        c.seek_to_beginning(tp)
        end = c.end_offsets([tp])[tp]
        best = None
        deadline = time.monotonic() + timeout_s
        while c.position(tp) < end and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=200).values():
                for m in msgs:
                    t = decode_predictions(m.value)
                    hit = np.flatnonzero(t.column("vertex").to_numpy() == vertex)
                    if hit.size:
                        row = t.slice(int(hit[-1]), 1).to_pylist()[0]
                        # the newest version, then the newest graph (a version is published again, before
                        # the next one trains, for the vertices that changed since)
                        if best is None or (row["model_version"], row["watermark"]) >= (best["model_version"],
                                                                                         best["watermark"]):
                            best = row | {"offset": m.offset}
        return best
    finally:
        c.close()
