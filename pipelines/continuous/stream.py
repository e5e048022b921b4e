"""Kafka-driven continuous training on a changing graph (`dorylus stream`).

One process, two threads:

- **ingest** (a kafka-python consumer with manual assignment of every partition of the events topic): decodes
  each message (one Arrow batch of events, :mod:`schemas.events`), dead-letters what is malformed, drops events
  whose producer id it has already taken, buffers the rest as *pending*, and tracks per topic partition the
  largest event time seen and the next offset to read.
- **rounds** (the main thread): when the event-time watermark passes the end of the next window (see
  :mod:`pipelines.continuous.watermark`), it takes every pending event below that cut, applies them in event-time
  order to the partitioned graph (:class:`~pipelines.continuous.state.StreamGraph`), materializes an immutable
  `Graph`, trains some epochs warm-started from the previous round's weights and optimizer state (the pipelined
  engine when the config asks for partitions/intervals/staleness, else the whole-graph trainer), writes a model
  version into ``OUT/models/`` atomically, checkpoints, and announces the version on the models topic.

Late events (event time below the cut of a round already taken) are not dropped: they stay pending and are
applied by the next round (counted as ``late``). Events that the graph rejects when applied (an edge to a vertex
that does not exist, a second add of a vertex, a label out of range) go to the dead-letter topic too.

Exactly once: ``OUT/checkpoint.npz`` holds, written together in one atomic rename, the weights, optimizer state,
the applied graph, the pending events, the ids taken so far and the next offset of every topic partition. A
restarted process loads it and seeks to those offsets (never to Kafka's committed offsets), so the events read
after the checkpoint are read again and applied once; a second event with an id already taken is dropped.
Dead letters and model announcements are at least once (a restart may repeat those sent after the checkpoint;
dead letters are keyed by source ``topic/partition/offset`` and announcements carry the version, so consumers
can drop repeats).

Files in OUT: ``checkpoint.npz``, ``models/model-NNNNNN.npz`` (+ ``models/latest.json``), ``metrics.jsonl`` (one
row per round), ``applied/round-NNNNNN.arrow`` (event ids applied by each round and their outcome),
``status.json`` (progress, rewritten every second), ``summary.json`` (at exit).

Crash tests: with ``DORYLUS_FAULT_KILL_AFTER_ROUND=R`` in the environment the process SIGKILLs itself as soon as
it has read events that no checkpoint covers yet after writing the checkpoint of round R or later: a crash at the
one moment that proves exactly-once, every time (an outside SIGKILL can only hope to land in that window).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ops import params as P
from ops.spec import CONFIG_FIELDS as MODEL_CONFIG_FIELDS
from pipelines.data.features import resolve_feature_norm
from pipelines import rundir
from pipelines.config import ConfigError, TrainConfig
from pipelines.continuous import checkpoint as ckpt
from pipelines.continuous import kafka_io
from pipelines.continuous.state import ApplyError, StreamGraph
from pipelines.continuous.watermark import NO_TIME, WatermarkTracker, next_cut, window_end
from schemas.events import (EVENT_SCHEMA, OP_RANK, SchemaError, dead_letter_batch, decode_events, encode_events,
                            validate_rows)

OUTCOMES = ("applied", "noop", "rejected")


@dataclasses.dataclass
class StreamOptions:
    bootstrap: str
    events_topic: str
    out: str
    models_topic: str = "models"
    dead_letter_topic: str | None = None     # default: <events>.dlq
    round_interval_s: float = 60.0           # event-time window of a round
    lateness_s: float = 0.0                  # allowed lateness (the watermark trails the max event time by this)
    idle_partition_s: float | None = None    # skip caught-up partitions silent this long (wall) in the watermark
                                             # (None: a partition holds it until its first event; CLI: 30 s)
    catch_up: str = "windows"                # windows | skip
    round_epochs: int = 50                   # epochs of a warm-started round
    first_round_epochs: int | None = None    # epochs of the first (cold) round; default cfg.epochs
    until_idle_s: float | None = None        # stop after no new events for this long (a final round first)
    num_classes: int | None = None           # default: the largest label seen by the first round + 1
    # No training before the graph has min_train_labels train labels (default num_classes) covering
    # min_train_classes classes (default all): a first round fit to one or two classes leaves a model (dead
    # ReLUs, saturated outputs) that warm-started rounds hardly recover from. The final round trains anyway
    # (given labels of 2 classes).
    min_train_labels: int | None = None
    min_train_classes: int | None = None
    feature_dim: int | None = None           # default: the width of the first feature row seen
    name: str = "stream"
    fresh: bool = False                      # ignore (delete) an existing checkpoint in OUT

    def validate(self) -> None:
        def need(c, m):
            if not c:
                raise ConfigError(m)
        need(self.round_interval_s > 0, f"round-interval must be > 0, got {self.round_interval_s}")
        need(self.lateness_s >= 0, f"allowed-lateness must be >= 0, got {self.lateness_s}")
        need(self.catch_up in ("windows", "skip"), f"catch-up must be windows or skip, got {self.catch_up!r}")
        need(self.round_epochs >= 1, f"round-epochs must be >= 1, got {self.round_epochs}")
        need(self.first_round_epochs is None or self.first_round_epochs >= 1,
             f"first-round-epochs must be >= 1, got {self.first_round_epochs}")
        need(self.until_idle_s is None or self.until_idle_s > 0, f"until-idle must be > 0, got {self.until_idle_s}")
        need(self.num_classes is None or self.num_classes >= 2, f"num-classes must be >= 2, got {self.num_classes}")
        need(self.feature_dim is None or self.feature_dim >= 1, f"feature-dim must be >= 1, got {self.feature_dim}")
        need(self.min_train_labels is None or self.min_train_labels >= 1,
             f"min-train-labels must be >= 1, got {self.min_train_labels}")
        need(self.min_train_classes is None or self.min_train_classes >= 2,
             f"min-train-classes must be >= 2, got {self.min_train_classes}")
        need(bool(self.events_topic), "events topic must be set")


class Stream:
    def __init__(self, opts: StreamOptions, cfg: TrainConfig):
        opts.validate()
        self.opts = opts
        self.cfg = cfg
        self.out = Path(opts.out)
        self.dlq_topic = opts.dead_letter_topic or f"{opts.events_topic}.dlq"
        self.interval_ms = max(1, int(round(opts.round_interval_s * 1000)))
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # ingest state (guarded by lock)
        self.pending: list[tuple[pa.RecordBatch, np.ndarray]] = []
        self.pending_rows = 0
        self.pending_min: int | None = None
        self.seen: set[str] = set()
        self.positions: dict[int, int] = {}
        self.ends: dict[int, int] = {}
        self.ends_time = 0.0  # monotonic time of the last end-offset refresh
        self.partitions: list[int] | None = None
        self.wm = WatermarkTracker(int(opts.lateness_s * 1000), opts.idle_partition_s)
        self.last_cut: int | None = None
        self.last_record = time.monotonic()
        self.counters = {k: 0 for k in ("messages", "ingested", "duplicates", "late", "dead_letters",
                                        "bad_messages", "rejected_rows", "applied", "noop", "apply_rejected")}
        self.feature_dim = opts.feature_dim
        self.num_classes = opts.num_classes
        # training state (main thread)
        self.graph = StreamGraph(cfg.partitions, opts.feature_dim)
        self.round = 0
        self.version = 0
        self.params: dict | None = None
        self.opt_leaves: list | None = None
        self._treedef = None
        self.last_row: dict | None = None
        self._producer = None
        self._ingest_thread: threading.Thread | None = None
        kill = os.environ.get("DORYLUS_FAULT_KILL_AFTER_ROUND", "").strip()
        try:
            self._kill_after_round = int(kill) if kill else None
        except ValueError:
            raise ConfigError(f"DORYLUS_FAULT_KILL_AFTER_ROUND={kill!r}: expected a round number") from None
        self._saved: tuple[int, dict] | None = None  # (round, positions) of the last checkpoint on disk
        self.t_start = time.monotonic()
        self.on_round = None  # callback(row) after each round's checkpoint
        self.last_round_end = time.monotonic()  # the idle clock restarts after a round (training is not idling)
        self.training = False  # True while a round trains (benchmarks sample ingest against it)
        self._unversioned: list[np.ndarray] = []  # times of applied events no model version contains yet

    # ------------------------------------------------------------------------------------------- lifecycle
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> dict:
        """Consume, train round after round; returns the summary (also written to OUT/summary.json)."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "models").mkdir(exist_ok=True)
        (self.out / "applied").mkdir(exist_ok=True)
        if self.opts.fresh:
            self._clear()
        kafka_io.ensure_topics(self.opts.bootstrap, {self.opts.models_topic: 1, self.dlq_topic: 1})
        self._producer = kafka_io.producer(self.opts.bootstrap)
        resumed = self._resume()
        if resumed and self.version:
            self._announce(json.loads((self.out / "models" / "latest.json").read_text()))
        self._ingest_thread = threading.Thread(target=self._ingest, name="stream-ingest", daemon=True)
        self._ingest_thread.start()
        status = "complete"
        try:
            while True:
                if self.error is not None:
                    raise self.error
                if self._stop.is_set():
                    status = "stopped"
                    self._checkpoint()  # the state between rounds: graph, pending and offsets agree
                    break
                with self.lock:
                    parts = self.partitions
                    w = self.wm.watermark(parts) if parts else NO_TIME
                    cut = next_cut(w, self.pending_min, self.last_cut, self.interval_ms, self.opts.catch_up)
                    quiet_since = max(self.last_record, self.last_round_end)
                    idle = time.monotonic() - quiet_since
                    # caught up: every partition read to an end offset fetched after the stream went quiet
                    caught_up = parts is None or (self.ends_time > quiet_since and all(
                        self.positions.get(p, 0) >= self.ends.get(p, 1 << 62) for p in parts))
                    has_pending = self.pending_rows > 0
                if cut is not None:
                    self._round(cut, w)
                    continue
                if self.opts.until_idle_s is not None and idle >= self.opts.until_idle_s and caught_up:
                    if has_pending:
                        self._round(None, w)  # the final round: everything still pending
                    break
                time.sleep(0.05)
        finally:
            self._stop.set()
            if self._ingest_thread is not None:
                self._ingest_thread.join(timeout=30)
            if self._producer is not None:
                self._producer.flush(timeout=30)
                self._producer.close(timeout=30)
        summary = self._summary(status)
        rundir.atomic_write_json(self.out / "summary.json", summary)
        self._write_status(status)
        return summary

    def _clear(self) -> None:
        for f in [self.out / ckpt.FILE, self.out / "metrics.jsonl", self.out / "summary.json",
                  self.out / "status.json", *self.out.glob("models/*"), *self.out.glob("applied/*")]:
            if f.exists():
                f.unlink()

    # ----------------------------------------------------------------------------------------------- ingest
    def _ingest(self) -> None:
        from kafka import TopicPartition

        c = None
        try:
            c = kafka_io.consumer(self.opts.bootstrap)
            topic = self.opts.events_topic
            parts = None
            while parts is None and not self._stop.is_set():
                parts = c.partitions_for_topic(topic)
                if parts is None:
                    c.topics()  # refreshes metadata; the topic may not exist yet
                    time.sleep(0.5)
            if parts is None:
                return
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            c.assign(tps)
            with self.lock:
                for tp in tps:
                    if tp.partition in self.positions:
                        c.seek(tp, self.positions[tp.partition])
                    else:
                        c.seek_to_beginning(tp)
                        self.positions[tp.partition] = c.position(tp)
                self.partitions = sorted(parts)
            last_ends = next_status = 0.0
            while not self._stop.is_set():
                recs = c.poll(timeout_ms=100, max_records=500)
                for tp, msgs in recs.items():
                    for m in msgs:
                        self.take_record(tp.partition, m.offset, m.value)
                if recs and self._kill_after_round is not None:
                    self._maybe_fault_kill()
                if not recs or time.monotonic() - last_ends > 0.25:
                    ends = c.end_offsets(tps)
                    with self.lock:
                        self.ends_time = time.monotonic()
                        for tp in tps:
                            self.ends[tp.partition] = ends[tp]
                            self.wm.set_caught_up(tp.partition, self.positions[tp.partition] >= ends[tp])
                    last_ends = time.monotonic()
                if time.monotonic() >= next_status:  # progress for operators (and tests), even mid-round
                    self._write_status("running")
                    next_status = time.monotonic() + 1.0
        except BaseException as e:  # noqa: BLE001 - surfaced by the main thread
            self.error = e
        finally:
            if c is not None:
                c.close()

    def _maybe_fault_kill(self) -> None:
        with self.lock:
            saved = self._saved
            if saved is None or saved[0] < self._kill_after_round:
                return
            if any(v > saved[1].get(p, -1) for p, v in self.positions.items()):
                os.kill(os.getpid(), signal.SIGKILL)

    def take_record(self, p: int, offset: int, value: bytes) -> None:
        """Take one events-topic record (partition, offset, value): decoded, validated and queued, or dead-lettered."""
        source = f"{self.opts.events_topic}/{p}/{offset}"
        try:
            batch = decode_events(value)
        except SchemaError as e:
            self._dead_raw(value, f"schema: {e}", source)
            with self.lock:
                self.counters["messages"] += 1
                self.counters["bad_messages"] += 1
                self.counters["dead_letters"] += 1
                self.positions[p] = offset + 1
                self.last_record = time.monotonic()
            return
        with self.lock:
            fd, nc = self.feature_dim, self.num_classes
        if fd is None:
            fd = _first_feature_width(batch)
        reasons = validate_rows(batch, fd, nc)
        ok = np.array([r is None for r in reasons], dtype=bool)
        if not ok.all():
            bad = np.flatnonzero(~ok)
            self._dead_rows(batch.take(pa.array(bad)), [reasons[i] for i in bad], source)
        good = batch if ok.all() else batch.filter(pa.array(ok))
        ids = good.column("event_id").to_pylist()
        with self.lock:
            if self.feature_dim is None and fd is not None:
                self.feature_dim = fd
                self.graph.feature_dim = self.graph.feature_dim or fd
            keep = []
            for i, x in enumerate(ids):
                if x in self.seen:
                    self.counters["duplicates"] += 1
                else:
                    self.seen.add(x)
                    keep.append(i)
            if keep:
                kb = good if len(keep) == len(ids) else good.take(pa.array(keep))
                times = kb.column("event_time").cast(pa.int64()).to_numpy()
                self.pending.append((kb, times))
                self.pending_rows += kb.num_rows
                tmin = int(times.min())
                self.pending_min = tmin if self.pending_min is None else min(self.pending_min, tmin)
                if self.last_cut is not None:
                    self.counters["late"] += int((times < self.last_cut).sum())
                self.wm.observe(p, int(times.max()))
            self.counters["messages"] += 1
            self.counters["ingested"] += batch.num_rows
            self.counters["rejected_rows"] += int((~ok).sum())
            self.counters["dead_letters"] += int((~ok).sum())
            self.positions[p] = offset + 1
            self.last_record = time.monotonic()

    def _dead_raw(self, value: bytes, reason: str, source: str) -> None:
        headers = [("dorylus.reason", reason[:1000].encode()), ("dorylus.source", source.encode()),
                   ("dorylus.kind", b"message")]
        self._producer.send(self.dlq_topic, value=value or b"", key=source.encode(), headers=headers)

    def _dead_rows(self, rows: pa.RecordBatch, reasons: list[str], source: str) -> None:
        headers = [("dorylus.reason", reasons[0][:1000].encode()), ("dorylus.source", source.encode()),
                   ("dorylus.kind", b"events"), ("dorylus.count", str(rows.num_rows).encode())]
        value = encode_events(dead_letter_batch(rows, reasons))
        self._producer.send(self.dlq_topic, value=value, key=source.encode(), headers=headers)

    # ----------------------------------------------------------------------------------------------- rounds
    def _extract(self, cut: int | None) -> tuple[pa.Table, int]:
        """Take the pending events below the cut (all of them when cut is None) and advance the last cut."""
        with self.lock:
            if not self.pending:
                return EVENT_SCHEMA.empty_table(), 0
            table = pa.Table.from_batches([b for b, _ in self.pending], schema=EVENT_SCHEMA)
            times = np.concatenate([t for _, t in self.pending])
            take = np.ones(times.size, bool) if cut is None else times < cut
            prev = self.last_cut
            late = int((times[take] < prev).sum()) if prev is not None else 0
            taken = table.filter(pa.array(take))
            rest_mask = ~take
            self.pending, self.pending_rows, self.pending_min = [], 0, None
            if rest_mask.any():
                rest_times = times[rest_mask]
                off = 0
                for b in table.filter(pa.array(rest_mask)).combine_chunks().to_batches():
                    self.pending.append((b, rest_times[off:off + b.num_rows]))
                    off += b.num_rows
                self.pending_rows = int(rest_times.size)
                self.pending_min = int(rest_times.min())
            new_cut = cut if cut is not None else window_end(int(times.max()), self.interval_ms)
            self.last_cut = new_cut if prev is None else max(prev, new_cut)
        return taken, late

    def _apply(self, t: pa.Table) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Apply events in (event time, op rank, id) order; returns ids, outcome codes and event times."""
        n = t.num_rows
        if n == 0:
            return [], np.zeros(0, np.int8), np.zeros(0, np.int64)
        ops = t.column("op").to_pylist()
        rank = pa.array([OP_RANK[o] for o in ops], pa.int8())
        t = t.append_column("_rank", rank).sort_by([("event_time", "ascending"), ("_rank", "ascending"),
                                                   ("event_id", "ascending")]).drop_columns(["_rank"])
        t = t.combine_chunks()
        ids = t.column("event_id").to_pylist()
        ops = t.column("op").to_pylist()
        vs = t.column("vertex").to_numpy().tolist()
        ds = pc.fill_null(t.column("dst"), -1).to_numpy().tolist()
        labels = pc.fill_null(t.column("label"), -1).to_numpy().tolist()
        splits = pc.fill_null(t.column("split"), "none").to_pylist()
        fcol = t.column("features").chunk(0) if t.column("features").num_chunks else None
        offsets = np.asarray(fcol.offsets) if fcol is not None else None
        values = np.asarray(fcol.values) if fcol is not None else None
        times = t.column("event_time").cast(pa.int64()).to_numpy()
        if self.num_classes is None:
            lab = [labels[i] for i in range(n) if ops[i] == "set_label"]
            self.num_classes = max(2, max(lab, default=-1) + 1)
        g = self.graph
        outcome = np.zeros(n, np.int8)
        rejected: list[tuple[int, str]] = []
        for i in range(n):
            op, v = ops[i], vs[i]
            try:
                if op == "add_edge":
                    changed = g.add_edge(v, ds[i])
                elif op == "remove_edge":
                    changed = g.remove_edge(v, ds[i])
                elif op == "add_vertex":
                    changed = g.add_vertex(v, values[offsets[i]:offsets[i + 1]])
                elif op == "update_features":
                    changed = g.update_features(v, values[offsets[i]:offsets[i + 1]])
                else:  # set_label
                    if labels[i] >= self.num_classes:
                        raise ApplyError(f"label {labels[i]} out of range [-1, {self.num_classes})")
                    g.set_label(v, labels[i], splits[i])
                    changed = True
                outcome[i] = 0 if changed else 1
            except ApplyError as e:
                outcome[i] = 2
                rejected.append((i, str(e)))
        if rejected:
            idx = [i for i, _ in rejected]
            rows = t.take(pa.array(idx)).combine_chunks().to_batches()[0]
            self._dead_rows(rows, [r for _, r in rejected], f"{self.opts.events_topic}/apply/round-{self.round + 1}")
        with self.lock:
            self.counters["applied"] += int((outcome == 0).sum())
            self.counters["noop"] += int((outcome == 1).sum())
            self.counters["apply_rejected"] += len(rejected)
            self.counters["dead_letters"] += len(rejected)
        return ids, outcome, times

    def _round(self, cut: int | None, watermark: int) -> None:
        t0 = time.monotonic()
        taken, late = self._extract(cut)
        k = self.round + 1
        ids, outcome, times = self._apply(taken)
        t_applied = time.monotonic()
        graph, _ = self.graph.materialize(self.opts.name, self.num_classes or 2)
        with self.lock:
            ingested0 = self.counters["ingested"]
        row: dict = {"round": k, "cut_ms": cut, "watermark_ms": watermark if watermark != NO_TIME else None,
                     "final": cut is None, "events": len(ids),
                     **{f"events_{o}": int((outcome == j).sum()) for j, o in enumerate(OUTCOMES)},
                     "late_in_round": late, "nodes": graph.num_nodes, "edges": graph.num_edges // 2,
                     "train": int(graph.train_mask.sum()), "val": int(graph.val_mask.sum()),
                     "test": int(graph.test_mask.sum()), "apply_s": t_applied - t0}
        trained = False
        train_labels = graph.labels[graph.train_mask]
        classes = np.unique(train_labels).size
        enough = classes >= 2 and (self.params is not None or cut is None or (
            train_labels.size >= (self.opts.min_train_labels or graph.num_classes)
            and classes >= min(self.opts.min_train_classes or graph.num_classes, graph.num_classes)))
        if graph.num_nodes and enough and ((outcome == 0).any() or self.params is None):
            epochs = (self.opts.first_round_epochs or self.cfg.epochs) if self.params is None \
                else self.opts.round_epochs
            t1 = time.monotonic()
            self.training = True
            try:
                result, engine = self._train(graph, epochs, seed=self.cfg.seed + k - 1)
            finally:
                self.training = False
            train_s = time.monotonic() - t1
            with self.lock:
                ingested1 = self.counters["ingested"]
            has_val = bool(graph.val_mask.any())
            best = result.best_params if has_val and result.best_params is not None else result.params
            acc = result.summary if has_val else result.history[-1]
            self.params = result.params
            self.opt_leaves = self._flatten_opt(result.opt_state)
            self.version += 1
            version_ms = int(time.time() * 1000)
            info = self._write_version(best, version_ms, k, cut, graph)
            # lag: from each event's time to this version, the first that contains it (events applied by
            # rounds that did not train wait for this one)
            waiting = np.concatenate(self._unversioned + [times[outcome == 0]])
            self._unversioned = []
            lag = (version_ms - waiting) / 1000.0
            row.update({"version": self.version, "engine": engine, "epochs": len(result.history),
                        "train_s": train_s, "val_acc": float(acc.get("best_val_acc", acc.get("val_acc", 0.0))),
                        "test_acc": float(acc["test_acc"]), "train_acc": float(acc["train_acc"]),
                        "loss": float(result.history[-1]["loss"]), "first_loss": float(result.history[0]["loss"]),
                        "ingest_during_training": ingested1 - ingested0,
                        "ingest_eps_during_training": (ingested1 - ingested0) / max(train_s, 1e-9),
                        "version_time_ms": version_ms})
            if lag.size:
                row.update({"lag_s_min": float(lag.min()), "lag_s_p50": float(np.median(lag)),
                            "lag_s_p95": float(np.percentile(lag, 95)), "lag_s_max": float(lag.max())})
            trained = True
        else:
            row.update({"version": self.version if self.version else None, "engine": None})
            self._unversioned.append(times[outcome == 0])
        self.round = k
        with self.lock:
            row.update({f"{k_}_total": v for k_, v in self.counters.items()})
            row["pending"] = self.pending_rows
        row["round_s"] = time.monotonic() - t0
        self._journal(k, ids, outcome)
        self._log(row)
        self.last_row = row
        self._checkpoint()
        if trained:
            self._announce(info)
        if self.on_round is not None:
            self.on_round(row)
        self.last_round_end = time.monotonic()

    def _train(self, graph, epochs: int, seed: int):
        if self.cfg.feature_norm == "auto":
            # Decided once, on the first round's graph: a choice that flipped between rounds would hand the
            # warm-started weights differently scaled inputs. The checkpoint's config keeps it.
            self.cfg = dataclasses.replace(self.cfg, feature_norm=resolve_feature_norm(graph.features, "auto"))
        cfg = dataclasses.replace(self.cfg, epochs=epochs, seed=seed, out=None)
        opt = self._unflatten_opt(graph) if self.opt_leaves is not None else None
        small = graph.num_nodes < 4 * cfg.partitions * cfg.intervals
        if cfg.engine and not small:
            from pipelines.engine.runner import train_engine

            return train_engine(cfg, graph, init_params=self.params, init_opt_state=opt), "pipelined"
        from pipelines.train import train

        return train(cfg, graph, init_params=self.params, init_opt_state=opt), "whole-graph"

    def _treedef_for(self, graph):
        if self._treedef is None:
            import jax

            from ops.optim import make_optimizer
            from pipelines.train import build_model

            model = build_model(self.cfg, graph)
            params = model.init(jax.random.PRNGKey(0))
            tx = make_optimizer(self.cfg.lr, self.cfg.weight_decay, model.decay_mask(params))
            self._treedef = jax.tree_util.tree_structure(tx.init(params))
        return self._treedef

    def _flatten_opt(self, opt_state) -> list:
        import jax

        return [np.asarray(x) for x in jax.tree_util.tree_leaves(opt_state)]

    def _unflatten_opt(self, graph):
        import jax

        treedef = self._treedef_for(graph)
        if treedef.num_leaves != len(self.opt_leaves):
            raise ConfigError(f"checkpointed optimizer state has {len(self.opt_leaves)} leaves, the model's "
                              f"optimizer {treedef.num_leaves}: was the model changed?")
        return jax.tree_util.tree_unflatten(treedef, list(self.opt_leaves))

    # ------------------------------------------------------------------------------------------------ outputs
    def _write_version(self, params: dict, version_ms: int, k: int, cut, graph) -> dict:
        rel = f"models/model-{self.version:06d}.npz"
        info = {"name": self.opts.name, "version": self.version, "round": k, "path": rel,
                "uri": str((self.out / rel).resolve()), "cut_ms": cut, "created_ms": version_ms,
                "nodes": graph.num_nodes, "edges": graph.num_edges // 2, "model": self.cfg.model}
        arrays = P.flatten(params)
        arrays["__meta__"] = np.frombuffer(json.dumps(info).encode(), np.uint8)
        rundir.atomic_write_npz(self.out / rel, arrays)
        rundir.atomic_write_json(self.out / "models" / "latest.json", info)
        return info

    def _announce(self, info: dict) -> None:
        from schemas import Control, encode

        value = encode(Control(self.opts.name, "MODEL_VERSION", info))
        self._producer.send(self.opts.models_topic, value=value, key=self.opts.name.encode())
        self._producer.flush(timeout=30)

    def _journal(self, k: int, ids: list[str], outcome: np.ndarray) -> None:
        t = pa.table({"event_id": pa.array(ids, pa.string()),
                      "outcome": pa.array([OUTCOMES[o] for o in outcome.tolist()], pa.string())})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, t.schema) as w:
            w.write_table(t)
        rundir.atomic_write_bytes(self.out / "applied" / f"round-{k:06d}.arrow", sink.getvalue().to_pybytes())

    def _log(self, row: dict) -> None:
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=rundir._json_default) + "\n")
            f.flush()

    def _write_status(self, state: str) -> None:
        with self.lock:
            watermark = self.wm.watermark(self.partitions) if self.partitions else None
            st = {"state": state, "round": self.round, "version": self.version,
                  "positions": {str(k): v for k, v in self.positions.items()},
                  "ends": {str(k): v for k, v in self.ends.items()},
                  "watermark_ms": watermark if watermark not in (None, NO_TIME) else None,
                  "last_cut_ms": self.last_cut, "pending": self.pending_rows, **self.counters,
                  "uptime_s": time.monotonic() - self.t_start}
        rundir.atomic_write_json(self.out / "status.json", st)

    def _summary(self, status: str) -> dict:
        with self.lock:
            s = {"status": status, "name": self.opts.name, "rounds": self.round, "version": self.version,
                 "counters": dict(self.counters), "pending": self.pending_rows, "last_cut_ms": self.last_cut,
                 "nodes": self.graph.num_vertices, "edges": self.graph.num_edges,
                 "seconds": time.monotonic() - self.t_start}
        if self.last_row is not None:
            s["last_round"] = self.last_row
        return s

    # ------------------------------------------------------------------------------------------- checkpoint
    def _checkpoint(self) -> None:
        with self.lock:
            pending = (pa.Table.from_batches([b for b, _ in self.pending], schema=EVENT_SCHEMA)
                       if self.pending else EVENT_SCHEMA.empty_table())
            meta = {"format": 1, "name": self.opts.name, "round": self.round, "version": self.version,
                    "last_cut_ms": self.last_cut, "positions": {str(k): v for k, v in self.positions.items()},
                    "watermark": self.wm.state(), "counters": dict(self.counters),
                    "feature_dim": self.feature_dim, "num_classes": self.num_classes,
                    "events_topic": self.opts.events_topic, "interval_ms": self.interval_ms,
                    "partitions": self.graph.num_partitions, "config": self.cfg.to_dict(), "created": time.time()}
            seen = list(self.seen)
        # Dead letters of the messages below these offsets were sent before the snapshot: make them durable
        # before the offsets are.
        self._producer.flush(timeout=60)
        ckpt.save(self.out, meta=meta, params=self.params, opt_leaves=self.opt_leaves,
                  graph=self.graph.arrays(), pending=pending, seen=seen)
        with self.lock:
            self._saved = (meta["round"], {int(k): v for k, v in meta["positions"].items()})

    def _resume(self) -> bool:
        state = ckpt.load(self.out)
        if state is None:
            if (self.out / "metrics.jsonl").exists():
                (self.out / "metrics.jsonl").unlink()  # rounds of a run that never checkpointed
            for f in self.out.glob("applied/*"):
                f.unlink()
            return False
        meta = state["meta"]
        if meta.get("events_topic") != self.opts.events_topic:
            raise ConfigError(f"{self.out} holds a checkpoint of topic {meta.get('events_topic')!r}, not "
                              f"{self.opts.events_topic!r} (use --fresh to start over)")
        old = meta.get("config", {})
        if self.cfg.feature_norm == "auto" and old.get("feature_norm") not in (None, "auto"):
            self.cfg = dataclasses.replace(self.cfg, feature_norm=old["feature_norm"])  # as the first round chose
        for f in MODEL_CONFIG_FIELDS:
            if f in old and old[f] != getattr(self.cfg, f):
                raise ConfigError(f"{self.out} holds a checkpoint with {f}={old[f]!r}, not {getattr(self.cfg, f)!r} "
                                  f"(use --fresh to start over)")
        if meta.get("partitions") != self.cfg.partitions:
            raise ConfigError(f"{self.out} holds a checkpoint with {meta.get('partitions')} partitions, not "
                              f"{self.cfg.partitions} (use --fresh to start over)")
        self.round = int(meta["round"])
        self.version = int(meta["version"])
        self.last_cut = meta.get("last_cut_ms")
        self.positions = {int(k): int(v) for k, v in meta["positions"].items()}
        self.wm.restore(meta.get("watermark", {}))
        self.counters.update(meta.get("counters", {}))
        self.feature_dim = meta.get("feature_dim") if self.feature_dim is None else self.feature_dim
        self.num_classes = meta.get("num_classes") if self.num_classes is None else self.num_classes
        self.params = state["params"]
        self.opt_leaves = state["opt_leaves"]
        self.graph = StreamGraph.from_arrays(state["graph"], self.cfg.partitions, self.feature_dim)
        pend = state["pending"]
        if pend.num_rows:
            pend = pend.combine_chunks()
            times = pend.column("event_time").cast(pa.int64()).to_numpy()
            self.pending = []
            off = 0
            for b in pend.to_batches():
                self.pending.append((b, times[off:off + b.num_rows]))
                off += b.num_rows
            self.pending_rows = int(times.size)
            self.pending_min = int(times.min())
        self.seen = set(state["seen"])
        # Outputs of rounds after the checkpoint are redone: drop them.
        rows = [r for r in rundir.read_jsonl(self.out / "metrics.jsonl")] if (self.out / "metrics.jsonl").exists() \
            else []
        kept = [r for r in rows if r.get("round", 0) <= self.round]
        rundir.atomic_write_text(self.out / "metrics.jsonl",
                                 "".join(json.dumps(r, default=rundir._json_default) + "\n" for r in kept))
        self.last_row = kept[-1] if kept else None
        for f in self.out.glob("applied/round-*.arrow"):
            if int(f.stem.split("-")[1]) > self.round:
                f.unlink()
        for f in self.out.glob("models/model-*.npz"):
            if int(f.stem.split("-")[1]) > self.version:
                f.unlink()
        if self.version:
            latest = self.out / f"models/model-{self.version:06d}.npz"
            with np.load(latest) as z:
                info = json.loads(z["__meta__"].tobytes().decode())
            rundir.atomic_write_json(self.out / "models" / "latest.json", info)
        return True


def _first_feature_width(batch: pa.RecordBatch) -> int | None:
    ops = batch.column("op")
    mask = pc.and_(pc.is_in(ops, pa.array(["add_vertex", "update_features"])),
                   pc.is_valid(batch.column("features")))
    idx = np.flatnonzero(np.asarray(pc.fill_null(mask, False)))
    if idx.size == 0:
        return None
    w = batch.column("features")[int(idx[0])].as_py()
    return len(w) or None


def read_applied(out: str | Path) -> pa.Table:
    """Every round's journal of applied event ids (``round``, ``event_id``, ``outcome``), in round order."""
    tables = []
    for f in sorted(Path(out).glob("applied/round-*.arrow")):
        with pa.memory_map(str(f)) as src:
            t = pa.ipc.open_file(src).read_all()
        tables.append(t.append_column("round", pa.array([int(f.stem.split("-")[1])] * t.num_rows, pa.int32())))
    if not tables:
        return pa.table({"event_id": pa.array([], pa.string()), "outcome": pa.array([], pa.string()),
                         "round": pa.array([], pa.int32())})
    return pa.concat_tables(tables)


def install_signal_handlers(stream: Stream) -> None:
    """SIGTERM/SIGINT: finish the current round, checkpoint, exit."""
    def handler(signum, frame):
        stream.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
