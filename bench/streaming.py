"""Bench: continuous training from Kafka (`dorylus stream`), JSON lines.

1. ingest + memory: a synthetic graph (planted partition) is produced to a topic up front as event-time slices
   (--ingest-nodes x --ingest-degree: 10M events by default), in messages of --batch-size events. Two streams
   read it:
   a. *not training*: the first training waits for more labels than the stream has, so every round only applies
      events: events/s from the topic into the pending buffer and, per round, into the graph.
   b. *training*: a producer process (pre-encoded messages) sends a second copy of the graph while the stream
      runs, paced at --live-eps events/s, then --live-tail-s seconds of feature updates of its vertices (the
      graph keeps its size), so events keep arriving while rounds (one per --train-round-s of event time) train:
      events/s sampled (every 20 ms) while a round trains and while none does, beside the rate offered and the
      consumer's backlog; per round the process RSS, the graph state's bytes per vertex and per edge, the dedupe
      state's ids, XLA compiles and the capacity buckets, and the checkpoint bytes against the events of the
      round.
2. lag: Cora replayed in real time (event time = wall clock, one slice every --lag-slice-s seconds). For every
   applied event that changes a model input (not a label): the broker timestamp of the first message on the
   predictions topic that holds its vertex on a graph containing the event (any model version: the newest
   version's predictions go out before the next version trains), minus its event time; also to the first by a
   version trained on the event; both for all events and for those after the cold round ("warm": the first
   training compiles the model); beside them, each round's training time.

Uses $DORYLUS_KAFKA_BOOTSTRAP or --bootstrap, else starts a private broker with infra/local/kafka.sh. Every line
carries the 1-minute load average (the machine is shared).
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
    print(json.dumps({"bench": "streaming", "load_avg_1m": os.getloadavg()[0], **obj}), flush=True)


def start_broker(state: str) -> str:
    out = subprocess.run(["bash", str(REPO / "infra/local/kafka.sh"), "start", "--state-dir", state,
                          "--owner-pid", str(os.getpid())], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def stop_broker(state: str) -> None:
    subprocess.run(["bash", str(REPO / "infra/local/kafka.sh"), "stop", "--state-dir", state],
                   capture_output=True, text=True)


def _sampled_stream(opts, cfg, started=None):
    """Run a stream, sampling (time, ingested, training, backlog messages) every 20 ms; returns summary, metrics
    rows, samples. started(): called once the stream runs (in its own thread)."""
    from pipelines.continuous.stream import Stream

    stream = Stream(opts, cfg)
    samples = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            with stream.lock:
                n = stream.counters["ingested"]
                backlog = sum(max(0, e - stream.positions.get(p, 0)) for p, e in stream.ends.items())
            samples.append((time.perf_counter(), n, stream.training, backlog))
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    if started is not None:
        threading.Timer(0.2, started).start()
    try:
        summary = stream.run()
    finally:
        done.set()
        th.join()
    rows = [json.loads(line) for line in (Path(opts.out) / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, samples


def _rates(samples, total):
    import numpy as np

    t = np.array([s[0] for s in samples])
    n = np.array([s[1] for s in samples])
    tr = np.array([s[2] for s in samples])
    dt, dn = np.diff(t), np.diff(n)
    busy = (n[:-1] < total) & (n[:-1] > 0)  # the backlog is being read

    def rate(m):
        return (float(dn[m].sum() / dt[m].sum()) if m.any() and dt[m].sum() > 0 else None), float(dt[m].sum())

    first = int(np.argmax(n > 0)) if (n > 0).any() else 0
    full = int(np.argmax(n >= total)) if (n >= total).any() else len(n) - 1
    eps_train, s_train = rate(busy & tr[1:] & tr[:-1])
    eps_idle, s_idle = rate(busy & ~tr[1:] & ~tr[:-1])
    backlog = np.array([s[3] for s in samples])[1:]
    both = busy & tr[1:] & tr[:-1]
    extra = {"backlog_messages_median_while_training": float(np.median(backlog[both])) if both.any() else None,
             "backlogged_share_while_training": float((backlog[both] > 0).mean()) if both.any() else None}
    return {**extra, "eps_backlog": float((n[full] - n[first]) / max(t[full] - t[first], 1e-9)),
            "backlog_s": float(t[full] - t[first]), "eps_while_training": eps_train, "training_s_sampled": s_train,
            "eps_while_not_training": eps_idle, "not_training_s_sampled": s_idle}


def bench_ingest(bootstrap: str, args, cfg) -> None:
    import numpy as np

    from pipelines.continuous.replay import replay
    from pipelines.continuous.stream import StreamOptions
    from pipelines.data.synthetic import planted_partition

    topic = f"bench-ingest-{uuid.uuid4().hex[:8]}"
    common = dict(bootstrap=bootstrap, round_interval_s=1.0, until_idle_s=3.0, num_classes=7,
                  catch_up="skip", predict="none")
    if not args.skip_not_training:
        graph = planted_partition(num_nodes=args.ingest_nodes, num_classes=7, avg_degree=args.ingest_degree,
                                  feature_dim=args.ingest_features, seed=0)
        t0 = time.perf_counter()
        sent = replay(graph, bootstrap, topic, slices=args.ingest_slices, slice_s=1.0, start_ms=1_700_000_000_000,
                      topic_partitions=args.topic_partitions, batch_size=args.batch_size,
                      compression=None if args.compression == "none" else args.compression)
        produce_s = time.perf_counter() - t0
        emit({"phase": "ingest", "what": "produced", "events": sent["events"], "messages": sent["messages"],
              "batch_size": args.batch_size, "compression": args.compression, "produce_s": produce_s,
              "produce_eps": sent["events"] / produce_s,
              "nodes": graph.num_nodes, "edges": graph.num_edges // 2, "features": graph.feature_dim})
        del graph
        bench_not_training(args, cfg, {**common, "events_topic": topic}, topic, sent["events"])
    live = f"{topic}-live"
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--produce-child", live,
                              "--bootstrap", bootstrap] + _ingest_argv(args),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = json.loads(child.stdout.readline())  # the messages are encoded and the topic exists
    total = ready["events"]
    emit({"phase": "ingest", "what": "live producer ready", **ready})

    def go():
        child.stdin.write("go\n")
        child.stdin.flush()

    with tempfile.TemporaryDirectory() as out:  # b. training while the producer sends
        # rounds of --train-round-s of event time (catch-up skips to the last complete window: the producer
        # outruns training); ids are kept 2 windows (the dedupe state drops the older ones during the run)
        opts = StreamOptions(out=out, events_topic=live, models_topic=f"{topic}-models-b",
                             first_round_epochs=args.ingest_epochs,
                             round_epochs=args.ingest_epochs, min_train_labels=1, min_train_classes=2,
                             full_checkpoint_every=args.full_every,
                             **{**common, "round_interval_s": args.train_round_s,
                                "dedupe_retention_s": 2 * args.train_round_s})
        try:
            summary, rows, samples = _sampled_stream(opts, cfg, started=go)
        finally:
            produced = json.loads(child.stdout.readline() or "{}")
            child.wait(timeout=60)
    emit({"phase": "ingest", "what": "live producer done", **produced})
    for r in rows:
        emit({"phase": "memory", "what": "round", **{k: r.get(k) for k in (
            "round", "events", "nodes", "edges", "rss_bytes", "graph_bytes", "dedupe_ids", "dedupe_bytes", "compiles",
            "bucket_growths", "capacity_nodes", "capacity_entries", "checkpoint_kind", "checkpoint_bytes",
            "train_s", "apply_s", "round_s", "ingest_eps_during_training")},
            "checkpoint_bytes_per_event": r["checkpoint_bytes"] / max(r["events"], 1)})
    first, last = rows[0], rows[-1]

    def per(r):
        return {"nodes": r["nodes"], "edges": r["edges"], "rss_bytes": r["rss_bytes"],
                "rss_per_vertex": r["rss_bytes"] / max(r["nodes"], 1), "rss_per_edge": r["rss_bytes"] / max(r["edges"], 1),
                "graph_state": _state_split(r, args.ingest_features)}

    deltas = [r for r in rows if r.get("checkpoint_kind") == "delta" and r["events"]]
    ratio = np.array([r["checkpoint_bytes"] / r["events"] for r in deltas]) if deltas else np.zeros(0)
    compiles = [r["compiles"] for r in rows]
    growth = np.diff([0] + [r.get("bucket_growths") or 0 for r in rows])
    emit({"phase": "ingest", "what": "training", "events": summary["counters"]["ingested"],
          "offered_eps": produced.get("eps"), **_rates(samples, total), "rounds": len(rows), "trained_rounds": sum("train_s" in r for r in rows),
          "train_s_total": float(sum(r.get("train_s") or 0 for r in rows)), "load_avg_1m": os.getloadavg()[0]})
    emit({"phase": "memory", "what": "summary", "events": summary["counters"]["ingested"],
          "nodes": last["nodes"], "edges": last["edges"], "start": per(first), "end": per(last),
          "rss_start": first["rss_bytes"], "rss_end": last["rss_bytes"], "rss_max": max(r["rss_bytes"] for r in rows),
          "dedupe_ids_max": max(r["dedupe_ids"] for r in rows), "dedupe_ids_end": last["dedupe_ids"],
          "dedupe_bytes_max": max(r.get("dedupe_bytes", 16 * r["dedupe_ids"]) for r in rows),
          "checkpoint_bytes_per_event_delta": {"min": float(ratio.min()), "median": float(np.median(ratio)),
                                               "max": float(ratio.max())} if ratio.size else None,
          "compiles_total": int(sum(compiles)), "bucket_growths": int(growth.sum()),
          "rounds_compiling_without_growth": int(sum(1 for c, g in zip(compiles, growth) if c and not g)),
          "load_avg_1m": os.getloadavg()[0]})


def _ingest_argv(args) -> list[str]:
    return ["--ingest-nodes", str(args.ingest_nodes), "--ingest-slices", str(args.ingest_slices),
            "--ingest-degree", str(args.ingest_degree), "--ingest-features", str(args.ingest_features),
            "--topic-partitions", str(args.topic_partitions), "--batch-size", str(args.batch_size),
            "--compression", args.compression, "--live-eps", str(args.live_eps),
            "--live-tail-s", str(args.live_tail_s)]


def produce_child(args) -> int:
    """The live producer (its own process, as a real one is): encode every message first, print a JSON line,
    wait for a line on stdin, then send paced at --live-eps events/s; print a JSON line of what was sent."""
    import numpy as np
    import pyarrow as pa

    from pipelines.continuous import kafka_io
    from pipelines.continuous.replay import Slice, dataset_slices, slice_messages
    from pipelines.data.synthetic import planted_partition
    from schemas.events import events_batch

    graph = planted_partition(num_nodes=args.ingest_nodes, num_classes=7, avg_degree=args.ingest_degree,
                              feature_dim=args.ingest_features, seed=0)
    start_ms = 1_700_000_000_000
    kafka_io.ensure_topics(args.bootstrap, {args.produce_child: args.topic_partitions})
    parts = kafka_io.topic_partitions(args.bootstrap, args.produce_child)
    comp = None if args.compression == "none" else args.compression
    msgs = [m for sl in dataset_slices(graph, args.ingest_slices, start_ms, 1000)
            for m in slice_messages(sl, parts, args.batch_size, comp)]
    rng = np.random.default_rng(1)
    n_tail = int(args.live_tail_s)  # a slice per second of event time: feature updates of random vertices
    per = int(args.live_eps) if args.live_eps > 0 else 1_000_000
    for k in range(n_tail):  # (one slice's table at a time: the encoded messages are what is kept)
        s = args.ingest_slices + k
        v = rng.integers(0, graph.num_nodes, per)
        t = events_batch([f"u/{s}/{i}" for i in range(per)], start_ms + s * 1000 + (np.arange(per) * 1000) // per,
                         "update_features", v, features=rng.standard_normal((per, graph.feature_dim), np.float32))
        msgs += slice_messages(Slice(s, start_ms + s * 1000, pa.Table.from_batches([t])), parts, args.batch_size,
                               comp)
    del graph
    total = sum(m[2] for m in msgs)
    print(json.dumps({"events": total, "messages": len(msgs), "tail_s": n_tail, "paced_eps": args.live_eps,
                      "compression": args.compression}), flush=True)
    sys.stdin.readline()
    producer = kafka_io.producer(args.bootstrap)
    t0 = time.perf_counter()
    sent = 0
    for p, value, rows in msgs:
        producer.send(args.produce_child, value=value, partition=p)
        sent += rows
        if args.live_eps > 0:
            time.sleep(max(0.0, t0 + sent / args.live_eps - time.perf_counter()))
    producer.flush()
    dt = time.perf_counter() - t0
    producer.close()
    print(json.dumps({"events": sent, "seconds": dt, "eps": sent / dt}), flush=True)
    return 0


def bench_not_training(args, cfg, common: dict, topic: str, total: int) -> None:
    import numpy as np

    from pipelines.continuous.stream import StreamOptions

    with tempfile.TemporaryDirectory() as out:  # a. not training: no round has enough labels before the last
        opts = StreamOptions(out=out, models_topic=f"{topic}-models-a", first_round_epochs=1,
                             min_train_labels=10 ** 12, **common)
        summary, rows, samples = _sampled_stream(opts, cfg)
    applied = [r for r in rows if not r["final"]]
    emit({"phase": "ingest", "what": "not training", "events": summary["counters"]["ingested"],
          **_rates(samples, total), "rounds": len(rows),
          "apply_eps_median": float(np.median([r["apply_eps"] for r in applied if r["events"]])) if applied else None,
          "apply_s_total": float(sum(r["apply_s"] for r in rows)), "load_avg_1m": os.getloadavg()[0]})


def _state_split(r, dim: int) -> dict:
    """The graph state's bytes: per vertex (id, feature row, label, split, id index) and per edge (one key)."""
    per_vertex = 8 + 4 * dim + 4 + 1 + 16 + 4  # (+4: the dense id -> slot map while ids are small)
    return {"per_vertex": per_vertex, "per_edge": 8,
            "capacity_slack": r["graph_bytes"] / max(per_vertex * r["nodes"] + 8 * r["edges"], 1)}


def bench_lag(bootstrap: str, args, cfg) -> None:
    import numpy as np

    from pipelines.continuous import kafka_io
    from pipelines.continuous.replay import dataset_slices, replay
    from pipelines.continuous.stream import Stream, StreamOptions, read_applied
    from pipelines.data.registry import load_dataset

    graph = load_dataset(args.lag_dataset, args.data_dir)
    topic = f"bench-lag-{uuid.uuid4().hex[:8]}"
    until_idle = args.until_idle or 2 * args.lag_slice_s + 5.0  # the producer may start slowly on a busy machine
    with tempfile.TemporaryDirectory() as out:
        opts = StreamOptions(bootstrap=bootstrap, events_topic=topic, out=out, models_topic=f"{topic}-models",
                             round_interval_s=args.lag_slice_s, first_round_epochs=args.lag_first_epochs,
                             round_epochs=args.lag_round_epochs, until_idle_s=until_idle, catch_up="skip",
                             num_classes=graph.num_classes)
        kafka_io.ensure_topics(bootstrap, {topic: args.topic_partitions})
        stream = Stream(opts, cfg)
        res = {}
        th = threading.Thread(target=lambda: res.update(stream.run()))
        th.start()
        # history: the first --lag-warmup-slices at once (their event times just before now); once the stream has
        # its first version (the cold round compiles), the rest in real time, event time = wall clock
        slice_ms = max(1, int(round(args.lag_slice_s * 1000)))
        w = min(args.lag_warmup_slices, args.lag_slices - 1)
        starts = [int(time.time() * 1000) - w * slice_ms]
        if w:
            replay(graph, bootstrap, topic, slices=args.lag_slices, slice_s=args.lag_slice_s, start_ms=starts[0],
                   last_slice=w - 1, topic_partitions=args.topic_partitions)
            deadline = time.monotonic() + 600
            while not (Path(out) / "models" / "latest.json").exists() and th.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        starts.append(int(time.time() * 1000) - w * slice_ms)
        sent = replay(graph, bootstrap, topic, slices=args.lag_slices, slice_s=args.lag_slice_s,
                      start_ms=starts[1], first_slice=w, pace_s=args.lag_slice_s, topic_partitions=args.topic_partitions)
        th.join()
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        applied = read_applied(out).to_pydict()
    published = _published(bootstrap, stream.predictions_topic)
    vt, nxt = {}, None  # the version containing the events of each round: the first trained at or after it
    for r in reversed(rows):
        nxt = r["version"] if r.get("train_s") is not None else nxt
        vt[r["round"]] = nxt
    wm_of = {r["round"]: r.get("prediction_watermark_ms") for r in rows}  # the graph cut a round predicted on
    trained = [r for r in rows if r.get("train_s") is not None]
    # the cold round compiles the model; events up to its end wait for it (reported, and left out of "warm")
    cold_end_ms = trained[0]["version_time_ms"] if trained else None
    events = {}
    for s in dataset_slices(graph, args.lag_slices, starts[0], slice_ms)[:w] + \
            dataset_slices(graph, args.lag_slices, starts[1], slice_ms)[w:]:
        t = s.events
        events.update(zip(t.column("event_id").to_pylist(), zip(
            t.column("event_time").cast("int64").to_pylist(), t.column("vertex").to_pylist(),
            t.column("op").to_pylist())))
    final_round = rows[-1]["round"] if rows and rows[-1]["final"] else None
    lag = {k: [] for k in ("any", "any_warm", "version", "version_warm", "any_nonfinal")}
    for eid, rnd, outc in zip(applied["event_id"], applied["round"], applied["outcome"]):
        et, v, op = events[eid]
        if outc != "applied" or op == "set_label" or wm_of.get(rnd) is None:
            continue
        hits = published.get(v, [])
        # the first prediction of the vertex on a graph that holds the event (any version), and the first by a
        # version trained on it
        ts = min((t for ver, w, t in hits if w >= wm_of[rnd]), default=None)
        tv = min((t for ver, w, t in hits if vt.get(rnd) is not None and ver >= vt[rnd]), default=None)
        warm = cold_end_ms is not None and et > cold_end_ms
        if ts is not None:
            lag["any"].append((ts - et) / 1000.0)
            if warm:
                lag["any_warm"].append(lag["any"][-1])
            if rnd != final_round:
                lag["any_nonfinal"].append(lag["any"][-1])
        if tv is not None:
            lag["version"].append((tv - et) / 1000.0)
            if warm:
                lag["version_warm"].append(lag["version"][-1])
    train = [r["train_s"] for r in trained if not r["final"]]
    train_warm = [r["train_s"] for r in trained[1:] if not r["final"]]
    for r in rows:
        emit({"phase": "lag", "what": "round", **{k: r.get(k) for k in (
            "round", "final", "events", "nodes", "edges", "train_s", "prompt_predict_s", "predict_s", "round_s",
            "compiles", "prompt_predicted", "predicted", "prompt_prediction_lag_s_p50", "prediction_lag_s_p50",
            "lag_s_p50", "test_acc")}})

    def stats(x):
        x = np.asarray(x)
        return {"n": int(x.size), "p50": float(np.median(x)), "p95": float(np.percentile(x, 95)),
                "max": float(x.max())} if x.size else {"n": 0}

    emit({"phase": "lag", "what": "summary", "dataset": graph.name, "slices": args.lag_slices,
          "slice_s": args.lag_slice_s, "round_epochs": args.lag_round_epochs, "warmup_slices": w, "events": len(events),
          "rounds": res.get("rounds"), "trained_rounds": len(trained),
          "final_test_acc": rows[-1].get("test_acc") if rows else None,
          "cold_round_train_s": trained[0]["train_s"] if trained else None,
          "event_to_prediction_lag_s": stats(lag["any"]), "excluding_final_round": stats(lag["any_nonfinal"]),
          "event_to_prediction_lag_s_warm": stats(lag["any_warm"]),
          "event_to_trained_version_prediction_lag_s": stats(lag["version"]),
          "event_to_trained_version_prediction_lag_s_warm": stats(lag["version_warm"]),
          "train_s_median": float(np.median(train)) if train else None,
          "train_s_median_warm": float(np.median(train_warm)) if train_warm else None, "until_idle_s": until_idle,
          "counters": res.get("counters"), "load_avg_1m": os.getloadavg()[0]})


def _published(bootstrap: str, topic: str) -> dict:
    """vertex -> [(model_version, watermark ms, broker timestamp ms)] of every prediction on the topic."""
    from kafka import TopicPartition

    from pipelines.continuous import kafka_io
    from schemas.predictions import decode_predictions

    parts = kafka_io.topic_partitions(bootstrap, topic) or []
    c = kafka_io.consumer(bootstrap)
    tps = [TopicPartition(topic, p) for p in parts]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    ends = c.end_offsets(tps)
    out: dict = {}
    while any(c.position(tp) < ends[tp] for tp in tps):
        for msgs in c.poll(timeout_ms=500).values():
            for m in msgs:
                t = decode_predictions(m.value)
                ver = t.column("model_version")[0].as_py()
                wm = t.column("watermark").cast("int64")[0].as_py()
                for v in t.column("vertex").to_pylist():
                    out.setdefault(v, []).append((ver, wm, m.timestamp))
    c.close()
    for v in out:
        out[v].sort()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", default=os.environ.get("DORYLUS_KAFKA_BOOTSTRAP"))
    p.add_argument("--data-dir", default=os.environ.get("DORYLUS_DATA_DIR", str(REPO.parent / "shared/datasets")))
    p.add_argument("--topic-partitions", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=10000, help="events per Kafka message")
    p.add_argument("--compression", choices=("none", "lz4", "zstd"), default="zstd",
                   help="(ingest) Arrow IPC compression of the event messages: fewer bytes through Kafka's client")
    p.add_argument("--partitions", type=int, default=1, help="engine partitions (1: whole-graph trainer)")
    p.add_argument("--staleness", default="none")
    p.add_argument("--ingest-nodes", type=int, default=1000000)
    p.add_argument("--ingest-slices", type=int, default=20)
    p.add_argument("--ingest-degree", type=float, default=18.0, help="(1 + degree / 2 + labels) events per node")
    p.add_argument("--ingest-features", type=int, default=8)
    p.add_argument("--ingest-epochs", type=int, default=2, help="epochs per round while the backlog is read")
    p.add_argument("--full-every", type=int, default=10, help="a full checkpoint every N")
    p.add_argument("--train-round-s", type=float, default=4.0, help="(ingest while training) event time per round")
    p.add_argument("--live-eps", type=float, default=1e6, help="(ingest while training) events/s the producer "
                   "offers (0: as fast as it can)")
    p.add_argument("--live-tail-s", type=float, default=5.0, help="(ingest while training) seconds of feature "
                   "updates sent after the graph")
    p.add_argument("--produce-child", metavar="TOPIC", help=argparse.SUPPRESS)
    p.add_argument("--lag-dataset", default="cora")
    p.add_argument("--lag-slices", type=int, default=120)
    p.add_argument("--lag-slice-s", type=float, default=0.25)
    p.add_argument("--lag-warmup-slices", type=int, default=24, help="(lag) slices sent at once before the rest "
                   "is paced: the cold round trains on them")
    p.add_argument("--lag-first-epochs", type=int, default=50)
    p.add_argument("--lag-round-epochs", type=int, default=10)
    p.add_argument("--until-idle", type=float, help="(lag) default: 2 x slice + 5 s")
    p.add_argument("--skip-ingest", action="store_true")
    p.add_argument("--skip-lag", action="store_true")
    p.add_argument("--skip-not-training", action="store_true", help="(ingest) only the stream that trains")
    args = p.parse_args(argv)
    if args.produce_child:
        return produce_child(args)

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
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
