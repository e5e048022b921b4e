"""The in-memory transport: one append-only log per (kind, partition) channel, an offset per consumer group."""
from __future__ import annotations

import collections
import threading
import time

from pipelines.transports.base import Consumer, Transport
from schemas.tasks import Message, copy_arrays, freeze_arrays


class _Log:
    def __init__(self):
        self.base = 0           # offset of items[0]
        self.items: list = []
        self.offsets: dict[str, int] = {}


class MemoryTransport(Transport):
    """Kafka's semantics in one process: consumers of one group split a channel, each group sees every message.

    Roles share nothing mutable: payloads travel as read-only views (a role that tried to write into a received
    array would get an error), or as copies with copy=True, as if the bytes had crossed a network."""

    def __init__(self, copy: bool = False):
        self._logs: dict[tuple[str, int], _Log] = collections.defaultdict(_Log)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        # channel -> the conditions (on _cv's lock) of the consumers reading it: a send wakes only those, where
        # one condition for all woke every role's thread on every message (a dozen threads, each taking the
        # GIL to find nothing for it)
        self._waiters: dict[tuple[str, int], list] = collections.defaultdict(list)
        self._copy = copy
        self._sent = collections.Counter()
        self._bytes = collections.Counter()
        self._groups = 0

    def send(self, kind: str, partition: int, msg: Message) -> None:
        msg = copy_arrays(msg) if self._copy else freeze_arrays(msg)
        with self._cv:
            self._logs[(kind, partition)].items.append(msg)
            self._sent[kind] += 1
            self._bytes[kind] += msg.nbytes()
            for cv in self._waiters.get((kind, partition), ()):
                cv.notify()

    def consumer(self, subscriptions, group=None) -> Consumer:
        with self._cv:
            if group is None:
                self._groups += 1
                group = f"anon-{self._groups}"
            for ch in subscriptions:
                log = self._logs[ch]
                log.offsets.setdefault(group, log.base)  # a new group reads from the earliest retained
        return _MemoryConsumer(self, list(subscriptions), group)

    def stats(self) -> dict:
        with self._cv:
            return {"messages": dict(self._sent), "bytes": dict(self._bytes)}

    def _take(self, ch, group, limit, out):
        log = self._logs[ch]
        off = log.offsets[group]
        k = off - log.base
        take = log.items[k: k + limit]
        if take:
            out.extend(take)
            log.offsets[group] = off + len(take)
            low = min(log.offsets.values())
            if low > log.base:  # every group has read these: drop them (payloads can be megabytes)
                del log.items[: low - log.base]
                log.base = low


class _MemoryConsumer(Consumer):
    def __init__(self, transport: MemoryTransport, subs, group):
        self.transport = transport
        self.subs = subs
        self.group = group
        self._rr = 0
        self._cv = threading.Condition(transport._lock)  # the transport's lock; woken by sends to its channels
        with transport._cv:
            for ch in subs:
                transport._waiters[tuple(ch)].append(self._cv)

    def close(self) -> None:
        with self.transport._cv:
            for ch in self.subs:
                waiters = self.transport._waiters.get(tuple(ch), [])
                if self._cv in waiters:
                    waiters.remove(self._cv)

    def poll(self, timeout: float, max_messages: int = 256) -> list[Message]:
        deadline = time.monotonic() + timeout
        out: list[Message] = []
        with self.transport._cv:
            while True:
                n = len(self.subs)
                for k in range(n):
                    if len(out) >= max_messages:
                        break
                    self.transport._take(self.subs[(self._rr + k) % n], self.group, max_messages - len(out), out)
                self._rr = (self._rr + 1) % max(n, 1)
                if out:
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    return out
                self._cv.wait(left)
