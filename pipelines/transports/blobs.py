"""Arrays sent once per channel partition: a sender's and its reader's mirrored tables of what was carried.

A graph server sends its tensor tasks the same arrays again and again: a backward task carries its forward
task's inputs (workers are stateless), and a GA over the input features gives the same rows every epoch (its
AV task and that task's backward carry them each epoch). On one Kafka topic partition, which one process reads
in offset order, the sender can send such an array once and refer to it afterwards:

- The sender keys every array of at least `MIN_BYTES` by its content (XXH3-128 of dtype, shape and bytes). A key
  its table holds travels as a reference (``ref``); any other array travels in full and is kept (``keep``).
- Both sides apply the same operations to a table of the same byte budget, in the same order: first every
  reference of a message is touched (moved to the newest end), then every kept array is added and the oldest
  entries leave while the table is over budget. The reader sees the messages of a partition in the order they
  were sent, so its table is always the sender's: a reference always finds its array.
- The operations of a message travel in its meta (``META_KEY``: ``[[name, key, keep], ...]``) and are taken out
  before the engine sees it; results do not change (same bits).

A reader that did not see the partition from the start (a new consumer group, a restarted process) cannot
resolve references to arrays sent before it: such a message fails to decode (`BlobMissing`), with its reason,
like any other value the engine cannot use.
"""
from __future__ import annotations

import collections

import numpy as np
import xxhash

#: meta key of a message's table operations
META_KEY = "wire.blobs"
#: arrays smaller than this always travel in full (a reference costs ~100 bytes of meta)
MIN_BYTES = 64 * 2**10
#: bytes each side's table holds per channel partition (the reader keeps the arrays themselves)
BUDGET_BYTES = 256 * 2**20


class BlobMissing(ValueError):
    """A message refers to an array its reader never saw (it did not read the partition from the start)."""


def content_key(a: np.ndarray) -> str:
    """The table key of `a`: XXH3-128 of its dtype, shape and bytes. A non-cryptographic hash is enough: only the
    sender computes keys, over its own arrays, and two of them collide with probability ~2^-128. SHA-256 here ran
    at 1.6 GB/s and took most of a graph server's CPU in a Kafka epoch at ogbn-arxiv's size (0.23 of its
    0.25-0.35 cores, py-spy); XXH3 runs at about 40 GB/s."""
    h = xxhash.xxh3_128(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


class _Table:
    """An LRU table of content keys with their sizes (and, on the reader's side, the arrays)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.items: collections.OrderedDict = collections.OrderedDict()  # key -> (size, array or None)
        self.bytes = 0

    def apply(self, refs: list[str], keeps: list[tuple[str, int, object]]) -> list:
        """Touch `refs` (returning their arrays, None where absent), then add `keeps` (key, size, array)."""
        found = []
        for k in refs:
            item = self.items.get(k)
            if item is not None:
                self.items.move_to_end(k)
            found.append(None if item is None else item[1])
        for k, size, arr in keeps:
            if k in self.items:
                continue
            self.items[k] = (size, arr)
            self.bytes += size
            while self.bytes > self.budget and self.items:
                _, (s, _) = self.items.popitem(last=False)
                self.bytes -= s
        return found


class SenderBlobs:
    """The sending side: per channel partition, which arrays its reader holds. The caller serializes the sends
    of one partition (plan, then commit once the message is handed to the producer)."""

    def __init__(self, budget: int = BUDGET_BYTES, min_bytes: int = MIN_BYTES):
        self.budget, self.min_bytes = budget, min_bytes
        self.tables: dict = collections.defaultdict(lambda: _Table(self.budget))
        self.saved_bytes = collections.Counter()  # channel -> array bytes sent as references

    def plan(self, channel, arrays: dict) -> tuple[dict, list, int]:
        """(arrays to carry, the meta operations, bytes carried) for a message to `channel`; nothing changes
        until `commit`."""
        table = self.tables[channel]
        carried, ops, nbytes = {}, [], 0
        for name in sorted(arrays):
            a = arrays[name]
            if not isinstance(a, np.ndarray) or a.nbytes < self.min_bytes or a.nbytes > self.budget:
                carried[name] = a
                nbytes += getattr(a, "nbytes", 0)
                continue
            key = content_key(a)
            if key in table.items:
                ops.append([name, key, 0])
            else:
                carried[name] = a
                nbytes += a.nbytes
                ops.append([name, key, 1])
        return carried, ops, nbytes

    def commit(self, channel, arrays: dict, ops: list) -> None:
        refs = [k for _, k, keep in ops if not keep]
        keeps = [(k, arrays[n].nbytes, None) for n, k, keep in ops if keep]
        self.tables[channel].apply(refs, keeps)
        saved = sum(arrays[n].nbytes for n, _, keep in ops if not keep)
        if saved:
            self.saved_bytes[channel] += saved


class ReaderBlobs:
    """The reading side: per (channel partition, reader group), the arrays it was sent to keep."""

    def __init__(self, budget: int = BUDGET_BYTES):
        self.budget = budget
        self.tables: dict = collections.defaultdict(lambda: _Table(self.budget))

    def resolve(self, channel, arrays: dict, ops: list, *, replay: bool = False) -> dict:
        """The message's full arrays. replay: a record read again (the table has moved on): resolve what it can,
        change nothing."""
        table = self.tables[channel]
        refs = [(n, k) for n, k, keep in ops if not keep]
        if replay:
            got = [table.items.get(k) for _, k in refs]
            if any(g is None for g in got):
                raise BlobMissing("a record read again refers to arrays that have left the table")
            return {**arrays, **{n: g[1] for (n, _), g in zip(refs, got)}}
        keeps, copies = [], {}
        for n, k, keep in ops:
            if keep:
                a = np.array(arrays[n])  # its own copy: the table need not keep the whole record alive
                a.flags.writeable = False
                keeps.append((k, a.nbytes, a))
                copies[n] = a
        found = table.apply([k for _, k in refs], keeps)
        missing = [n for (n, _), a in zip(refs, found) if a is None]
        if missing:
            raise BlobMissing(f"arrays {missing} were sent earlier on this partition, before this reader started "
                              f"(a reader must read a deduplicated partition from its start)")
        return {**arrays, **copies, **{n: a for (n, _), a in zip(refs, found)}}
