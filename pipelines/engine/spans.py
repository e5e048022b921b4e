"""Span recording for the pipeline timeline that `dorylus report` draws.

A span is one tuple (lane, kind, epoch, interval, t0, t1, detail) on one monotonic clock (`time.monotonic`) per
run; the roles append it (a list append: negligible next to a task, and thread-safe in CPython). Lanes:
`graph-server-{p}` (GA, GA_BWD, SC, SC_BWD, and WAIT for the time an interval's next step waits on a gate),
`tensor-workers` (AV, AE, LAST, LOSS, AV_BWD, AE_BWD from dispatch to result), `param-server` (WU).

Memory stays bounded: only epochs below `max_epochs` are kept, and at most `max_spans` spans; the rest are
counted in `dropped`. The driver writes the kept spans to `RUN_DIR/timeline.jsonl` at the end, times in seconds
from the run's origin. Over Kafka every role process keeps its own log and sends its spans in wall-clock seconds
(`wall_rows`) with its final report; the driver merges them (`merge_wall_rows`) onto its own origin.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

#: Clock of every span.
clock = time.monotonic


class SpanLog:
    def __init__(self, max_epochs: int = 50, max_spans: int = 100_000, origin: float | None = None):
        self.origin = clock() if origin is None else origin
        self.origin_wall = time.time() - (clock() - self.origin)  # the wall-clock time of `origin`
        self.max_epochs = max_epochs
        self.max_spans = max_spans
        self.spans: list[tuple] = []
        self.dropped = 0

    def add(self, lane: str, kind: str, epoch: int, interval: int, t0: float, t1: float, detail=None) -> None:
        if epoch < self.max_epochs and len(self.spans) < self.max_spans:
            self.spans.append((lane, kind, epoch, interval, t0, t1, detail))
        else:
            self.dropped += 1

    def rows(self) -> list[dict]:
        out = []
        for lane, kind, epoch, interval, t0, t1, detail in sorted(list(self.spans), key=lambda s: s[4]):
            row = {"lane": lane, "kind": kind, "epoch": int(epoch), "interval": int(interval),
                   "t0": round(t0 - self.origin, 6), "t1": round(t1 - self.origin, 6)}
            if detail:
                row.update(detail)
            out.append(row)
        return out

    def wall_rows(self) -> list[dict]:
        """The rows with t0/t1 in wall-clock seconds (comparable across processes on synchronized clocks)."""
        return [{**r, "t0": r["t0"] + self.origin_wall, "t1": r["t1"] + self.origin_wall} for r in self.rows()]

    def write(self, path: str | Path) -> int:
        """Write the spans as JSON lines (sorted by start); returns how many."""
        return write_rows(path, self.rows())

    def stats(self) -> dict:
        return {"spans": len(self.spans), "dropped": self.dropped, "max_epochs": self.max_epochs,
                "max_spans": self.max_spans}


def merge_wall_rows(parts: list[list[dict]], origin_wall: float) -> list[dict]:
    """Rows of several processes (`wall_rows`) as one timeline in seconds from `origin_wall`, sorted by start."""
    rows = [{**r, "t0": round(r["t0"] - origin_wall, 6), "t1": round(r["t1"] - origin_wall, 6)}
            for part in parts for r in part]
    return sorted(rows, key=lambda r: r["t0"])


def write_rows(path: str | Path, rows: list[dict]) -> int:
    """Write span rows as JSON lines, atomically; returns how many."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)
    return len(rows)


def read(path: str | Path) -> list[dict]:
    """The spans of a timeline.jsonl (a torn last line is skipped)."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
