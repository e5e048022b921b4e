"""The stream's ingest thread: Kafka records -> decoded, checked, deduplicated Arrow batches of pending events.

Per poll, per topic partition: decode each message (one Arrow batch of events) and check its columns
(:func:`schemas.events.decode_events`); then, over the poll's messages at once, check each event column-wise
(:func:`schemas.events.validate_batch`), drop repeats and expire events below the dedupe horizon
(:class:`pipelines.continuous.dedupe.Dedupe`), then buffer the rest as pending with their event times. No step
of it runs per event in Python, and the fixed cost of each step is paid once per poll, not per message.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.continuous import kafka_io
from pipelines.continuous.watermark import NO_TIME
from schemas.events import SchemaError, dead_letter_batch, decode_events, encode_events, validate_batch

POLL_RECORDS = 500


def first_feature_width(batch: pa.RecordBatch) -> int | None:
    ops = batch.column("op")
    mask = pc.and_(pc.is_in(ops, pa.array(["add_vertex", "update_features"])),
                   pc.is_valid(batch.column("features")))
    idx = np.flatnonzero(np.asarray(pc.fill_null(mask, False)))
    if idx.size == 0:
        return None
    return int(pc.list_value_length(batch.column("features"))[int(idx[0])].as_py()) or None


def _concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One batch of the rows of several (pyarrow >= 19 copies each column once; a Table's combine_chunks
    costs ~2.5x as much)."""
    if hasattr(pa, "concat_batches"):
        return pa.concat_batches(batches)
    return pa.Table.from_batches(batches).combine_chunks().to_batches(max_chunksize=1 << 62)[0]


class IngestMixin:
    """The ingest half of :class:`pipelines.continuous.stream.Stream` (its state is the stream's)."""

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
                    parts = c.partitions_for_topic(topic)
                    self.topic_missing = parts is None
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
                recs = c.poll(timeout_ms=100, max_records=POLL_RECORDS)
                for tp, msgs in recs.items():
                    self.take_records(tp.partition, [(m.offset, m.value) for m in msgs])
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
        self.take_records(p, [(offset, value)])

    def take_records(self, p: int, msgs: list[tuple[int, bytes]]) -> None:
        """Take consecutive messages (offset, value) of partition p: each is decoded alone (a malformed one is
        dead-lettered whole), the good ones are checked, deduplicated and buffered as one batch (the per-call
        costs of those steps are paid once per poll, not per message)."""
        batches, offsets = [], []
        n_bad = 0
        for offset, value in msgs:
            try:
                batches.append(decode_events(value))
                offsets.append(offset)
            except SchemaError as e:
                self._dead_raw(value, f"schema: {e}", f"{self.opts.events_topic}/{p}/{offset}")
                n_bad += 1
        if n_bad:
            with self.lock:
                self.counters["messages"] += n_bad
                self.counters["bad_messages"] += n_bad
                self.counters["dead_letters"] += n_bad
                if not batches:
                    self.positions[p] = msgs[-1][0] + 1
                    self.last_record = time.monotonic()
        if not batches:
            return
        rows = np.cumsum([0] + [b.num_rows for b in batches])
        batch = batches[0] if len(batches) == 1 else _concat(batches)

        def dead(mask: np.ndarray, reason) -> None:  # rejected rows, one dead letter per source message
            idx = np.flatnonzero(mask)
            msg = np.searchsorted(rows, idx, side="right") - 1
            for m in np.unique(msg):
                sel = idx[msg == m]
                self._dead_rows(batch.take(pa.array(sel)), [reason(int(i)) for i in sel],
                                f"{self.opts.events_topic}/{p}/{offsets[int(m)]}")

        self._take_batch(p, msgs[-1][0], len(batches), batch, dead)

    def _take_batch(self, p: int, last_offset: int, n_msgs: int, batch: pa.RecordBatch, dead) -> None:
        with self.lock:
            fd, nc = self.feature_dim, self.num_classes
        if fd is None:
            fd = first_feature_width(batch)
        ok, reasons = validate_batch(batch, fd, nc)
        if not ok.all():
            dead(~ok, reasons.__getitem__)
        good = batch if ok.all() else batch.filter(pa.array(ok))
        times = good.column("event_time").cast(pa.int64()).to_numpy()
        with self.lock:
            if self.feature_dim is None and fd is not None:
                self.feature_dim = fd
            if self.wm.current != NO_TIME:
                self.dedupe.advance(self.wm.current)
            new, expired = self.dedupe.take(good.column("event_id"), times)
            horizon = self.dedupe.horizon
            self.counters["duplicates"] += int((~new & ~expired).sum())
            if new.any():
                kb = good if new.all() else good.filter(pa.array(new))
                kt = times[new]
                self.pending.append((kb, kt))
                self.pending_rows += kb.num_rows
                tmin = int(kt.min())
                self.pending_min = tmin if self.pending_min is None else min(self.pending_min, tmin)
                if self.last_cut is not None:
                    self.counters["late"] += int((kt < self.last_cut).sum())
                self.wm.observe(p, int(kt.max()))
            n_exp = int(expired.sum())
            self.counters["messages"] += n_msgs
            self.counters["ingested"] += batch.num_rows
            self.counters["rejected_rows"] += int((~ok).sum())
            self.counters["expired"] += n_exp
            self.counters["dead_letters"] += int((~ok).sum()) + n_exp
            self.positions[p] = last_offset + 1
            self.last_record = time.monotonic()
        if n_exp:
            reason = (f"event time below the dedupe horizon {horizon} (watermark - retention): too late to tell "
                      f"from a repeat")
            good_rows = np.flatnonzero(ok)  # dead() takes positions in the batch as it came
            m = np.zeros(batch.num_rows, bool)
            m[good_rows[expired]] = True
            dead(m, lambda i: reason)

    def _dead_raw(self, value: bytes, reason: str, source: str) -> None:
        headers = [("dorylus.reason", reason[:1000].encode()), ("dorylus.source", source.encode()),
                   ("dorylus.kind", b"message")]
        self._producer.send(self.dlq_topic, value=value or b"", key=source.encode(), headers=headers)

    def _dead_rows(self, rows: pa.RecordBatch, reasons: list[str], source: str) -> None:
        if isinstance(rows, pa.Table):
            rows = rows.combine_chunks().to_batches()[0]
        headers = [("dorylus.reason", reasons[0][:1000].encode()), ("dorylus.source", source.encode()),
                   ("dorylus.kind", b"events"), ("dorylus.count", str(rows.num_rows).encode())]
        value = encode_events(dead_letter_batch(rows, reasons))
        self._producer.send(self.dlq_topic, value=value, key=source.encode(), headers=headers)
