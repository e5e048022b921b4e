"""What the stream writes and restores: incremental checkpoints and resume, model versions, announcements, the
per-round journal of applied event ids, metrics, status and summary files."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from ops import params as P
from ops.spec import CONFIG_FIELDS as MODEL_CONFIG_FIELDS
from pipelines import rundir
from pipelines.config import ConfigError
from pipelines.continuous import checkpoint as ckpt
from pipelines.continuous.state import StreamGraph
from pipelines.continuous.watermark import NO_TIME
from schemas.events import EVENT_SCHEMA

OUTCOMES = ("applied", "noop", "rejected")


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PersistMixin:
    """The checkpoint and output half of :class:`pipelines.continuous.stream.Stream`."""

    # ------------------------------------------------------------------------------------------- checkpoint
    def _checkpoint(self, events: pa.Table | None = None, before_commit=None) -> dict:
        """Checkpoint the state between rounds: a delta of `events` (what the round applied), or a new base
        every `full_checkpoint_every` checkpoints. before_commit(info) runs after the file is written and
        before the manifest commits it."""
        man = ckpt.read_manifest(self.out)
        full = man is None or len(man["chain"]) >= self.opts.full_checkpoint_every
        with self.lock:
            pending = (pa.Table.from_batches([b for b, _ in self.pending], schema=EVENT_SCHEMA)
                       if self.pending else EVENT_SCHEMA.empty_table())
            meta = {"format": 2, "name": self.opts.name, "round": self.round, "version": self.version,
                    "last_cut_ms": self.last_cut, "positions": {str(k): v for k, v in self.positions.items()},
                    "watermark": self.wm.state(), "counters": dict(self.counters),
                    "feature_dim": self.feature_dim, "num_classes": self.num_classes,
                    "events_topic": self.opts.events_topic, "interval_ms": self.interval_ms,
                    "dedupe_horizon": self.dedupe.horizon, "partitions": self.graph.num_partitions,
                    "config": self.cfg.to_dict(), "created": time.time()}
            owner = None
            if self.ownership is not None:
                meta["ownership"] = {"base_cut": self.ownership.base_cut,
                                     "repartitions": self.ownership.repartitions}
                owner = self.ownership.checkpoint(full)
            keys = self.dedupe.snapshot() if full else self.dedupe.drain_log()
            if full:
                self.dedupe.drain_log()
        # Dead letters of the messages below these offsets were sent before the snapshot: make them durable
        # before the offsets are.
        self._producer.flush(timeout=60)
        kill = (not full and self._kill_in_checkpoint is not None and self.round >= self._kill_in_checkpoint)
        info = ckpt.save(self.out, meta=meta, params=self.params, opt_leaves=self.opt_leaves, pending=pending,
                         keys=keys, graph=self.graph.arrays() if full else None, events=events, owner=owner,
                         kill_before_commit=kill, before_commit=before_commit)
        if self.ownership is not None:
            self.ownership.saved()
        with self.lock:
            self._saved = (meta["round"], {int(k): v for k, v in meta["positions"].items()})
        return info

    def _resume(self) -> bool:
        state = ckpt.load(self.out)
        if state is None:
            if (self.out / "metrics.jsonl").exists():
                (self.out / "metrics.jsonl").unlink()  # rounds of a run that never checkpointed
            for f in self.out.glob("applied/*"):
                f.unlink()
            return False
        meta = state["meta"]
        self._check_compatible(meta)
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
        if "ownership" in meta:
            from pipelines.continuous.ownership import Ownership

            self.ownership = Ownership(self.cfg.partitions, self.cfg.partitioner, self.cfg.seed)
            self.ownership.restore(state["owners"], meta["ownership"]["base_cut"],
                                   meta["ownership"]["repartitions"])
        for events in state["deltas"]:  # the rounds since the base, re-applied (deterministic)
            self._apply(events, replay=True)
        for keys in state["keys"]:
            self.dedupe.restore(keys, None)
        self.dedupe.restore({"h1": [], "h2": [], "window": []}, meta.get("dedupe_horizon"))
        self.dedupe.log = []
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
        self._refresh_predictions = True  # what changed since the last version before the crash is unknown
        self._drop_outputs_after_checkpoint()
        return True

    def _check_compatible(self, meta: dict) -> None:
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

    def _drop_outputs_after_checkpoint(self) -> None:
        """Outputs of rounds after the checkpoint are redone: drop them."""
        path = self.out / "metrics.jsonl"
        rows = list(rundir.read_jsonl(path)) if path.exists() else []
        kept = [r for r in rows if r.get("round", 0) <= self.round]
        rundir.atomic_write_text(path, "".join(json.dumps(r, default=rundir._json_default) + "\n" for r in kept))
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
                self.served = P.unflatten({k: z[k] for k in z.files if k != "__meta__"})
            rundir.atomic_write_json(self.out / "models" / "latest.json", info)

    def _clear(self) -> None:
        ckpt.clear(self.out)
        for f in [self.out / "metrics.jsonl", self.out / "summary.json", self.out / "status.json",
                  *self.out.glob("models/*"), *self.out.glob("applied/*")]:
            if f.exists():
                f.unlink()

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

    def _journal(self, k: int, ids: pa.Array, outcome: np.ndarray) -> None:
        t = pa.table({"event_id": ids, "outcome": pa.array(OUTCOMES).take(pa.array(outcome.astype(np.int32)))})
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
                  "dedupe_ids": self.dedupe.size, "uptime_s": time.monotonic() - self.t_start}
        # atomic for readers (a rename) but not fsynced: progress, rewritten every second from the ingest thread,
        # where an fsync under I/O load stalled reading the topic (~80 ms a call)
        path = self.out / "status.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(st, indent=2, sort_keys=True, default=rundir._json_default) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def _summary(self, status: str) -> dict:
        with self.lock:
            s = {"status": status, "name": self.opts.name, "rounds": self.round, "version": self.version,
                 "counters": dict(self.counters), "pending": self.pending_rows, "last_cut_ms": self.last_cut,
                 "nodes": self.graph.num_vertices, "edges": self.graph.num_edges, "dedupe_ids": self.dedupe.size,
                 "seconds": time.monotonic() - self.t_start}
        if self.last_row is not None:
            s["last_round"] = self.last_row
        return s


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
