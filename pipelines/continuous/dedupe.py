"""Bounded exactly-once dedupe: the ids of taken events, kept only while a repeat of them can still be taken.

A repeat of an event (a producer retry, a re-sent slice) carries the same event id and event time. Ids are kept
per event-time window (the round interval), as two 64-bit hashes of the id's bytes (a false duplicate needs both
to collide: about 2^-128 per pair), in a few sorted runs per window (merged like a binary counter, so taking
and looking up a batch are sorts and binary searches, never a Python step per event).

The state is bounded by the *horizon*: the watermark minus the retention. Windows that end at or below it are
dropped; an event whose time is below it can no longer be told from a repeat and is refused as expired (the
stream dead-letters it, as Flink drops events beyond the allowed lateness). So the state holds the events of the
last ``retention`` of event time, whatever the length of the stream.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

_M1, _M2 = np.uint64(0x100000001B3), np.uint64(0x9E3779B97F4A7C15)
_S1, _S2 = np.uint64(0xCBF29CE484222325), np.uint64(0x84222325CBF29CE4)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], np.uint64)  # the low k bytes
_R1, _R2 = np.uint64(31), np.uint64(64 - 31)


HASH_CHUNK = 1 << 16  # ids hashed at a time: the passes over each word column then stay in the cache (~1.8x
# faster than passes over a million ids at once)


def id_hashes(ids: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_id_hashes` of chunks of at most HASH_CHUNK ids (the same values: a slice hashes as its values)."""
    ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    if len(ids) <= HASH_CHUNK:
        return _id_hashes(ids)
    parts = [_id_hashes(ids.slice(i, HASH_CHUNK)) for i in range(0, len(ids), HASH_CHUNK)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _id_hashes(ids: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Two independent 64-bit hashes of each string, column-wise: word j of every id that has one (its bytes
    8j..8j+7, read as one unaligned little-endian uint64, the bytes past its end masked off) is folded into both hashes
    (multiply, xor, rotate: a few array passes per word), which get a full avalanche mix at the end; the
    length seeds them, so masked padding cannot collide."""
    n = len(ids)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    if pa.types.is_large_string(ids.type):
        ids = ids.cast(pa.string())
    offsets = np.frombuffer(ids.buffers()[1], np.int32, n + 1, ids.offset * 4).astype(np.int64)
    lo, hi = int(offsets[0]), int(offsets[-1])
    raw = np.frombuffer(ids.buffers()[2], np.uint8)[lo:hi] if hi > lo else np.zeros(0, np.uint8)
    data = np.zeros(raw.size + 8, np.uint8)
    data[:raw.size] = raw
    words = np.ndarray((raw.size + 1,), "<u8", data, 0, (1,))  # the 8 bytes starting at each byte
    start, lengths = offsets[:-1] - lo, np.diff(offsets)
    ln = lengths.astype(np.uint64)
    h1, h2 = _S1 ^ (ln * _M2), _S2 + ln
    full = int(lengths.min()) // 8  # words inside every id: all of them fold it, unmasked
    with np.errstate(over="ignore"):
        for j in range(-(-int(lengths.max()) // 8)):
            # Only the ids that have a word j fold it: folding a zero word would still change a hash, and an id's
            # hash must not depend on the longest id of its batch (a repeat in another batch must match).
            if j < full:
                w = words[start + 8 * j]
                a1, a2 = h1, h2
            else:
                act = np.flatnonzero(lengths > 8 * j)
                w = words[start[act] + 8 * j] & _MASKS[np.minimum(lengths[act] - 8 * j, 8)]
                a1, a2 = h1[act], h2[act]
            a1 ^= w
            a1 *= _M1
            a1 = (a1 << _R1) | (a1 >> _R2)
            a2 += w
            a2 *= _M2
            a2 ^= a2 >> np.uint64(29)
            if j < full:
                h1, h2 = a1, a2
            else:
                h1[act], h2[act] = a1, a2
        return _mix(h1), _mix(h2 ^ np.uint64(0x5851F42D4C957F2D))


_BITS = 24  # the low bits of the first hash that hold a position while sorting (2^24 ids a call)
_LOW = np.uint64((1 << _BITS) - 1)
_HIGH = ~_LOW
_FAN_IN = 8          # runs of one level merged at once (a key is merged log_8(window / batch) times)
_FILTER_SLOTS = 4    # filter slots per held key at least (1/8 to 1/4 of new keys need an exact look-up)


def _sort_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) sorted by a (a's low _BITS bits are clear, so a | position sorts by value and gives the order)."""
    if a.size < 1 << _BITS:
        packed = np.sort(a | np.arange(a.size, dtype=np.uint64))
        return packed & _HIGH, b[(packed & _LOW).astype(np.int64)]
    o = np.argsort(a, kind="stable")
    return a[o], b[o]


class _Window:
    """The keys of one event-time window: sorted runs of (h1, h2), h1 ascending, in levels (a level's runs
    are merged into one of the next level when it has _FAN_IN), and a one-hash filter over h2 in front of
    them (a byte per slot, 4-8 slots per held key, so a plain scatter marks it): a key whose slot is clear is
    not held, without a binary search through the runs (new keys, the common case, mostly stop there)."""

    def __init__(self):
        self.runs: list[tuple[int, np.ndarray, np.ndarray]] = []  # (level, h1, h2)
        self.size = 0
        self._shift = np.uint64(64 - 12)
        self._slots = np.zeros(1 << 12, np.uint8)

    @property
    def filter_bytes(self) -> int:
        return self._slots.nbytes

    def _slot(self, h2: np.ndarray) -> np.ndarray:
        return (h2 >> self._shift).astype(np.intp)

    def contains(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        hit = np.zeros(h1.size, bool)
        maybe = np.flatnonzero(self._slots[self._slot(h2)])
        if not maybe.size:
            return hit
        q1, q2 = h1[maybe], h2[maybe]
        found = np.zeros(maybe.size, bool)
        for _, a, b in self.runs:
            pos = np.searchsorted(a, q1)
            pc_ = np.minimum(pos, a.size - 1)
            eq = a[pc_] == q1
            found |= eq & (b[pc_] == q2)
            # keys of equal first hash (their low bits are cleared: rare, not never): look through the range
            nx = np.minimum(pos + 1, a.size - 1)
            for i in np.flatnonzero(eq & ~found & (nx > pc_) & (a[nx] == q1)):
                hi = np.searchsorted(a, q1[i], side="right")
                found[i] = bool((b[pos[i]:hi] == q2[i]).any())
        hit[maybe] = found
        return hit

    def add(self, h1: np.ndarray, h2: np.ndarray) -> None:
        """Add keys sorted by h1."""
        self.runs.append((0, h1, h2))
        self.size += h1.size
        while len(self.runs) >= _FAN_IN and len({r[0] for r in self.runs[-_FAN_IN:]}) == 1:
            group, self.runs = self.runs[-_FAN_IN:], self.runs[:-_FAN_IN]
            a, b = _sort_pairs(np.concatenate([r[1] for r in group]), np.concatenate([r[2] for r in group]))
            self.runs.append((group[0][0] + 1, a, b))
        if self.size * _FILTER_SLOTS > self._slots.size:  # grow the filter 2x, rebuilt from the runs
            n = self._slots.size * 2
            while self.size * _FILTER_SLOTS > n:
                n *= 2
            self._shift = np.uint64(64 - n.bit_length() + 1)
            self._slots = np.zeros(n, np.uint8)
            for _, _, b in self.runs:
                self._slots[self._slot(b)] = 1
        else:
            self._slots[self._slot(h2)] = 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.runs:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
        return np.concatenate([r[1] for r in self.runs]), np.concatenate([r[2] for r in self.runs])


class Dedupe:
    """The taken-id state (see the module docstring). window_ms: width of a window; retention_ms: how far
    behind the watermark ids are kept."""

    def __init__(self, window_ms: int, retention_ms: int):
        self.window_ms = max(1, int(window_ms))
        self.retention_ms = max(0, int(retention_ms))
        self.windows: dict[int, _Window] = {}
        self.horizon: int | None = None          # event times below it are expired
        self.log: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # keys taken since the last checkpoint

    @property
    def size(self) -> int:
        """Ids held."""
        return sum(w.size for w in self.windows.values())

    @property
    def nbytes(self) -> int:
        """Bytes held: 16 a key, and the windows' filters (4-8 bytes a key)."""
        return sum(16 * w.size + w.filter_bytes for w in self.windows.values())

    def advance(self, watermark_ms: int | None) -> None:
        """Move the horizon to watermark - retention and drop the windows wholly below it."""
        if watermark_ms is None:
            return
        h = int(watermark_ms) - self.retention_ms
        if self.horizon is not None and h <= self.horizon:
            return
        self.horizon = h
        for w in [w for w in self.windows if (w + 1) * self.window_ms <= h]:
            del self.windows[w]

    def take(self, ids: pa.Array, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mark a batch taken; returns (new, expired) masks: new events (first time seen, not expired; a repeat
        within the batch counts once, the first) and events below the horizon."""
        n = len(ids)
        if n >= 1 << _BITS:  # positions must fit the low bits of the sort keys
            step = 1 << (_BITS - 1)
            parts = [self.take(ids.slice(i, step), times[i:i + step]) for i in range(0, n, step)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        expired = np.zeros(n, bool) if self.horizon is None else times < self.horizon
        h1, h2 = id_hashes(ids)
        win = times // self.window_ms
        new = ~expired
        cand = np.flatnonzero(new)
        if cand.size:
            a_s, b_s, w_s, o = self._sorted(h1 & _HIGH, h2, win, cand)
            rep = np.zeros(o.size, bool)
            rep[1:] = (a_s[1:] == a_s[:-1]) & (b_s[1:] == b_s[:-1]) & (w_s[1:] == w_s[:-1])
            bounds = np.flatnonzero(np.diff(w_s)) + 1
            seen = np.zeros(o.size, bool)
            for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, o.size]):
                wd = self.windows.get(int(w_s[lo]))
                if wd is not None:
                    seen[lo:hi] = wd.contains(a_s[lo:hi], b_s[lo:hi])
            new[o[rep | seen]] = False
            keep = ~(rep | seen)
            for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, o.size]):
                k = keep[lo:hi]
                if k.any():
                    self.windows.setdefault(int(w_s[lo]), _Window()).add(a_s[lo:hi][k], b_s[lo:hi][k])
            self.log.append((a_s[keep], b_s[keep], w_s[keep]))
        return new, expired

    @staticmethod
    def _sorted(k1: np.ndarray, h2: np.ndarray, win: np.ndarray, cand: np.ndarray):
        """The candidates sorted by (window, k1, h2, position). k1 has its low bits clear, so k1 | position
        sorts by value (a SIMD sort, several times faster than an argsort) and gives the permutation."""
        packed = np.sort(k1[cand] | cand.astype(np.uint64))
        o = (packed & _LOW).astype(np.int64)
        a_s = packed & _HIGH
        w_s = win[o]
        if w_s.size and w_s.min() != w_s.max():  # several windows: a stable sort by window (radix on small ints)
            wr = w_s - w_s.min()
            by = np.argsort(wr.astype(np.uint16) if wr.max() < 1 << 16 else wr, kind="stable")
            o, a_s, w_s = o[by], a_s[by], w_s[by]
        b_s = h2[o]
        tie = np.flatnonzero((a_s[1:] == a_s[:-1]) & (w_s[1:] == w_s[:-1]))
        if tie.size:  # equal k1 (rare): order by h2 there, so that repeats are adjacent
            starts = tie[np.r_[True, np.diff(tie) > 1]]
            for st in starts:
                en = st + 1
                while en < a_s.size and a_s[en] == a_s[st] and w_s[en] == w_s[st]:
                    en += 1
                by = np.argsort(b_s[st:en], kind="stable")
                o[st:en], b_s[st:en] = o[st:en][by], b_s[st:en][by]
        return a_s, b_s, w_s, o

    def _insert(self, h1, h2, win) -> None:
        o = np.lexsort((h1, win))
        h1, h2, win = h1[o], h2[o], win[o]
        bounds = np.flatnonzero(np.diff(win)) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, win.size]):
            self.windows.setdefault(int(win[lo]), _Window()).add(h1[lo:hi], h2[lo:hi])

    # ------------------------------------------------------------------------------------------- checkpoint
    def drain_log(self) -> dict[str, np.ndarray]:
        """The keys taken since the last call (what an incremental checkpoint adds), as arrays."""
        log, self.log = self.log, []
        if not log:
            return {"h1": np.zeros(0, np.uint64), "h2": np.zeros(0, np.uint64), "window": np.zeros(0, np.int64)}
        return {"h1": np.concatenate([x[0] for x in log]), "h2": np.concatenate([x[1] for x in log]),
                "window": np.concatenate([x[2] for x in log]).astype(np.int64)}

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every key held (a full checkpoint)."""
        parts = [(w, *wd.arrays()) for w, wd in self.windows.items()]
        if not parts:
            return {"h1": np.zeros(0, np.uint64), "h2": np.zeros(0, np.uint64), "window": np.zeros(0, np.int64)}
        return {"h1": np.concatenate([p[1] for p in parts]), "h2": np.concatenate([p[2] for p in parts]),
                "window": np.concatenate([np.full(p[1].size, p[0], np.int64) for p in parts])}

    def restore(self, keys: dict[str, np.ndarray], horizon: int | None) -> None:
        """Add checkpointed keys (a snapshot or a delta), then drop what the horizon has passed."""
        h1, h2, win = (np.asarray(keys[k]) for k in ("h1", "h2", "window"))
        if h1.size:  # (& _HIGH: keys of a checkpoint written before the low bits were cleared)
            self._insert(h1.astype(np.uint64) & _HIGH, h2.astype(np.uint64), win.astype(np.int64))
        if horizon is not None:
            self.horizon = None
            self.advance(horizon + self.retention_ms)
