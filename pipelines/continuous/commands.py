"""`dorylus stream` (continuous training from a Kafka topic of graph events) and `dorylus replay` (a dataset as
a timed event stream)."""
from __future__ import annotations

import json
import sys

from pipelines.config import FEATURE_NORMS


def _model_flags(p) -> None:
    g = p.add_argument_group("model and training (as `dorylus train`)")
    g.add_argument("--config", help="TOML file with training settings (flags win)")
    g.add_argument("--feature-norm", choices=FEATURE_NORMS)
    g.add_argument("--model", choices=["gcn", "gat", "sage"])
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--out-heads", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--dropout", type=float)
    g.add_argument("--order", choices=["auto", "ga-first", "av-first"])
    g.add_argument("--seed", type=int)
    g.add_argument("--epochs", type=int, help="epochs of the first (cold-start) round (default 200)")
    g.add_argument("--lr", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--patience", type=int, help="early stopping within a round (0: never)")
    g = p.add_argument_group("engine (computation separation)")
    g.add_argument("--partitions", type=int, help="graph partitions (graph servers); vertices are owned by a "
                                                  "hash of their id")
    g.add_argument("--intervals", type=int, help="vertex intervals per partition")
    g.add_argument("--partitioner", choices=["metis", "hash"], help="how the engine cuts each round's graph")
    g.add_argument("--staleness", help="none (synchronous) or S >= 0 epochs of bounded staleness")
    g.add_argument("--wu", choices=["sync", "async"])
    g.add_argument("--tensor-workers", help="N (local pool), auto")


def _stream_flags(p) -> None:
    g = p.add_argument_group("stream")
    g.add_argument("--bootstrap", required=True, help="Kafka bootstrap HOST:PORT")
    g.add_argument("--events", required=True, help="topic of graph events (Arrow batches, schemas.events)")
    g.add_argument("--out", required=True, help="directory for checkpoints, model versions and metrics; an "
                                                "existing checkpoint there is resumed")
    g.add_argument("--models-topic", default="models", help="topic announcing model versions (default models)")
    g.add_argument("--dead-letter-topic", help="topic of rejected events (default <events>.dlq)")
    g.add_argument("--round-interval", type=float, default=60.0,
                   help="event-time seconds per round: round k trains on events below the k-th window end "
                        "the watermark has passed (default 60)")
    g.add_argument("--allowed-lateness", type=float, default=0.0,
                   help="seconds the watermark trails the largest event time (default 0)")
    g.add_argument("--idle-partition", type=float, default=30.0,
                   help="a caught-up topic partition silent this many wall seconds stops holding the watermark "
                        "back, so an empty partition does not stall rounds (default 30; its later events may be "
                        "late); 0 disables")
    g.add_argument("--catch-up", choices=["windows", "skip"], default="windows",
                   help="behind the watermark: one window per round (windows) or jump to the latest (skip)")
    g.add_argument("--round-epochs", type=int, default=50, help="epochs of each warm-started round (default 50)")
    g.add_argument("--until-idle", type=float, metavar="SECONDS",
                   help="stop after no new events for this long and all partitions read, after a final round "
                        "over every pending event")
    g.add_argument("--num-classes", type=int, help="classes of the model (default: largest label seen + 1)")
    g.add_argument("--feature-dim", type=int, help="feature width (default: the first feature row's)")
    g.add_argument("--min-train-labels", type=int,
                   help="the first training waits for this many train labels (default: the number of classes)")
    g.add_argument("--min-train-classes", type=int,
                   help="... covering this many classes (default: all); the final round trains regardless")
    g.add_argument("--predictions-topic", help="topic of vertex predictions (default <events>.predictions)")
    g.add_argument("--predict", choices=["changed", "all", "none"], default="changed",
                   help="after each version publish the vertices whose k-hop neighbourhood changed (default), "
                        "all vertices, or none")
    g.add_argument("--predictions-partitions", type=int, default=3,
                   help="partitions of the predictions topic it creates (default 3)")
    g.add_argument("--dedupe-retention", type=float, metavar="SECONDS",
                   help="event-time seconds behind the watermark that event ids are kept to drop repeats; older "
                        "events are dead-lettered as expired (default 10 round intervals + allowed lateness)")
    g.add_argument("--full-checkpoint-every", type=int, default=10,
                   help="a full checkpoint every N checkpoints, incremental ones between (default 10)")
    g.add_argument("--name", default="stream", help="model name in announcements (default stream)")
    g.add_argument("--fresh", action="store_true", help="delete a checkpoint in --out and start over")
    g.add_argument("--quiet", action="store_true", help="no per-round lines")


def cmd_stream(args) -> int:
    from kafka.errors import KafkaError

    from pipelines.config import FIELDS, build_config, load_toml
    from pipelines.continuous.stream import Stream, StreamOptions, install_signal_handlers

    file_values = load_toml(args.config) if args.config else {}
    flags = {k: getattr(args, k) for k in FIELDS if hasattr(args, k) and k not in ("out",)}
    cfg = build_config(file_values, flags)
    opts = StreamOptions(bootstrap=args.bootstrap, events_topic=args.events, out=args.out,
                         models_topic=args.models_topic, dead_letter_topic=args.dead_letter_topic,
                         round_interval_s=args.round_interval, lateness_s=args.allowed_lateness,
                         idle_partition_s=args.idle_partition or None, catch_up=args.catch_up,
                         round_epochs=args.round_epochs, until_idle_s=args.until_idle,
                         num_classes=args.num_classes, feature_dim=args.feature_dim,
                         min_train_labels=args.min_train_labels, min_train_classes=args.min_train_classes,
                         predictions_topic=args.predictions_topic, predict=args.predict,
                         predictions_partitions=args.predictions_partitions,
                         dedupe_retention_s=args.dedupe_retention, full_checkpoint_every=args.full_checkpoint_every,
                         name=args.name, fresh=args.fresh)
    stream = Stream(opts, cfg)
    if not args.quiet:
        def on_round(row):
            acc = f"test {row['test_acc']:.4f} val {row['val_acc']:.4f}" if "test_acc" in row else "not trained"
            print(f"round {row['round']}: {row['events']} events ({row['late_in_round']} late), "
                  f"{row['nodes']} nodes {row['edges']} edges, {acc}, version {row.get('version')}", flush=True)
        stream.on_round = on_round
    install_signal_handlers(stream)
    try:
        s = stream.run()
    except KafkaError as e:
        print(f"dorylus: error: kafka at {args.bootstrap}: {e}", file=sys.stderr)
        return 1
    c = s["counters"]
    print(f"stream {s['status']}: {s['rounds']} rounds, version {s['version']}, {c['applied']} applied, "
          f"{c['duplicates']} duplicates, {c['late']} late, {c['dead_letters']} dead letters -> {args.out}",
          flush=True)
    return 0


def cmd_replay(args) -> int:
    from kafka.errors import KafkaError

    from pipelines.continuous.replay import replay
    from pipelines.data.registry import load_dataset

    graph = load_dataset(args.dataset, args.data_dir, seed=args.seed)
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        res = replay(graph, args.bootstrap, args.topic, slices=args.slices, slice_s=args.slice_seconds,
                     start_ms=args.start_ms, pace_s=args.pace, seed=args.seed, first_slice=args.first_slice,
                     last_slice=args.last_slice, topic_partitions=args.topic_partitions,
                     batch_size=args.batch_size, prefix=args.id_prefix, log=log)
    except KafkaError as e:
        print(f"dorylus: error: kafka at {args.bootstrap}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res), flush=True)
    return 0


def cmd_predictions(args) -> int:
    from kafka.errors import KafkaError

    from pipelines.continuous.predictions import read_newest

    if args.vertex < 0 or args.timeout <= 0:
        print(f"dorylus: error: {'vertex must be >= 0' if args.vertex < 0 else 'timeout must be > 0'}",
              file=sys.stderr)
        return 2
    try:
        row = read_newest(args.bootstrap, args.topic, args.vertex, timeout_s=args.timeout)
    except LookupError as e:
        print(f"dorylus: error: {e}", file=sys.stderr)
        return 2
    except KafkaError as e:
        print(f"dorylus: error: kafka at {args.bootstrap}: {e}", file=sys.stderr)
        return 1
    if row is None:
        print(f"dorylus: error: no prediction for vertex {args.vertex} on {args.topic}", file=sys.stderr)
        return 1
    row["watermark_ms"] = int(row.pop("watermark").timestamp() * 1000)
    print(json.dumps(row), flush=True)
    return 0


def register(sub) -> None:
    s = sub.add_parser("stream", help="train continuously on a changing graph from a Kafka topic of events")
    _stream_flags(s)
    _model_flags(s)
    s.set_defaults(func=cmd_stream)
    r = sub.add_parser("replay", help="replay a dataset as a timed stream of graph events into a Kafka topic")
    r.add_argument("--dataset", required=True, help="dataset spec, as `dorylus train --dataset`")
    r.add_argument("--data-dir")
    r.add_argument("--bootstrap", required=True, help="Kafka bootstrap HOST:PORT")
    r.add_argument("--topic", required=True)
    r.add_argument("--slices", type=int, default=10, help="time slices (default 10)")
    r.add_argument("--slice-seconds", type=float, default=60.0, help="event time per slice (default 60)")
    r.add_argument("--start-ms", type=int, help="event time of slice 0, ms since the epoch (default: now)")
    r.add_argument("--pace", type=float, default=0.0, help="wall seconds between slices (default 0: no wait)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--first-slice", type=int, default=0)
    r.add_argument("--last-slice", type=int)
    r.add_argument("--topic-partitions", type=int, default=3, help="partitions of a topic it creates")
    r.add_argument("--batch-size", type=int, default=1000, help="events per message (default 1000)")
    r.add_argument("--id-prefix", help="event id prefix (default: the dataset name)")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_replay)
    q = sub.add_parser("predictions", help="the newest prediction of a vertex on a stream's predictions topic")
    q.add_argument("--bootstrap", required=True, help="Kafka bootstrap HOST:PORT")
    q.add_argument("--topic", required=True, help="the predictions topic (`dorylus stream`: <events>.predictions)")
    q.add_argument("--vertex", type=int, required=True)
    q.add_argument("--timeout", type=float, default=10.0, help="seconds to read the vertex's partition")
    q.set_defaults(func=cmd_predictions)
