"""Bench: the Kafka transport. JSON lines:

1. ``{"bench": "kafka.throughput", ...}`` per payload: payload MB/s through the project's channel
   (`KafkaTransport.send` -> `Consumer.poll`, Arrow IPC encode/decode included) against raw kafka-python
   produce + consume of the same payload bytes on the same broker, in the same run; ``ratio`` = ours / raw
   (best of the repeats on each side; ``ratio_median`` from the medians).
   Payloads: random float32 (incompressible) with and without the transport's lz4, and Cora-like sparse
   bag-of-words rows (what the first layer's tensor tasks carry), where lz4 pays.
2. ``{"bench": "kafka.epoch", ...}``: mean epoch seconds (after the first) of a 2-partition run with one process per role over
   Kafka (``dorylus train --transport kafka --spawn-local``) against the in-memory engine, same config, on the
   default synthetic graph and on a planted graph of ogbn-arxiv's size (169,343 vertices, 128 features, 40
   classes, GCN hidden 256: ``--epoch-graphs default,arxiv``), with the payload bytes per epoch on each channel
   and their ratio to the model's minimum (``summary.json`` ``wire``), once per ``--wire-dtype`` (float32 and
   bfloat16 rows by default; the minimum counts the format's bytes per value).

Without ``--bootstrap`` a private broker is started with infra/local/kafka.sh (and stopped at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

# This file is named like the kafka-python package: keep its own folder off the import path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from schemas.tasks import Channel  # noqa: E402 - after the path fix above


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def payloads(size_mb: float, rng):
    import numpy as np

    n = int(size_mb * 2**20 / 4)
    rows = max(1, n // 1433)
    dense = rng.standard_normal(n).astype(np.float32)
    sparse = np.zeros((rows, 1433), np.float32)  # ~18 words per row, row-normalized, like Cora's features
    for r in range(rows):
        idx = rng.choice(1433, 18, replace=False)
        sparse[r, idx] = 1.0 / 18
    return {"random": dense.reshape(-1, 256), "sparse-bow": sparse}


def raw_roundtrip(bootstrap: str, topic: str, values: list[bytes]) -> tuple[float, float]:
    """Seconds to produce (acks=all, flushed) and then consume `values` with plain kafka-python."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    prod = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=64 * 2**20 + 2**16,
                         batch_size=256 * 2**10, linger_ms=0)
    cons = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                         fetch_max_bytes=64 * 2**20 + 2**20, max_partition_fetch_bytes=8 * 2**20,
                         receive_message_max_bytes=130 * 2**20)
    tp = TopicPartition(topic, 0)
    cons.assign([tp])
    cons.poll(100)
    t0 = time.perf_counter()
    for v in values:
        prod.send(topic, value=v, partition=0)
    prod.flush()
    t1 = time.perf_counter()
    got = 0
    while got < len(values):
        for recs in cons.poll(1000).values():
            got += len(recs)
    t2 = time.perf_counter()
    prod.close()
    cons.close()
    return t1 - t0, t2 - t1


def ours_roundtrip(bootstrap: str, run_id: str, arrays: list, compression) -> tuple[float, float, int]:
    from schemas.tasks import Message
    from pipelines.transports.kafka import KafkaTransport

    t = KafkaTransport(bootstrap, run_id, 1, compression=compression)
    c = t.consumer([(Channel.GHOSTS, 0)], group="bench")
    c.poll(0.1)
    t0 = time.perf_counter()
    for i, a in enumerate(arrays):
        t.send(Channel.GHOSTS, 0, Message("AV", i, 0, 0, 0, 0, arrays={"h": a}))
    t.flush()
    t1 = time.perf_counter()
    got = 0
    while got < len(arrays):
        got += len(c.poll(1.0))
        c.commit()
    t2 = time.perf_counter()
    wire = t.stats()["bytes"].get(Channel.GHOSTS, 0)
    t.close()
    return t1 - t0, t2 - t1, wire


def bench_throughput(bootstrap: str, size_mb: float, count: int, repeats: int) -> None:
    import numpy as np
    from kafka import KafkaAdminClient

    rng = np.random.default_rng(0)
    for name, arr in payloads(size_mb, rng).items():
        arrays = [arr.copy() for _ in range(count)]
        for a in arrays:  # distinct values, same statistics
            a.flat[rng.integers(a.size)] += 1.0
        payload = sum(a.nbytes for a in arrays) / 1e6
        for compression in ([None, "lz4"] if name == "random" else ["lz4", None]):
            ours, raw, wire = [], [], 0
            for _ in range(repeats):  # alternate the two, so both see the same (shared) machine
                run = f"bench-{uuid.uuid4().hex[:8]}"
                ours_p, ours_c, wire = ours_roundtrip(bootstrap, run, arrays, compression)
                ours.append((ours_p, ours_c))
                raw_topic = f"dorylus.{run}.raw"
                admin = KafkaAdminClient(bootstrap_servers=bootstrap)
                admin.create_topics({raw_topic: {"num_partitions": 1, "replication_factor": 1,
                                                 "configs": {"max.message.bytes": str(64 * 2**20)}}})
                admin.wait_for_topics([raw_topic])
                admin.close()
                raw.append(raw_roundtrip(bootstrap, raw_topic, [a.tobytes() for a in arrays]))

            def rate(pairs, k=None):
                xs = [payload / (p + c if k is None else (p, c)[k]) for p, c in pairs]
                return max(xs), float(np.median(xs))

            (ob, om), (rb, rm) = rate(ours), rate(raw)
            row = {"bench": "kafka.throughput", "payload": name, "compression": compression or "none",
                   "message_mb": round(arrays[0].nbytes / 1e6, 3), "messages": count, "repeats": repeats,
                   "ours_mb_s": ob, "raw_mb_s": rb, "ratio": ob / rb,
                   "ours_mb_s_median": om, "raw_mb_s_median": rm, "ratio_median": om / rm,
                   "ours_produce_mb_s": rate(ours, 0)[0], "ours_consume_mb_s": rate(ours, 1)[0],
                   "raw_produce_mb_s": rate(raw, 0)[0], "raw_consume_mb_s": rate(raw, 1)[0],
                   "wire_mb": wire / 1e6}
            emit({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})


#: graphs of the epoch rows: (dataset spec or None for the default, GCN hidden width or None for the default)
EPOCH_GRAPHS = {"default": (None, None),
                "arxiv": ("synthetic:planted?nodes=169343&classes=40&degree=13.774&features=128", 256)}


def bench_epoch(bootstrap: str, epochs: int, partitions: int, intervals: int, graph_name: str = "default",
                arxiv_epochs: int = 6, wire_dtype: str = "float32") -> None:
    import dataclasses

    from pipelines.config import TrainConfig
    from pipelines.data.registry import load_dataset
    from pipelines.engine.runner import train_engine

    spec, hidden = EPOCH_GRAPHS[graph_name]
    graph = load_dataset(spec)
    cfg = TrainConfig(partitions=partitions, intervals=intervals, staleness=0, epochs=epochs, patience=0,
                      wire_dtype=wire_dtype)
    if hidden:
        cfg = dataclasses.replace(cfg, hidden=hidden)
    epochs = epochs if spec is None else min(epochs, arxiv_epochs)
    cfg = dataclasses.replace(cfg, epochs=epochs)
    mem = train_engine(cfg.resolved(), graph)  # both evaluate every epoch, as the Kafka driver does
    with tempfile.TemporaryDirectory() as d:
        argv = [sys.executable, "-m", "pipelines.cli", "train", "--partitions", str(partitions), "--intervals",
                str(intervals), "--staleness", "0", "--epochs", str(epochs), "--patience", "0", "--transport",
                "kafka", "--bootstrap", bootstrap, "--spawn-local", "--out", os.path.join(d, "run"), "--quiet",
                "--wire-dtype", wire_dtype]
        argv += (["--dataset", spec] if spec else []) + (["--hidden", str(hidden)] if hidden else [])
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"kafka run failed: {proc.stderr[-2000:]}")
        kaf = json.load(open(os.path.join(d, "run", "summary.json")))
        rows = [json.loads(ln) for ln in open(os.path.join(d, "run", "metrics.jsonl"))]

    def mean_epoch(hist):  # epochs after the first (which includes start-up and compilation)
        xs = [r["epoch_s"] for r in hist[1:]]
        return sum(xs) / len(xs)

    m, k = mean_epoch(mem.history), mean_epoch(rows)
    wk, wm = kaf.get("wire", {}), mem.summary.get("wire", {})
    emit({"bench": "kafka.epoch", "graph": graph.name, "nodes": graph.num_nodes, "load_average":
          [round(x, 2) for x in os.getloadavg()], "partitions": partitions, "intervals": intervals,
          "staleness": 0, "wire_dtype": wire_dtype, "epochs": epochs, "memory_epoch_s": round(m, 4), "kafka_epoch_s": round(k, 4),
          "slowdown": round(k / m, 2), "memory_first_epoch_s": round(mem.history[0]["epoch_s"], 2),
          "kafka_first_epoch_s": round(rows[0]["epoch_s"], 2), "kafka_shutdown_s": round(kaf["shutdown_s"], 2),
          "kafka_wall_s": round(wall, 1), "memory_test_acc": mem.summary["test_acc"],
          "kafka_test_acc": kaf["test_acc"],
          "memory_relaunches": mem.summary["relaunches"], "kafka_relaunches": kaf.get("relaunches"),
          "kafka_duplicates_skipped": kaf.get("duplicates_skipped"),
          "kafka_wire_mb": round(sum(kaf["transport"]["bytes"].values()) / 1e6, 2),
          "kafka_payload_mb": round(sum(kaf["transport"]["payload_bytes"].values()) / 1e6, 2),
          "kafka_deduplicated_mb": round(sum(kaf["transport"].get("deduplicated_bytes", {}).values()) / 1e6, 2),
          "kafka_payload_mb_per_epoch": {c: round(v / 1e6, 2) for c, v in wk.get("bytes_per_epoch", {}).items()},
          "minimum_mb_per_epoch": {c: round(v / 1e6, 2) for c, v in (wk.get("minimum_bytes_per_epoch") or {}).items()},
          "kafka_bytes_ratio_to_minimum": wk.get("ratio_to_minimum"),
          "memory_bytes_ratio_to_minimum": wm.get("ratio_to_minimum")})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", help="Kafka HOST:PORT (default: start a private broker)")
    p.add_argument("--message-mb", type=float, default=1.0, help="payload per message")
    p.add_argument("--messages", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per row, ours and raw alternating; best and median of each are reported")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--intervals", type=int, default=4)
    p.add_argument("--skip-epoch", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--arxiv-epochs", type=int, default=6, help="epochs of the arxiv-sized rows (at most --epochs)")
    p.add_argument("--epoch-graphs", default="default,arxiv",
                   help=f"comma-separated graphs of the epoch rows: {', '.join(EPOCH_GRAPHS)}")
    p.add_argument("--wire-dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="the epoch rows' wire formats (each graph once per format; memory and Kafka alike)")
    args = p.parse_args(argv)
    graphs = [g.strip() for g in args.epoch_graphs.split(",") if g.strip()]
    bad = [g for g in graphs if g not in EPOCH_GRAPHS]
    if bad:
        p.error(f"unknown --epoch-graphs {bad}; known: {', '.join(EPOCH_GRAPHS)}")
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        from tests.support.kafka import LocalKafka

        broker = LocalKafka()
        bootstrap = broker.start()
    try:
        if not args.skip_throughput:
            bench_throughput(bootstrap, args.message_mb, args.messages, args.repeats)
        if not args.skip_epoch:
            for g in graphs:
                for w in args.wire_dtype:
                    bench_epoch(bootstrap, args.epochs, args.partitions, args.intervals, g, args.arxiv_epochs, w)
    finally:
        if broker is not None:
            broker.close()
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
