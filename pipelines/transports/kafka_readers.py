"""The Kafka transport's readers: a consumer of fixed partitions with its own reader thread, and the work-sharing
group the tensor-worker threads of one process read through (see `pipelines.transports.kafka`)."""
from __future__ import annotations

import collections
import logging
import sys
import threading
import time

from pipelines.transports.base import Consumer
from schemas.tasks import Message

#: `AssignedConsumer`'s reader thread: one Kafka poll waits this long at most (it also bounds how late an offset
#: commit or a stop is), and fetching pauses while this much is read but not yet taken by the engine
READER_POLL_MS = 200
READER_BUFFER_RECORDS = 256
READER_BUFFER_BYTES = 256 * 2**20
#: how long stopping a reader thread may take: its poll, and a commit in flight
READER_STOP_S = 35.0
#: a reader that has handed out no record for this long looks at its partitions' ends; if records wait there, its
#: Kafka consumer has stopped fetching (a client state that a leader change left stuck) and is rebuilt
READER_STUCK_S = 20.0

log = logging.getLogger("pipelines.transports.kafka")


def transient_errors() -> tuple:
    """kafka-python errors of a broker that is out of reach for now (a cut, a restart, a leader moving): readers
    retry them, and the transport's broker watch alone decides when the brokers are lost (``broker_timeout_s``)."""
    from kafka import errors

    # UnknownBrokerIdError: kafka-python 3.0 raises it out of a poll that fetches from (or a commit that goes
    # to) a broker the newest metadata no longer lists, a killed leader before the controller has moved its
    # partitions (seen in CI: a graph server's reader died of it 0.1 s after the kill)
    return (errors.KafkaConnectionError, errors.NodeNotReadyError, errors.KafkaTimeoutError,
            errors.RequestTimedOutError, errors.BrokerNotAvailableError, errors.UnknownBrokerIdError)


def _poll_or_nothing(kc, timeout_ms: int, max_records: int) -> dict:
    """kc.poll, or no records (after waiting out the poll's time) while the broker is out of reach."""
    try:
        return kc.poll(timeout_ms=timeout_ms, max_records=max_records)
    except transient_errors() as e:
        log.info("poll while the broker is out of reach: %s", e)
        time.sleep(max(timeout_ms, 50) / 1000)
        return {}


class StuckWatch:
    """Notices a Kafka consumer that has stopped fetching while records wait, and builds its replacement.

    kafka-python's consumer keeps per-partition state across a broker failure (the group coordinator, leader
    epochs to validate, positions to reset); a consumer whose state a failover left stuck fetches nothing again
    while producers go on writing, and the run stalls with every process alive. Only the Kafka consumer is
    rebuilt: the replacement starts at the offset after the last record read, so nothing is read twice or
    skipped, and it looks up coordinator, leaders and epochs afresh."""

    def __init__(self, transport, group, tps):
        self.transport, self.group, self.tps = transport, group, list(tps)
        self.next: dict = {}               # tp -> offset after the last record read
        self.last_record = time.monotonic()
        self.rebuilds = 0

    def saw(self, tp, offset: int) -> None:
        self.next[tp] = offset + 1
        self.last_record = time.monotonic()

    def rest(self) -> None:
        """The reader did not fetch on purpose (a full buffer): that quiet is not the consumer's."""
        self.last_record = time.monotonic()

    def maybe_rebuild(self, kc):
        """`kc`, or a new Kafka consumer at the same offsets when `kc` read nothing for `READER_STUCK_S` while
        records wait in its partitions."""
        if time.monotonic() - self.last_record < READER_STUCK_S or not self.tps:
            return kc
        self.last_record = time.monotonic()  # look again only after another quiet spell
        try:
            end = kc.end_offsets(self.tps, timeout_ms=5000)
            pos = {tp: self.next[tp] if tp in self.next else kc.position(tp, timeout_ms=5000) for tp in self.tps}
        except Exception as e:  # the brokers are away: the broker watch decides about those
            log.info("stuck check: %s", e)
            return kc
        behind = {tp: end[tp] - pos[tp] for tp in self.tps if end.get(tp, 0) > pos[tp]}
        if not behind:
            return kc
        self.rebuilds += 1
        print(f"dorylus: warning: the Kafka consumer of {self.transport.client_id} ({self.group or 'no group'}) "
              f"read nothing for {READER_STUCK_S:g}s while {sum(behind.values())} records wait in "
              f"{', '.join(tp_key(tp) for tp in behind)}: replacing it", file=sys.stderr, flush=True)
        new = self.transport._new_kafka_consumer(self.group)
        new.assign(self.tps)
        for tp, off in pos.items():
            new.seek(tp, off)
        try:
            kc.close(autocommit=False, timeout_ms=2000)
        except Exception as e:  # a consumer of brokers in trouble
            log.info("stuck consumer close: %s", e)
        self.last_record = time.monotonic()  # the new one's quiet counts from now
        return new


def tp_key(tp) -> str:
    return f"{tp.topic}/{tp.partition}"


class AssignedConsumer(Consumer):
    """A reader of fixed partitions (Kafka `assign`), committing to its group when the engine says so.

    A reader thread keeps one long Kafka poll open (it returns as soon as a record lands) and hands decoded
    messages to `poll` through a bounded buffer, so `poll` costs what a condition wait costs whatever its
    timeout. The roles' loops poll with timeouts of a few milliseconds: on kafka-python each such poll is a
    fetch round of its own, and a loop of them burnt about half a core per consumer (the profile of issue 13).
    The thread is the only one that touches the Kafka consumer while it runs (kafka-python's consumer is not
    thread-safe): offset commits are handed to it."""

    def __init__(self, transport, subs, group):
        import kafka

        self.transport = transport
        self.group = group
        self.kc = transport._new_kafka_consumer(group)
        self.tps = [kafka.TopicPartition(transport.topic(k), p) for k, p in subs]
        self.kc.assign(self.tps)
        self._watch = StuckWatch(transport, group, self.tps)
        self._returned: dict = {}     # tp -> offset after the last record returned by poll
        self._processed: dict = {}    # tp -> offset after the last record the engine has handled
        self._committed: dict = {}
        self._last_commit = 0.0
        self._closed = False
        self._gone = False
        self._lock = threading.Lock()  # the Kafka consumer, between the reader and drain/close
        self._cv = threading.Condition()
        self._buffer: collections.deque = collections.deque()  # (tp, offset, message or None: a dead letter)
        self._buffered_bytes = 0
        self._reader: threading.Thread | None = None
        self._reader_stop = threading.Event()
        self._reader_error: BaseException | None = None
        self._commit_request: dict | None = None  # offsets for the reader to commit (async)

    # ------------------------------------------------------------------------------------------ reader
    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"kafka-reader-{self.group or 'anon'}")
        self._reader.start()

    def _stop_reader(self) -> None:
        th = self._reader
        if th is None:
            return
        self._reader_stop.set()
        with self._cv:
            self._cv.notify_all()
        th.join(timeout=READER_STOP_S)
        self._reader = None

    def _read_loop(self) -> None:
        try:
            while not self._reader_stop.is_set():
                with self._cv:  # a full buffer pauses fetching: a slow engine does not pile up payloads
                    while (self._buffered_bytes > READER_BUFFER_BYTES or len(self._buffer) > READER_BUFFER_RECORDS) \
                            and not self._reader_stop.is_set():
                        self._cv.wait(0.1)
                        self._watch.rest()
                    request, self._commit_request = self._commit_request, None
                with self._lock:
                    if request:
                        self._send_commit(request, sync=False)
                    batches = _poll_or_nothing(self.kc, READER_POLL_MS, READER_BUFFER_RECORDS)
                    if not batches:
                        self.kc = self._watch.maybe_rebuild(self.kc)
                got = []
                for tp, recs in batches.items():
                    for rec in recs:
                        self._watch.saw(tp, rec.offset)
                        got.append((tp, rec.offset, self.transport.decode_record(rec, self.group),
                                    len(rec.value or b"")))
                if got:
                    with self._cv:
                        for tp, off, msg, size in got:
                            self._buffer.append((tp, off, msg, size))
                            self._buffered_bytes += size
                        self._cv.notify_all()
        except BaseException as e:  # surfaces in the engine's next poll
            self._reader_error = e
            with self._cv:
                self._cv.notify_all()

    # ------------------------------------------------------------------------------------------ engine side
    def poll(self, timeout: float, max_messages: int = 256) -> list[Message]:
        if self._closed:
            return []
        self.transport._raise_if_lost()
        if self._gone:
            return []
        if self._reader is None:
            if self._reader_stop.is_set():  # drained: read directly, as at the end of a role
                return self._poll_direct(timeout, max_messages)
            self._start_reader()
        out = []
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cv:
            while not self._buffer and self._reader_error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            if self._reader_error is not None:
                err, self._reader_error = self._reader_error, None
                self._reader = None
                self._reader_stop.set()
                raise err
            while self._buffer and len(out) < max_messages:
                tp, off, msg, size = self._buffer.popleft()
                self._buffered_bytes -= size
                self._returned[tp] = off + 1
                if msg is not None:
                    out.append(msg)
            self._cv.notify_all()
        return out

    def _poll_direct(self, timeout: float, max_messages: int) -> list[Message]:
        with self._lock:
            batches = _poll_or_nothing(self.kc, int(max(timeout, 0.0) * 1000), max_messages)
            records = []
            for tp, recs in batches.items():
                if recs:
                    records.extend(recs)
                    self._returned[tp] = recs[-1].offset + 1
                    self._watch.saw(tp, recs[-1].offset)
        return self.transport.decode_records(records, self.group)

    def commit(self) -> None:
        self._processed.update(self._returned)
        if self.group is None or self._processed == self._committed:
            return
        now = time.monotonic()
        if now - self._last_commit < self.transport.commit_interval_s:
            return
        self._last_commit = now
        if self._reader is not None:
            with self._cv:
                self._commit_request = dict(self._processed)
                self._cv.notify_all()
        else:
            with self._lock:
                self._send_commit(dict(self._processed), sync=False)

    def _send_commit(self, processed: dict, sync: bool) -> None:
        """Commit `processed` (tp -> next offset) to the group; the caller holds the consumer's lock."""
        import kafka

        from kafka.structs import OffsetAndMetadata

        offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in processed.items()}
        if not offsets:
            return
        try:
            if sync:
                self.kc.commit(offsets, timeout_ms=10000)
                self._committed = processed
            else:
                def done(_offsets, exc):
                    if not isinstance(exc, Exception):
                        self._committed = processed
                self.kc.commit_async(offsets, callback=done)
        except kafka.errors.KafkaError as e:  # broker away: the next commit carries these offsets too
            log.info("offset commit deferred: %s", e)

    def processed_offsets(self) -> dict:
        return {tp_key(tp): off for tp, off in self._processed.items()}

    def _hand_back_buffer(self) -> None:
        """With the reader stopped: what it had read counts as returned (drain and close drop it)."""
        with self._cv:
            while self._buffer:
                tp, off, _, _ = self._buffer.popleft()
                self._returned[tp] = off + 1
            self._buffered_bytes = 0

    def _drain(self, deadline: float) -> None:
        if self._gone:
            return
        self._stop_reader()
        self._hand_back_buffer()
        while time.monotonic() < deadline:
            try:
                with self._lock:  # the end moves if a last message lands meanwhile: look again each round
                    end = self.kc.end_offsets(self.tps)
                    behind = [tp for tp in self.tps if self.kc.position(tp) < end[tp]]
            except transient_errors():
                time.sleep(0.1)
                continue
            if not behind:
                break
            self._poll_direct(0.1, max_messages=1024)
        self._processed.update(self._returned)
        if self.group is not None:
            with self._lock:
                self._send_commit(dict(self._processed), sync=True)

    def close(self) -> None:
        """Commit what was handled; with a lingering transport the consumer stays readable until it closes."""
        self._processed.update(self._returned)
        if not self.transport.linger_consumers:
            self._closed = True
            self._close_now()

    def _close_now(self) -> None:
        if self._gone:
            return
        self._stop_reader()
        self._processed.update(self._returned)
        self._gone = True
        try:  # closing never fails a run: at worst a restarted reader sees a few messages again
            with self._lock:
                if self.group is not None:
                    self._send_commit(dict(self._processed), sync=True)
                self.kc.close(autocommit=False, timeout_ms=5000)
        except Exception as e:
            log.info("consumer close: %s", e)


class SharedGroup:
    """One Kafka consumer per process for a work-sharing group, handing records to in-process members.

    The process reads its static share of the work-queue partitions (``KafkaTransport.work_share``). Offsets
    are committed up to the first record a member has taken but not yet committed, so a record is never marked
    consumed before the member that took it has handled it."""

    def __init__(self, transport, kinds: list[str], group: str):
        import kafka

        self.transport = transport
        self.group = group
        self.kc = transport._new_kafka_consumer(group)
        self.lock = threading.Lock()
        self.buffer: collections.deque = collections.deque()
        self.next_offset: dict = {}          # tp -> offset after the last record handed out
        self.outstanding: dict = collections.defaultdict(set)  # tp -> offsets handed out, not committed
        self.committed: dict = {}
        self._last_commit = 0.0
        self._gone = False
        k, w = transport.work_share
        self.tps = [kafka.TopicPartition(transport.topic(kind), p) for kind in kinds
                    for p in range(transport.topic_partitions(kind)) if p % w == k]
        if not self.tps:
            print(f"dorylus: warning: work-queue member {k} of {w} has no partition to read (the run has "
                  f"{transport.partitions} graph servers)", file=sys.stderr)
        self.kc.assign(self.tps)
        self._watch = StuckWatch(transport, group, self.tps)

    def take(self, timeout: float, max_messages: int, member) -> list[Message]:
        deadline = time.monotonic() + timeout
        while True:
            self.transport._raise_if_lost()
            with self.lock:
                if self._gone:
                    return []
                if not self.buffer:
                    wait = max(0.0, min(deadline - time.monotonic(), 0.05))
                    batches = _poll_or_nothing(self.kc, int(wait * 1000), 64)
                    for tp, recs in batches.items():
                        self.buffer.extend((tp, r) for r in recs)
                        if recs:
                            self._watch.saw(tp, recs[-1].offset)
                    if not batches:
                        self.kc = self._watch.maybe_rebuild(self.kc)
                taken = []
                while self.buffer and len(taken) < max_messages:
                    tp, rec = self.buffer.popleft()
                    self.next_offset[tp] = rec.offset + 1
                    self.outstanding[tp].add(rec.offset)
                    member.taken.append((tp, rec.offset))
                    taken.append(rec)
                if taken:  # decoded (and counted) in offset order, before another member takes more
                    return self.transport.decode_records(taken, self.group)
            if time.monotonic() >= deadline:
                return []

    def done(self, member) -> None:
        with self.lock:
            for tp, off in member.taken:
                self.outstanding.get(tp, set()).discard(off)
            member.taken.clear()
            if time.monotonic() - self._last_commit >= self.transport.commit_interval_s:
                self._commit_locked(sync=False)

    def _commit_locked(self, sync: bool) -> None:
        from kafka.structs import OffsetAndMetadata
        import kafka

        offsets = {}
        for tp, nxt in self.next_offset.items():
            out = self.outstanding.get(tp)
            off = min(out) if out else nxt
            if self.committed.get(tp) != off:
                offsets[tp] = off
        if not offsets:
            return
        self._last_commit = time.monotonic()
        try:
            om = {tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()}
            if sync:
                self.kc.commit(om, timeout_ms=10000)
            else:
                self.kc.commit_async(om)
            self.committed.update(offsets)
        except kafka.errors.KafkaError as e:
            log.info("offset commit deferred: %s", e)

    def processed_offsets(self) -> dict:
        with self.lock:
            return {tp_key(tp): off for tp, off in self.committed.items()}

    def drain(self, deadline: float) -> None:
        with self.lock:
            if self._gone:
                return
            tps = self.tps
            while tps and time.monotonic() < deadline:
                try:
                    end = self.kc.end_offsets(tps)
                    caught_up = all(self.kc.position(tp) >= end[tp] for tp in tps)
                except transient_errors():
                    time.sleep(0.1)
                    continue
                if caught_up and not self.buffer:
                    break
                recs = [r for _, r in self.buffer]
                self.buffer.clear()
                for tp, rs in _poll_or_nothing(self.kc, 100, 1024).items():
                    recs.extend(rs)
                for r in recs:
                    from kafka import TopicPartition

                    tp = TopicPartition(r.topic, r.partition)
                    self.next_offset[tp] = max(self.next_offset.get(tp, 0), r.offset + 1)
                self.transport.decode_records(recs, self.group)
            self.outstanding.clear()
            self._commit_locked(sync=True)

    def close(self) -> None:
        with self.lock:
            if self._gone:
                return
            self._gone = True
            try:
                self._commit_locked(sync=True)
                self.kc.close(autocommit=False, timeout_ms=5000)
            except Exception as e:
                log.info("consumer close: %s", e)


class MemberConsumer(Consumer):
    def __init__(self, shared: SharedGroup):
        self.shared = shared
        self.taken: list = []
        self.group = shared.group

    def poll(self, timeout: float, max_messages: int = 256) -> list[Message]:
        return self.shared.take(timeout, max_messages, self)

    def commit(self) -> None:
        self.shared.done(self)

    def close(self) -> None:
        self.shared.done(self)

    def _drain(self, deadline: float) -> None:
        pass

    def _close_now(self) -> None:
        pass
