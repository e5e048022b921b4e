"""Event-time watermarks over the partitions of a Kafka topic, and the round boundaries they release.

The watermark is the minimum over topic partitions of the largest event time seen in each, minus the allowed
lateness (as in Flink's bounded-out-of-orderness strategy). A partition that has never delivered an event and
has nothing to read (its position is at its end offset) does not hold the watermark back; one with unread
records does. Optionally (``idle_s``), a partition that is caught up and has delivered nothing for that many
wall-clock seconds is treated as idle and skipped too (Flink's ``withIdleness``), so one quiet partition does
not stall training forever.

Rounds: event time is cut into windows of ``interval_ms`` aligned at the Unix epoch. Round k applies every event
with event time below its cut C_k (a window end), and fires once the watermark reaches C_k. ``catch_up``:
``windows`` advances one non-empty window per round (deterministic model versions whatever the speed);
``skip`` jumps to the last complete window (fewer, bigger rounds when training falls behind the stream).
"""
from __future__ import annotations

import time

NO_TIME = -(2 ** 62)


class WatermarkTracker:
    def __init__(self, lateness_ms: int = 0, idle_s: float | None = None):
        self.lateness_ms = int(lateness_ms)
        self.idle_s = idle_s
        self.max_time: dict[int, int] = {}     # topic partition -> largest event time seen (ms)
        self.caught_up: dict[int, bool] = {}   # topic partition -> position >= end offset
        self.last_seen: dict[int, float] = {}  # topic partition -> monotonic time of its last record

    def observe(self, partition: int, event_time_ms: int) -> None:
        if event_time_ms > self.max_time.get(partition, NO_TIME):
            self.max_time[partition] = int(event_time_ms)
        self.last_seen[partition] = time.monotonic()

    def set_caught_up(self, partition: int, caught_up: bool) -> None:
        self.caught_up[partition] = caught_up

    def watermark(self, partitions) -> int:
        """The current watermark over `partitions` (ms); NO_TIME while one of them holds it back entirely."""
        now = time.monotonic()
        marks = []
        for p in partitions:
            up = self.caught_up.get(p, False)
            if p not in self.max_time:
                if up:
                    continue          # empty partition: nothing to wait for
                return NO_TIME        # unread records, time unknown
            if up and self.idle_s is not None and now - self.last_seen.get(p, now) >= self.idle_s:
                continue              # idle partition
            marks.append(self.max_time[p])
        if not marks:
            return NO_TIME
        return min(marks) - self.lateness_ms

    def state(self) -> dict:
        return {"max_time": {str(k): v for k, v in self.max_time.items()}}

    def restore(self, state: dict) -> None:
        self.max_time = {int(k): int(v) for k, v in state.get("max_time", {}).items()}


def window_end(t_ms: int, interval_ms: int) -> int:
    """The end (exclusive) of the window containing t."""
    return (t_ms // interval_ms + 1) * interval_ms


def next_cut(watermark_ms: int, earliest_pending_ms: int | None, last_cut_ms: int | None, interval_ms: int,
             catch_up: str = "windows") -> int | None:
    """The cut of the next round, or None when no round is due.

    A round is due once the watermark has passed the end of the window holding the earliest pending event
    (events below the last cut, i.e. late ones, ride along with the next due round)."""
    if earliest_pending_ms is None:
        return None
    t = earliest_pending_ms if last_cut_ms is None else max(earliest_pending_ms, last_cut_ms)
    first = window_end(t, interval_ms)
    if watermark_ms < first:
        return None
    if catch_up == "skip":
        return (watermark_ms // interval_ms) * interval_ms
    return first
