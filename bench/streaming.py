"""Bench: continuous training from Kafka (`dorylus stream`), JSON lines.

1. ingest: a synthetic graph (planted partition) is produced to a topic up front as 4 event-time slices; the
   stream starts, the first round fires as soon as the watermark passes slice 0, and while that round trains
   the ingest thread keeps reading the backlog. Reported: events/s ingested while a round was training
   (sampled every 20 ms), and events/s over the whole backlog.
2. lag: Cora replayed in real time (event time = wall clock, one slice every --lag-slice-s seconds, each slice
   sent once its span has passed). For every applied event: the wall time of the first model version that
   contains it minus its event time. Reported per round and over all events (p50/p95/max), also without the
   final round (which waits --until-idle seconds for the stream to go quiet).

Uses $DORYLUS_KAFKA_BOOTSTRAP or --bootstrap, else starts a private broker with infra/local/kafka.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# bench/ holds a kafka.py (the transport bench) that would shadow the kafka-python package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))


def emit(obj: dict) -> None:
    print(json.dumps({"bench": "streaming", **obj}), flush=True)


def start_broker(state: str) -> str:
    out = subprocess.run(["bash", str(REPO / "infra/local/kafka.sh"), "start", "--state-dir", state,
                          "--owner-pid", str(os.getpid())], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def stop_broker(state: str) -> None:
    subprocess.run(["bash", str(REPO / "infra/local/kafka.sh"), "stop", "--state-dir", state],
                   capture_output=True, text=True)


def bench_ingest(bootstrap: str, args, cfg) -> None:
    import numpy as np

    from pipelines.continuous.replay import replay
    from pipelines.continuous.stream import Stream, StreamOptions
    from pipelines.data.synthetic import planted_partition

    graph = planted_partition(num_nodes=args.ingest_nodes, num_classes=7, avg_degree=args.ingest_degree,
                              feature_dim=args.ingest_features, seed=0)
    topic = f"bench-ingest-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    # Many small slices: round 1 fires after the first, tiny one, and the rounds train while the ingest thread
    # reads the rest of the backlog.
    sent = replay(graph, bootstrap, topic, slices=args.ingest_slices, slice_s=1.0, start_ms=1_700_000_000_000,
                  topic_partitions=args.topic_partitions, batch_size=args.batch_size)
    produce_s = time.perf_counter() - t0
    emit({"phase": "ingest", "what": "produced", "events": sent["events"], "messages": sent["messages"],
          "produce_s": produce_s, "produce_eps": sent["events"] / produce_s, "nodes": graph.num_nodes,
          "edges": graph.num_edges // 2, "features": graph.feature_dim})
    with tempfile.TemporaryDirectory() as out:
        opts = StreamOptions(bootstrap=bootstrap, events_topic=topic, out=out, models_topic=f"{topic}-models",
                             round_interval_s=1.0, first_round_epochs=args.ingest_epochs,
                             round_epochs=args.ingest_epochs, until_idle_s=2.0, num_classes=7, catch_up="skip",
                             min_train_labels=1, min_train_classes=2)  # train from round 1: ingest vs training
        stream = Stream(opts, cfg)
        samples = []
        done = threading.Event()

        def sample():
            while not done.is_set():
                with stream.lock:
                    n = stream.counters["ingested"]
                samples.append((time.perf_counter(), n, stream.training))
                time.sleep(0.02)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t_start = time.perf_counter()
        summary = stream.run()
        done.set()
        th.join()
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    total = sent["events"]
    t = np.array([s[0] for s in samples])
    n = np.array([s[1] for s in samples])
    tr = np.array([s[2] for s in samples])
    first = int(np.argmax(n > 0)) if (n > 0).any() else 0
    full = int(np.argmax(n >= total)) if (n >= total).any() else len(n) - 1
    # while training and the backlog was not drained
    dt = np.diff(t)
    dn = np.diff(n)
    during = tr[1:] & tr[:-1] & (n[:-1] < total)
    eps_training = float(dn[during].sum() / dt[during].sum()) if during.any() and dt[during].sum() > 0 else None
    idle = ~tr[1:] & ~tr[:-1] & (n[:-1] < total) & (n[:-1] > 0)
    eps_not_training = float(dn[idle].sum() / dt[idle].sum()) if idle.any() and dt[idle].sum() > 0 else None
    emit({"phase": "ingest", "what": "consumed", "events": int(n[-1]), "backlog_s": float(t[full] - t[first]),
          "eps_backlog": float((n[full] - n[first]) / max(t[full] - t[first], 1e-9)),
          "eps_while_training": eps_training, "eps_while_not_training": eps_not_training,
          "not_training_s_sampled": float(dt[idle].sum()) if idle.any() else 0.0, "training_s_sampled": float(dt[during].sum()) if during.any() else 0.0,
          "events_read_while_training": int(dn[during].sum()) if during.any() else 0,
          "rounds": summary["rounds"], "first_round_train_s": rows[0].get("train_s"),
          "first_round_epochs": rows[0].get("epochs"), "engine": rows[0].get("engine"),
          "train_s_total": float(sum(r.get("train_s") or 0 for r in rows)),
          "final_nodes": rows[-1]["nodes"],
          "wall_s": time.perf_counter() - t_start, "applied": summary["counters"]["applied"]})


def bench_lag(bootstrap: str, args, cfg) -> None:
    import numpy as np

    from pipelines.continuous.replay import replay
    from pipelines.continuous.stream import Stream, StreamOptions
    from pipelines.data.registry import load_dataset

    graph = load_dataset(args.lag_dataset, args.data_dir)
    topic = f"bench-lag-{uuid.uuid4().hex[:8]}"
    until_idle = args.until_idle or 2 * args.lag_slice_s + 1.0
    with tempfile.TemporaryDirectory() as out:
        opts = StreamOptions(bootstrap=bootstrap, events_topic=topic, out=out, models_topic=f"{topic}-models",
                             round_interval_s=args.lag_slice_s, first_round_epochs=args.lag_first_epochs,
                             round_epochs=args.lag_round_epochs, until_idle_s=until_idle, catch_up="skip",
                             num_classes=graph.num_classes)
        from pipelines.continuous import kafka_io

        kafka_io.ensure_topics(bootstrap, {topic: args.topic_partitions})
        stream = Stream(opts, cfg)
        res = {}
        th = threading.Thread(target=lambda: res.update(stream.run()))
        th.start()
        sent = replay(graph, bootstrap, topic, slices=args.lag_slices, slice_s=args.lag_slice_s,
                      pace_s=args.lag_slice_s, topic_partitions=args.topic_partitions)
        th.join()
        if not (Path(out) / "metrics.jsonl").exists():
            emit({"phase": "lag", "what": "error", "summary": res, "sent": sent,
                  "status": json.loads((Path(out) / "status.json").read_text())})
            return
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        from pipelines.continuous.stream import read_applied

        applied = read_applied(out).to_pydict()
        reasons = _dead_letter_reasons(bootstrap, f"{topic}.dlq") if res.get("counters", {}).get("dead_letters") \
            else {}
    for r in rows:
        emit({"phase": "lag", "what": "round", **{k: r.get(k) for k in (
            "round", "final", "events", "nodes", "edges", "train_s", "round_s", "test_acc", "lag_s_min",
            "lag_s_p50", "lag_s_p95", "lag_s_max", "ingest_eps_during_training")}})
    # per-event lag from the journals, using the version time of the round that applied it
    # the first model version containing an event: that of the first round at or after the one applying it
    # which trained
    vt, nxt = {}, None
    for r in reversed(rows):
        nxt = r.get("version_time_ms") or nxt
        vt[r["round"]] = nxt
    slices_times = _event_times(graph, args, sent)
    lags, lags_nf = [], []
    final_round = rows[-1]["round"] if rows and rows[-1]["final"] else None
    for eid, rnd, outc in zip(applied["event_id"], applied["round"], applied["outcome"]):
        if outc != "applied" or vt.get(rnd) is None:
            continue
        lag = (vt[rnd] - slices_times[eid]) / 1000.0
        lags.append(lag)
        if rnd != final_round:
            lags_nf.append(lag)

    def stats(x):
        x = np.asarray(x)
        return {"n": int(x.size), "p50": float(np.median(x)), "p95": float(np.percentile(x, 95)),
                "max": float(x.max()), "mean": float(x.mean())} if x.size else {"n": 0}

    emit({"phase": "lag", "what": "summary", "dataset": graph.name, "slices": args.lag_slices,
          "slice_s": args.lag_slice_s, "round_epochs": args.lag_round_epochs, "events": sent["events"],
          "rounds": res.get("rounds"), "final_test_acc": rows[-1].get("test_acc") if rows else None,
          "lag_s": stats(lags), "lag_s_excluding_final_round": stats(lags_nf), "until_idle_s": until_idle,
          "counters": res.get("counters"), "dead_letter_reasons": reasons})


def _dead_letter_reasons(bootstrap: str, topic: str) -> dict:
    """Dead letters by reason (first words), read back from the dead-letter topic."""
    import collections

    import pyarrow as pa
    from kafka import TopicPartition

    from pipelines.continuous import kafka_io

    c = kafka_io.consumer(bootstrap)
    tp = TopicPartition(topic, 0)
    c.assign([tp])
    c.seek_to_beginning(tp)
    out = collections.Counter()
    for msgs in c.poll(timeout_ms=3000).values():
        for m in msgs:
            h = dict(m.headers)
            if h.get("dorylus.kind") == b"events":
                for r in pa.ipc.open_stream(m.value).read_all().column("reason").to_pylist():
                    out[" ".join(r.split(" ")[:2])] += 1
            else:
                out[h.get("dorylus.reason", b"?").decode()[:60]] += 1
    c.close()
    return dict(out)


def _event_times(graph, args, sent) -> dict:
    from pipelines.continuous.replay import dataset_slices

    out = {}
    for s in dataset_slices(graph, args.lag_slices, sent["start_ms"], sent["slice_ms"]):
        ids = s.events.column("event_id").to_pylist()
        ts = s.events.column("event_time").cast("int64").to_pylist()
        out.update(zip(ids, ts))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", default=os.environ.get("DORYLUS_KAFKA_BOOTSTRAP"))
    p.add_argument("--data-dir", default=os.environ.get("DORYLUS_DATA_DIR", str(REPO.parent / "shared/datasets")))
    p.add_argument("--topic-partitions", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1000, help="events per Kafka message")
    p.add_argument("--partitions", type=int, default=1, help="engine partitions (1: whole-graph trainer)")
    p.add_argument("--staleness", default="none")
    p.add_argument("--ingest-nodes", type=int, default=100000)
    p.add_argument("--ingest-slices", type=int, default=20)
    p.add_argument("--ingest-degree", type=float, default=10.0)
    p.add_argument("--ingest-features", type=int, default=32)
    p.add_argument("--ingest-epochs", type=int, default=20, help="epochs per round while the backlog is read")
    p.add_argument("--lag-dataset", default="cora")
    p.add_argument("--lag-slices", type=int, default=10)
    p.add_argument("--lag-slice-s", type=float, default=3.0)
    p.add_argument("--lag-first-epochs", type=int, default=50)
    p.add_argument("--lag-round-epochs", type=int, default=20)
    p.add_argument("--until-idle", type=float, help="(lag) default: 2 x slice + 1 s")
    p.add_argument("--skip-ingest", action="store_true")
    p.add_argument("--skip-lag", action="store_true")
    args = p.parse_args(argv)

    from pipelines.config import TrainConfig, parse_staleness

    cfg = TrainConfig(partitions=args.partitions, staleness=parse_staleness(args.staleness)).resolved()
    state = None
    bootstrap = args.bootstrap
    if not bootstrap:
        state = tempfile.mkdtemp(prefix="bench-kafka-")
        bootstrap = start_broker(state)
    try:
        emit({"phase": "setup", "bootstrap": bootstrap, "partitions": cfg.partitions,
              "staleness": args.staleness, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]})
        if not args.skip_ingest:
            bench_ingest(bootstrap, args, cfg)
        if not args.skip_lag:
            bench_lag(bootstrap, args, cfg)
    finally:
        if state:
            stop_broker(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
