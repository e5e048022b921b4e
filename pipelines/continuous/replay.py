"""Replay a dataset as a timed stream of graph-change events (`dorylus replay`).

The dataset's undirected edges and its labels are shuffled (seeded) and cut into `slices` time slices of
`slice_ms` event time each. A vertex is added (with its feature row) in the first slice that mentions it, at
the slice's start; the slice's edges and labels are spread evenly over the slice. Vertices that no edge or
label mentions are added in slice 0. So after the last slice the stream has rebuilt the dataset exactly:
same vertex ids, features, edges, labels and train/val/test split.

Event ids are deterministic (``<prefix>/v/<vertex>``, ``<prefix>/e/<src>-<dst>``, ``<prefix>/l/<vertex>``), so
replaying a slice again sends the same ids and a consumer drops the repeats.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pyarrow as pa
import scipy.sparse as sp

from pipelines.data.graph import Graph
from schemas.events import EVENT_SCHEMA, events_batch, encode_events


@dataclasses.dataclass
class Slice:
    index: int
    start_ms: int
    events: pa.Table   # EVENT_SCHEMA, sorted by event time


def dataset_slices(graph: Graph, slices: int, start_ms: int, slice_ms: int, seed: int = 0,
                   prefix: str | None = None) -> list[Slice]:
    """The dataset as `slices` slices of events (see the module docstring)."""
    if slices < 1:
        raise ValueError(f"slices must be >= 1, got {slices}")
    prefix = prefix or graph.name
    rng = np.random.default_rng(seed)
    upper = sp.triu(graph.adj, k=1).tocoo()
    src, dst = upper.row.astype(np.int64), upper.col.astype(np.int64)
    perm = rng.permutation(src.size)
    src, dst = src[perm], dst[perm]
    edge_slice = np.minimum((np.arange(src.size) * slices) // max(src.size, 1), slices - 1)
    labelled = np.flatnonzero(graph.labels >= 0)
    labelled = labelled[rng.permutation(labelled.size)]
    label_slice = np.minimum((np.arange(labelled.size) * slices) // max(labelled.size, 1), slices - 1)
    n = graph.num_nodes
    first = np.full(n, slices, np.int64)  # sentinel: not mentioned
    np.minimum.at(first, src, edge_slice)
    np.minimum.at(first, dst, edge_slice)
    np.minimum.at(first, labelled, label_slice)
    first[first == slices] = 0
    split = np.full(n, "none", dtype=object)
    split[graph.train_mask] = "train"
    split[graph.val_mask] = "val"
    split[graph.test_mask] = "test"
    out = []
    for s in range(slices):
        t0 = start_ms + s * slice_ms
        parts = []
        verts = np.flatnonzero(first == s)
        if verts.size:
            parts.append(events_batch([f"{prefix}/v/{v}" for v in verts.tolist()], np.full(verts.size, t0),
                                      "add_vertex", verts, features=graph.features[verts]))
        es, ed = src[edge_slice == s], dst[edge_slice == s]
        lv = labelled[label_slice == s]
        m = es.size + lv.size
        # edges and labels interleaved over the slice, evenly spaced in event time
        order = np.random.default_rng([seed, s]).permutation(m)
        times = t0 + (np.arange(m) * slice_ms) // max(m, 1)
        et, lt = times[order[:es.size]], times[order[es.size:]]
        if es.size:
            parts.append(events_batch([f"{prefix}/e/{a}-{b}" for a, b in zip(es.tolist(), ed.tolist())], et,
                                      "add_edge", es, dst=ed))
        if lv.size:
            parts.append(events_batch([f"{prefix}/l/{v}" for v in lv.tolist()], lt, "set_label", lv,
                                      label=graph.labels[lv], split=split[lv].tolist()))
        table = pa.Table.from_batches(parts, schema=EVENT_SCHEMA) if parts else EVENT_SCHEMA.empty_table()
        table = table.sort_by([("event_time", "ascending")])
        out.append(Slice(s, t0, table))
    return out


def slice_messages(sl: Slice, topic_partitions: list[int], batch_size: int = 1000,
                   compression: str | None = None) -> list[tuple[int, bytes, int]]:
    """The messages of one slice as (topic partition, value, events): events grouped by topic partition
    (vertex id modulo the partition count), at most `batch_size` events per message (Arrow IPC buffers
    compressed with `compression`: None, lz4 or zstd)."""
    t = sl.events
    if t.num_rows == 0:
        return []
    vertex = t.column("vertex").to_numpy()
    target = vertex % len(topic_partitions)
    out = []
    for i, p in enumerate(topic_partitions):
        idx = np.flatnonzero(target == i)
        for j in range(0, idx.size, batch_size):
            chunk = t.take(pa.array(idx[j:j + batch_size])).combine_chunks()
            out.append((p, encode_events(chunk, compression), chunk.num_rows))
    return out


def send_slice(producer, topic: str, sl: Slice, topic_partitions: list[int], batch_size: int = 1000,
               compression: str | None = None) -> int:
    """Send one slice (see :func:`slice_messages`). Returns the number of messages sent."""
    msgs = slice_messages(sl, topic_partitions, batch_size, compression)
    for p, value, _ in msgs:
        producer.send(topic, value=value, partition=p)
    return len(msgs)


def replay(graph: Graph, bootstrap: str, topic: str, slices: int = 10, slice_s: float = 60.0,
           start_ms: int | None = None, pace_s: float = 0.0, seed: int = 0, first_slice: int = 0,
           last_slice: int | None = None, topic_partitions: int = 3, batch_size: int = 1000,
           prefix: str | None = None, log=None, compression: str | None = None) -> dict:
    """Produce the dataset's slices to `topic` (created with `topic_partitions` partitions when missing).

    start_ms: event time of slice 0 (default: now when pacing, else now rounded down to a whole slice).
    pace_s: wall-clock seconds per slice (0: as fast as possible); when pacing, slice k is sent (k+1) x pace_s
    after the start, so with pace_s equal to the slice's event-time span no event is sent before its time."""
    from pipelines.continuous import kafka_io

    slice_ms = max(1, int(round(slice_s * 1000)))
    if start_ms is None:
        now = int(time.time() * 1000)
        start_ms = now - now % slice_ms if pace_s == 0 else now
    kafka_io.ensure_topics(bootstrap, {topic: topic_partitions})
    parts = kafka_io.topic_partitions(bootstrap, topic) or list(range(topic_partitions))
    all_slices = dataset_slices(graph, slices, start_ms, slice_ms, seed, prefix)
    last = slices - 1 if last_slice is None else min(last_slice, slices - 1)
    producer = kafka_io.producer(bootstrap)
    events = messages = 0
    t_start = time.monotonic()
    try:
        for k, sl in enumerate(all_slices[first_slice:last + 1]):
            if pace_s > 0:  # a slice goes out once its event-time span has passed: no event from the future
                time.sleep(max(0.0, t_start + (k + 1) * pace_s - time.monotonic()))
            messages += send_slice(producer, topic, sl, parts, batch_size, compression)
            events += sl.events.num_rows
            producer.flush()
            if log:
                log(f"slice {sl.index}: {sl.events.num_rows} events at {sl.start_ms}")
    finally:
        producer.close()
    return {"topic": topic, "events": events, "messages": messages, "slices": [first_slice, last],
            "start_ms": start_ms, "slice_ms": slice_ms, "seconds": time.monotonic() - t_start,
            "num_classes": graph.num_classes, "feature_dim": graph.feature_dim, "nodes": graph.num_nodes,
            "edges": graph.num_edges // 2}
