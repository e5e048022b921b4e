"""Event-time watermarks over the partitions of a Kafka topic, and the round boundaries they release.

The watermark is the minimum over topic partitions of the largest event time seen in each, minus the allowed
lateness (as in Flink's bounded-out-of-orderness strategy). A partition that has not delivered an event yet
holds the watermark back (its first events may be the oldest). With ``idle_s`` set, a partition that is caught
up (its position is at its end offset) and has delivered nothing for that many wall-clock seconds is idle and
left out (Flink's ``withIdleness``), so an empty or quiet partition does not stall training forever; events it
delivers later may then be late.

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
        self.caught_up_since: dict[int, float] = {}  # topic partition -> monotonic time it caught up
        self.last_seen: dict[int, float] = {}  # topic partition -> monotonic time of its last record
        self.current = NO_TIME                 # the watermark never goes back (e.g. when every partition idles)

    def observe(self, partition: int, event_time_ms: int) -> None:
        if event_time_ms > self.max_time.get(partition, NO_TIME):
            self.max_time[partition] = int(event_time_ms)
        self.last_seen[partition] = time.monotonic()

    def set_caught_up(self, partition: int, caught_up: bool) -> None:
        if not caught_up:
            self.caught_up_since.pop(partition, None)
        elif partition not in self.caught_up_since:
            self.caught_up_since[partition] = time.monotonic()

    def idle(self, partition: int, now: float | None = None) -> bool:
        if self.idle_s is None or partition not in self.caught_up_since:
            return False
        now = time.monotonic() if now is None else now
        quiet = max(self.caught_up_since[partition], self.last_seen.get(partition, float("-inf")))
        return now - quiet >= self.idle_s

    def watermark(self, partitions) -> int:
        """The current watermark over `partitions` (ms): monotonic; NO_TIME until every partition that is not
        idle has delivered an event."""
        now = time.monotonic()
        marks = []
        for p in partitions:
            if self.idle(p, now):
                continue              # idle partition
            if p not in self.max_time:
                return self.current   # no event yet: its time is unknown, the watermark waits
            marks.append(self.max_time[p])
        if marks:
            self.current = max(self.current, min(marks) - self.lateness_ms)
        return self.current

    def state(self) -> dict:
        return {"max_time": {str(k): v for k, v in self.max_time.items()}, "current": self.current}

    def restore(self, state: dict) -> None:
        self.max_time = {int(k): int(v) for k, v in state.get("max_time", {}).items()}
        self.current = int(state.get("current", NO_TIME))


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
