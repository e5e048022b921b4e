"""Kafka-driven continuous training on a changing graph (`dorylus stream`).

One process, two threads:

- **ingest** (:mod:`.ingest`; a kafka-python consumer with manual assignment of every partition of the events
  topic): decodes each message (one Arrow batch of events, :mod:`schemas.events`), dead-letters what is
  malformed, drops repeats of events already taken (:mod:`.dedupe`: bounded, by event-time window), buffers the
  rest as *pending*, and tracks per topic partition the largest event time seen and the next offset to read.
- **rounds** (the main thread): when the event-time watermark passes the end of the next window (see
  :mod:`.watermark`), it takes every pending event below that cut, applies them column-wise in event-time order
  to the graph (:class:`~pipelines.continuous.state.StreamGraph`), trains some epochs warm-started from the
  previous round's weights and optimizer state (the pipelined engine when the config asks for
  partitions/intervals/staleness, on partitions kept from round to round, :mod:`.ownership`, else whole-graph
  rounds; both on capacity buckets, :mod:`.trainer`, compiling once per bucket, the next bucket compiled ahead in
  the background for whole-graph rounds), writes a model version into ``OUT/models/``
  atomically, checkpoints (:mod:`.checkpoint`: a delta of the round's events, a full base every N), announces the
  version on the models topic. The predictions of the vertices whose k-hop neighbourhood changed go to the
  predictions topic (:mod:`.predictions`) twice: right after the apply, by the newest version on the new graph
  (so an event's effect is out without waiting for training), and after training, by the new version.

Late events (event time below the cut of a round already taken) are applied by the next round (counted as
``late``), as long as they are above the dedupe horizon (watermark minus ``dedupe_retention_s``); older ones
are dead-lettered as expired. Events that the graph rejects when applied (an edge to a vertex that does not
exist, a second add of a vertex, a label out of range) go to the dead-letter topic too.

Exactly once: a checkpoint commits, in one atomic manifest rename, the weights, optimizer state, the graph (a
base plus the rounds since), the pending events, the dedupe keys and the next offset of every topic partition.
A restarted process loads it and seeks to those offsets (never to Kafka's committed offsets), so the events read
after the checkpoint are read again and applied once; a repeat of an event already taken is dropped. Dead
letters, model announcements and predictions are at least once (a restart may repeat those sent after the
checkpoint; they carry the source offset or the version, so consumers can drop repeats).

Files in OUT: ``checkpoint/``, ``models/model-NNNNNN.npz`` (+ ``models/latest.json``), ``metrics.jsonl`` (one
row per round), ``applied/round-NNNNNN.arrow`` (event ids applied by each round and their outcome),
``status.json`` (progress, rewritten every second), ``summary.json`` (at exit).

Crash tests: with ``DORYLUS_FAULT_KILL_AFTER_ROUND=R`` the process SIGKILLs itself as soon as it has read events
that no checkpoint covers yet after writing the checkpoint of round R or later; with
``DORYLUS_FAULT_KILL_IN_CHECKPOINT=R`` it SIGKILLs itself inside the first incremental checkpoint of round R or
later, after the delta file is written and before the manifest commits it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines import rundir
from pipelines.config import ConfigError, TrainConfig
from pipelines.continuous import kafka_io
from pipelines.continuous.dedupe import Dedupe
from pipelines.continuous.ingest import IngestMixin
from pipelines.continuous.persist import OUTCOMES, PersistMixin, read_applied, rss_bytes  # noqa: F401
from pipelines.continuous.state import APPLIED, REJECTED, SET_LABEL, StreamGraph
from pipelines.continuous.watermark import NO_TIME, WatermarkTracker, next_cut, window_end
from pipelines.data.features import resolve_feature_norm
from schemas.events import EVENT_SCHEMA

PREDICT_MODES = ("changed", "all", "none")
FIRST_ROUND_EPOCHS = 200   # a cold round trains this long unless --epochs says otherwise (the trainer's epochs is a cap)


@dataclasses.dataclass
class StreamOptions:
    bootstrap: str
    events_topic: str
    out: str
    models_topic: str = "models"
    dead_letter_topic: str | None = None     # default: <events>.dlq
    predictions_topic: str | None = None     # default: <events>.predictions
    predict: str = "changed"                 # changed (k-hop of what changed) | all | none
    predictions_partitions: int = 3
    round_interval_s: float = 60.0           # event-time window of a round
    lateness_s: float = 0.0                  # allowed lateness (the watermark trails the max event time by this)
    idle_partition_s: float | None = None    # skip caught-up partitions silent this long (wall) in the watermark
                                             # (None: a partition holds it until its first event; CLI: 30 s)
    catch_up: str = "windows"                # windows | skip
    round_epochs: int = 50                   # epochs of a warm-started round
    first_round_epochs: int | None = None    # epochs of the first (cold) round; default 200 (cfg.epochs is a cap)
    until_idle_s: float | None = None        # stop after no new events for this long (a final round first)
    num_classes: int | None = None           # default: the largest label seen by the first round + 1
    # No training before the graph has min_train_labels train labels (default num_classes) covering
    # min_train_classes classes (default all): a first round fit to one or two classes leaves a model (dead
    # ReLUs, saturated outputs) that warm-started rounds hardly recover from. The final round trains anyway
    # (given labels of 2 classes).
    min_train_labels: int | None = None
    min_train_classes: int | None = None
    feature_dim: int | None = None           # default: the width of the first feature row seen
    dedupe_retention_s: float | None = None  # ids kept this far behind the watermark (default 10 rounds + lateness)
    full_checkpoint_every: int = 10          # a full base checkpoint every N checkpoints (deltas between)
    name: str = "stream"
    fresh: bool = False                      # ignore (delete) an existing checkpoint in OUT

    def validate(self) -> None:
        def need(c, m):
            if not c:
                raise ConfigError(m)
        for flag, v in (("round-interval", self.round_interval_s), ("allowed-lateness", self.lateness_s),
                        ("idle-partition", self.idle_partition_s), ("until-idle", self.until_idle_s),
                        ("dedupe-retention", self.dedupe_retention_s)):
            # inf passes the bounds below, and an infinite window or lateness never closes a round
            need(v is None or math.isfinite(v), f"{flag} must be a finite number of seconds, got {v}")
        need(self.idle_partition_s is None or self.idle_partition_s > 0,
             f"idle-partition must be > 0, got {self.idle_partition_s}")
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
        need(self.predict in PREDICT_MODES, f"predict must be one of {', '.join(PREDICT_MODES)}, got {self.predict!r}")
        need(self.predictions_partitions >= 1,
             f"predictions-partitions must be >= 1, got {self.predictions_partitions}")
        need(self.dedupe_retention_s is None or self.dedupe_retention_s >= self.lateness_s,
             f"dedupe-retention must be >= allowed-lateness ({self.lateness_s}), got {self.dedupe_retention_s}")
        need(self.full_checkpoint_every >= 1, f"full-checkpoint-every must be >= 1, got {self.full_checkpoint_every}")
        need(bool(self.events_topic), "events topic must be set")

    @property
    def retention_s(self) -> float:
        return self.dedupe_retention_s if self.dedupe_retention_s is not None else \
            10 * self.round_interval_s + self.lateness_s


def _env_round(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    try:
        return int(v) if v else None
    except ValueError:
        raise ConfigError(f"{name}={v!r}: expected a round number") from None


class Stream(IngestMixin, PersistMixin):
    def __init__(self, opts: StreamOptions, cfg: TrainConfig):
        opts.validate()
        self.opts = opts
        self.cfg = cfg
        self.out = Path(opts.out)
        self.dlq_topic = opts.dead_letter_topic or f"{opts.events_topic}.dlq"
        self.predictions_topic = opts.predictions_topic or f"{opts.events_topic}.predictions"
        self.interval_ms = max(1, int(round(opts.round_interval_s * 1000)))
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # ingest state (guarded by lock)
        self.pending: list[tuple[pa.RecordBatch, np.ndarray]] = []
        self.pending_rows = 0
        self.pending_min: int | None = None
        self.dedupe = Dedupe(self.interval_ms, int(opts.retention_s * 1000))
        self.positions: dict[int, int] = {}
        self.ends: dict[int, int] = {}
        self.ends_time = 0.0  # monotonic time of the last end-offset refresh
        self.partitions: list[int] | None = None
        self.topic_missing = False  # the consumer looked the topic up and it does not exist (yet)
        self.wm = WatermarkTracker(int(opts.lateness_s * 1000), opts.idle_partition_s)
        self.last_cut: int | None = None
        self.last_record = time.monotonic()
        self.counters = {k: 0 for k in ("messages", "ingested", "duplicates", "late", "expired", "dead_letters",
                                        "bad_messages", "rejected_rows", "applied", "noop", "apply_rejected")}
        self.feature_dim = opts.feature_dim
        self.num_classes = opts.num_classes
        # training state (main thread)
        self.graph = StreamGraph(cfg.partitions, opts.feature_dim)
        self.round = 0
        self.version = 0
        self.params: dict | None = None          # the last round's weights (the next round warm-starts from them)
        self.served: dict | None = None          # the weights of the newest version (what predictions use)
        self.opt_leaves: list | None = None
        self._treedef = None
        self.trainer = None
        self.ownership = None                    # the pipelined engine's partitions (`.ownership`), kept across rounds
        self._engine_shapes: set = set()         # the engine's padded block sizes seen (each is a compile)
        self.last_row: dict | None = None
        self._producer = None
        self._publisher = None
        self._ingest_thread: threading.Thread | None = None
        self._kill_after_round = _env_round("DORYLUS_FAULT_KILL_AFTER_ROUND")
        self._kill_in_checkpoint = _env_round("DORYLUS_FAULT_KILL_IN_CHECKPOINT")
        self._saved: tuple[int, dict] | None = None  # (round, positions) of the last checkpoint on disk
        self.t_start = time.monotonic()
        self.on_round = None  # callback(row) after each round's checkpoint
        self.last_round_end = time.monotonic()  # the idle clock restarts after a round (training is not idling)
        self.training = False  # True while a round trains (benchmarks sample ingest against it)
        self._unversioned: list[np.ndarray] = []   # times of applied events no model version contains yet
        self._unpredicted: list[np.ndarray] = []   # times of applied input changes no prediction covers yet
        self._touched: list[np.ndarray] = []       # slots whose inputs changed since the last predictions
        self._refresh_predictions = False
        self._sizes_seen: list[tuple[float, int, int]] = []  # (monotonic time, vertices, entries) before the trainer

    # ------------------------------------------------------------------------------------------- lifecycle
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> dict:
        """Consume, train round after round; returns the summary (also written to OUT/summary.json)."""
        from pipelines.continuous.predictions import Publisher

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "models").mkdir(exist_ok=True)
        (self.out / "applied").mkdir(exist_ok=True)
        if self.opts.fresh:
            self._clear()
        topics = {self.opts.models_topic: 1, self.dlq_topic: 1}
        if self.opts.predict != "none":
            topics[self.predictions_topic] = self.opts.predictions_partitions
        kafka_io.ensure_topics(self.opts.bootstrap, topics)
        self._producer = kafka_io.producer(self.opts.bootstrap)
        if self.opts.predict != "none":
            parts = kafka_io.topic_partitions(self.opts.bootstrap, self.predictions_topic)
            self._publisher = Publisher(self._producer, self.predictions_topic,
                                        len(parts) if parts else self.opts.predictions_partitions)
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
                    if w != NO_TIME:
                        self.dedupe.advance(w)  # also when no event arrives: the horizon follows the watermark
                    cut = next_cut(w, self.pending_min, self.last_cut, self.interval_ms, self.opts.catch_up)
                    quiet_since = max(self.last_record, self.last_round_end)
                    idle = time.monotonic() - quiet_since
                    # caught up: every partition read to an end offset fetched after the stream went quiet
                    # (or the topic is known not to exist; before the consumer knows either, it is not caught up)
                    caught_up = (parts is None and self.topic_missing) or (parts is not None and
                                                                           self.ends_time > quiet_since and all(
                        self.positions.get(p, 0) >= self.ends.get(p, 1 << 62) for p in parts))
                    has_pending = self.pending_rows > 0
                if cut is not None:
                    self._round(cut, w)
                    continue
                if self.opts.until_idle_s is not None and idle >= self.opts.until_idle_s and caught_up:
                    if has_pending:
                        self._round(None, w)  # the final round: everything still pending
                    break
                time.sleep(0.02)
        finally:
            self._stop.set()
            if self.trainer is not None:
                self.trainer.close()
            if self._ingest_thread is not None:
                self._ingest_thread.join(timeout=30)
            if self._producer is not None:
                self._producer.flush(timeout=30)
                self._producer.close(timeout=30)
        summary = self._summary(status)
        rundir.atomic_write_json(self.out / "summary.json", summary)
        self._write_status(status)
        return summary

    # ----------------------------------------------------------------------------------------------- rounds
    def _extract(self, cut: int | None) -> tuple[pa.Table, int]:
        """Take the pending events below the cut (all of them when cut is None) and advance the last cut. The
        lock is held only to swap the pending list out and to put the rest back: the ingest thread goes on
        buffering while the batches are filtered (the order of pending batches does not matter: applying sorts)."""
        with self.lock:
            if not self.pending:
                return EVENT_SCHEMA.empty_table(), 0
            pend = self.pending
            self.pending, self.pending_rows, self.pending_min = [], 0, None
            prev = self.last_cut
            new_cut = cut if cut is not None else window_end(max(int(t.max()) for _, t in pend), self.interval_ms)
            self.last_cut = new_cut if prev is None else max(prev, new_cut)
        table = pa.Table.from_batches([b for b, _ in pend], schema=EVENT_SCHEMA)
        times = np.concatenate([t for _, t in pend])
        take = np.ones(times.size, bool) if cut is None else times < cut
        late = int((times[take] < prev).sum()) if prev is not None else 0
        taken = table if take.all() else table.filter(pa.array(take))
        rest_mask = ~take
        if rest_mask.any():
            rest_times = times[rest_mask]
            rest, off = [], 0
            for b in table.filter(pa.array(rest_mask)).combine_chunks().to_batches():
                rest.append((b, rest_times[off:off + b.num_rows]))
                off += b.num_rows
            with self.lock:
                self.pending = rest + self.pending
                self.pending_rows += int(rest_times.size)
                tmin = int(rest_times.min())
                self.pending_min = tmin if self.pending_min is None else min(self.pending_min, tmin)
        return taken, late

    def _apply(self, t: pa.Table, replay: bool = False):
        """Apply events in (event time, op rank, id) order, column-wise. Returns, in that order, the event ids,
        outcome codes, event times and op codes. replay: re-applying a checkpoint's delta (no counters, no dead letters)."""
        if t.num_rows == 0:
            z = np.zeros(0, np.int8)
            return pa.array([], pa.string()), z, np.zeros(0, np.int64), z
        if self.num_classes is None:
            top = pc.max(pc.filter(t.column("label"), pc.equal(t.column("op"), "set_label"))).as_py()
            self.num_classes = max(2, (top if top is not None else -1) + 1)
        order, res, code = self.graph.apply_table(t, self.num_classes)
        times = t.column("event_time").cast(pa.int64()).to_numpy()[order]
        outcome = res.outcome
        if not replay:
            if res.reasons:
                idx = sorted(res.reasons)
                self._dead_rows(t.take(pa.array(order[idx])), [res.reasons[i] for i in idx],
                                f"{self.opts.events_topic}/apply/round-{self.round + 1}")
            with self.lock:
                self.counters["applied"] += int((outcome == APPLIED).sum())
                self.counters["noop"] += int((outcome == 1).sum())
                self.counters["apply_rejected"] += int((outcome == REJECTED).sum())
                self.counters["dead_letters"] += int((outcome == REJECTED).sum())
        self._touched.append(res.touched)
        return pc.take(t.column("event_id"), pa.array(order)), outcome, times, code

    def _round(self, cut: int | None, watermark: int) -> None:
        from pipelines.continuous.trainer import compile_count, precompile_count

        t0 = time.monotonic()
        c0, pc0 = compile_count(), precompile_count()
        taken, late = self._extract(cut)
        k = self.round + 1
        ids_applied, outcome, times, code = self._apply(taken)
        t_applied = time.monotonic()
        graph, ids = self.graph.materialize(self.opts.name, self.num_classes or 2)
        self._observe(graph.num_nodes, graph.adj.nnz + graph.num_nodes)  # (A + I's entries)
        with self.lock:
            ingested0 = self.counters["ingested"]
        part = self.graph.partition_stats()
        row: dict = {"round": k, "cut_ms": cut, "watermark_ms": watermark if watermark != NO_TIME else None,
                     "final": cut is None, "events": taken.num_rows,
                     **{f"events_{o}": int((outcome == j).sum()) for j, o in enumerate(OUTCOMES)},
                     "late_in_round": late, "nodes": graph.num_nodes, "edges": graph.num_edges // 2,
                     "train": int(graph.train_mask.sum()), "val": int(graph.val_mask.sum()),
                     "test": int(graph.test_mask.sum()), "apply_s": t_applied - t0,
                     "apply_eps": taken.num_rows / max(t_applied - t0, 1e-9),
                     "partition_balance": part["balance"], "edge_cut": part["edge_cut"]}
        self._unversioned.append(times[outcome == APPLIED])
        self._unpredicted.append(times[(outcome == APPLIED) & (code != SET_LABEL)])
        train_labels = graph.labels[graph.train_mask]
        classes = np.unique(train_labels).size
        enough = classes >= 2 and (self.params is not None or cut is None or (
            train_labels.size >= (self.opts.min_train_labels or graph.num_classes)
            and classes >= min(self.opts.min_train_classes or graph.num_classes, graph.num_classes)))
        info = None
        will_train = bool(graph.num_nodes and enough and ((outcome == APPLIED).any() or self.params is None))
        rows, dg = self._prompt_predictions(graph, ids, cut, row, will_train)
        if will_train:
            info = self._train_round(graph, ids, k, cut, row, ingested0, rows, dg)
        else:
            row.update({"version": self.version if self.version else None, "engine": None})
        self.round = k
        with self.lock:
            row.update({f"{k_}_total": v for k_, v in self.counters.items()})
            row["pending"] = self.pending_rows
            row["dedupe_ids"] = self.dedupe.size
            row["dedupe_bytes"] = self.dedupe.nbytes
        row.update({"compiles": compile_count() - c0, "precompiles": precompile_count() - pc0, "graph_bytes": self.graph.nbytes(), "rss_bytes": rss_bytes()})
        if self.trainer is not None and self.trainer.shape is not None:
            row.update({"capacity_nodes": self.trainer.shape[0], "capacity_entries": self.trainer.shape[1],
                        "bucket_growths": self.trainer.growths + len(self._engine_shapes)})
        self._journal(k, ids_applied, outcome)

        def log(ck: dict) -> None:  # the row goes out with the checkpoint's size, before the commit
            row.update({"checkpoint_kind": ck["kind"], "checkpoint_bytes": ck["bytes"], "checkpoint_chain": ck["chain"],
                        "round_s": time.monotonic() - t0})
            self._log(row)

        self._checkpoint(taken, before_commit=log)  # (a delta's order does not matter: applying sorts)
        self.last_row = row
        if info is not None:
            self._announce(info)
        if self.on_round is not None:
            self.on_round(row)
        self.last_round_end = time.monotonic()

    def _prompt_predictions(self, graph, ids, cut, row: dict, will_train: bool):
        """Before the round trains: the predictions of the vertices whose k-hop neighbourhood changed, by the
        newest version on the new graph, so users see an event's effect without waiting for the next version
        (which publishes the same rows again). Returns those rows (None when not computed) and the device graph."""
        if self._publisher is None or self.served is None or not self._touched and not self._refresh_predictions:
            return None, None
        if self.opts.predict == "none":
            return None, None
        rows = self._changed_rows(graph)
        dg = self._round_trainer().device_graph(graph) if will_train or rows.size else None
        if rows.size:
            self._publish(graph, ids, rows, self.served, self.version, dg, cut, row, "prompt_")
        return rows, dg

    def _train_round(self, graph, ids, k: int, cut, row: dict, ingested0: int, rows=None, dg=None) -> dict:
        """Train the round, write and publish its version; fills the row; returns the version's info."""
        epochs = (self.opts.first_round_epochs or min(self.cfg.epochs, FIRST_ROUND_EPOCHS)) if self.params is None \
            else self.opts.round_epochs
        t1 = time.monotonic()
        self.training = True
        try:
            result, engine, dg, part = self._train(graph, epochs, seed=self.cfg.seed + k - 1, dg=dg)
        finally:
            self.training = False
        train_s = time.monotonic() - t1
        with self.lock:
            ingested1 = self.counters["ingested"]
        has_val = bool(graph.val_mask.any())
        best = result.best_params if has_val and result.best_params is not None else result.params
        acc = result.summary if has_val else result.history[-1]
        self.params = result.params
        self.served = best
        self.opt_leaves = self._flatten_opt(result.opt_state)
        self.version += 1
        version_ms = int(time.time() * 1000)
        info = self._write_version(best, version_ms, k, cut, graph)
        # lag: from each event's time to this version, the first that contains it (events applied by rounds that
        # did not train wait for this one)
        lag = (version_ms - np.concatenate(self._unversioned)) / 1000.0
        self._unversioned = []
        row.update({"version": self.version, "engine": engine, "epochs": len(result.history), "train_s": train_s,
                    "val_acc": float(acc.get("best_val_acc", acc.get("val_acc", 0.0))),
                    "test_acc": float(acc["test_acc"]), "train_acc": float(acc["train_acc"]),
                    "loss": float(result.history[-1]["loss"]), "first_loss": float(result.history[0]["loss"]),
                    "ingest_during_training": ingested1 - ingested0,
                    "ingest_eps_during_training": (ingested1 - ingested0) / max(train_s, 1e-9),
                    "version_time_ms": version_ms, **_stats("lag_s", lag), **part})
        if self._publisher is not None:
            if rows is None:
                rows = self._changed_rows(graph)
            self._publish(graph, ids, rows, best, self.version, dg, cut, row, "")
        else:
            self._touched, self._unpredicted = [], []
        return info

    def _train(self, graph, epochs: int, seed: int, dg=None):
        if self.cfg.feature_norm == "auto":
            # Decided once, on the first round's graph: a choice that flipped between rounds would hand the
            # warm-started weights differently scaled inputs. The checkpoint's config keeps it.
            self.cfg = dataclasses.replace(self.cfg, feature_norm=resolve_feature_norm(graph.features, "auto"))
        opt = self._unflatten_opt(graph) if self.opt_leaves is not None else None
        # A warm-started round goes on from trained weights: the synchronous warm-up is the first round's alone.
        warmup = self.cfg.sync_warmup if opt is None else 0
        cfg = dataclasses.replace(self.cfg, epochs=epochs, seed=seed, out=None, sync_warmup=warmup)
        small = graph.num_nodes < 4 * cfg.partitions * cfg.intervals
        tr = self._round_trainer()
        dg = dg if dg is not None else tr.device_graph(graph)
        if cfg.engine and not small:
            from pipelines.continuous.ownership import Ownership
            from pipelines.continuous.trainer import BUCKET
            from pipelines.engine.runner import train_engine

            # The stream's partitions, kept across rounds; the plan's shapes in the trainer's buckets and the
            # evaluation on its bucketed device graph, so a round compiles only when a bucket is outgrown.
            if self.ownership is None:
                self.ownership = Ownership(cfg.partitions, cfg.partitioner, cfg.seed)
            assignment, part = self.ownership.assignment(graph.adj, self.graph.order())
            result = train_engine(dataclasses.replace(cfg, partitioner=assignment), graph,
                                  init_params=self.params, init_opt_state=opt, bucket=BUCKET,
                                  evaluate=lambda params: tr.evaluator.on(dg, params))
            st = result.summary.get("partition_stats", {})
            # the blocks' padded sizes (rows, columns and entries of each partition): the engine's kernels compile
            # once per distinct one, as the whole-graph rounds do per capacity bucket
            shape = (st.get("rows_pad"), tuple(st.get("cols_pads", ())), tuple(st.get("nnz_pads", ())))
            self._engine_shapes.add(shape)
            part["engine_shape"] = [shape[0], list(shape[1]), list(shape[2])]
            return result, "pipelined", dg, part
        return tr.train(graph, dg, epochs, seed, self.params, opt), "whole-graph", dg, {}

    def _round_trainer(self):
        from pipelines.continuous.trainer import RoundTrainer

        if self.trainer is None:  # (made once the config is final: feature_norm "auto" is resolved by then)
            self.trainer = RoundTrainer(self.cfg)
            for at, n, e in self._sizes_seen:
                self.trainer.observe(n, e, at)
        return self.trainer

    def _observe(self, vertices: int, entries: int) -> None:
        """Every round's graph size, for the trainer's growth rate (kept here until the trainer exists)."""
        from pipelines.continuous.trainer import RATE_WINDOW

        if self.trainer is not None:
            self.trainer.observe(vertices, entries)
        else:
            self._sizes_seen = (self._sizes_seen + [(time.monotonic(), vertices, entries)])[-RATE_WINDOW:]

    def _changed_rows(self, graph) -> np.ndarray:
        """The rows (materialized order) within k hops of a vertex whose inputs changed since the last
        predictions (every row with --predict all or after a restart); consumes the touched slots."""
        from pipelines.continuous.predictions import khop
        from schemas.tasks import StageKind

        touched, self._touched = self._touched, []
        if self.opts.predict == "all" or self._refresh_predictions:
            self._refresh_predictions = False
            return np.arange(graph.num_nodes)
        mark = np.zeros(self.graph.num_vertices, bool)
        for t_ in touched:
            mark[t_] = True
        rank = np.empty(graph.num_nodes, np.int64)
        rank[self.graph.order()] = np.arange(graph.num_nodes)
        tr = self._round_trainer()
        if tr.model is None:
            tr.device_graph(graph)  # builds the model (the pipelined engine trains without this trainer)
        hops = sum(st.kind == StageKind.GA for st in tr.model.stages)
        return khop(graph.adj, rank[np.flatnonzero(mark)], hops)

    def _publish(self, graph, ids: np.ndarray, rows: np.ndarray, params: dict, version: int, dg, cut, row: dict,
                 prefix: str) -> None:
        """Publish the logits of `rows` by `params` (version `version`) on this round's graph; the lag of the
        input changes that no prediction covered yet ends here."""
        t0 = time.monotonic()
        tr = self._round_trainer()
        if dg is None:
            dg = tr.device_graph(graph)
        watermark_ms = cut if cut is not None else self.last_cut
        logits = tr.predict(params, dg, rows)
        pub = self._publisher.publish(ids[rows], logits, version, int(watermark_ms or 0))
        lag = (pub["published_ms"] - np.concatenate(self._unpredicted)) / 1000.0 if self._unpredicted else []
        self._unpredicted = []
        row.update({f"{prefix}predicted": pub["rows"], f"{prefix}prediction_messages": pub["messages"],
                    f"{prefix}predict_s": time.monotonic() - t0, f"{prefix}prediction_version": version,
                    "prediction_watermark_ms": watermark_ms, **_stats(f"{prefix}prediction_lag_s", np.asarray(lag))})

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


def _stats(name: str, x: np.ndarray) -> dict:
    if not len(x):
        return {}
    return {f"{name}_min": float(x.min()), f"{name}_p50": float(np.median(x)),
            f"{name}_p95": float(np.percentile(x, 95)), f"{name}_max": float(x.max())}


def install_signal_handlers(stream: Stream) -> None:
    """SIGTERM/SIGINT: finish the current round, checkpoint, exit."""
    def handler(signum, frame):
        stream.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
