"""Autotuning the number of tensor workers from the trend of the task queue, as Dorylus does for its Lambdas.

Dorylus starts with as many Lambdas as vertex intervals and watches the graph servers' queue of pending tensor
tasks: a growing queue means the tensor workers cannot keep up (add some), an empty one that the graph servers
cannot feed them (remove some). Here the pool samples its backlog (tasks taken off the tensor channel and not yet
started) every `period_s` and, per window of `window` samples, decides:

- grow when the backlog is there (mean >= `grow_backlog`) and rising, or at least one task per worker is
  waiting: add ceil(mean backlog) workers (at most doubling);
- shrink when the backlog is empty (mean < `empty_backlog`) and the workers were occupied less than
  `shrink_util` of the window: go to the size that would have been `target_util` occupied (at most halving);
- otherwise hold. After a change the next window is skipped (`cooldown`), since a change acts gradually.

The count stays in [lo, hi]. "Occupied" is wall time a worker spent on tasks, waits for weights and injected
delays included: what a Lambda would be billed for.
"""
from __future__ import annotations

import math
import threading
import time


class Autotuner:
    def __init__(self, start: int, lo: int = 1, hi: int = 100, *, period_s: float = 0.1, window: int = 10,
                 grow_backlog: float = 0.5, empty_backlog: float = 0.05, shrink_util: float = 0.5,
                 target_util: float = 0.7, cooldown: int = 1):
        if not 1 <= lo <= hi:
            raise ValueError(f"autotuner bounds must satisfy 1 <= lo <= hi, got {lo}, {hi}")
        self.lo, self.hi = lo, hi
        self.n = min(max(start, lo), hi)
        self.start = self.n
        self.period_s, self.window = period_s, window
        self.grow_backlog, self.empty_backlog = grow_backlog, empty_backlog
        self.shrink_util, self.target_util = shrink_util, target_util
        self.cooldown = cooldown
        self._skip = 0
        self._samples: list[int] = []
        self._occ0: float | None = None
        self._t0: float | None = None
        self.history: list[dict] = []
        self._lock = threading.Lock()

    def observe(self, backlog: int, occupied_s: float, now: float | None = None) -> int | None:
        """One sample: the backlog now and the workers' cumulative occupied seconds. Returns the new worker
        count when the window closes with a change, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._t0 is None:
                self._t0, self._occ0 = now, occupied_s
            self._samples.append(int(backlog))
            if len(self._samples) < self.window:
                return None
            b = self._samples
            span = max(now - self._t0, 1e-9)
            util = (occupied_s - self._occ0) / (self.n * span)
            mean = sum(b) / len(b)
            half = len(b) // 2
            trend = sum(b[half:]) / (len(b) - half) - sum(b[:half]) / half
            self._samples, self._t0, self._occ0 = [], now, occupied_s
            new, why = self.n, "hold"
            if self._skip > 0:
                self._skip -= 1
                why = "cooldown"
            elif mean >= self.grow_backlog and (trend > 0 or mean >= self.n):
                new = min(self.hi, self.n + min(self.n, max(1, math.ceil(mean))))
                why = "grow"
            elif mean < self.empty_backlog and util < self.shrink_util:
                need = math.ceil(self.n * util / self.target_util)
                new = max(self.lo, self.n // 2, need, 1)
                new = min(new, self.n - 1) if self.n > self.lo else self.n
                why = "shrink"
            self.history.append({"t": now, "workers": new, "backlog": round(mean, 3), "trend": round(trend, 3),
                                 "util": round(util, 3), "decision": why if new != self.n or why == "cooldown"
                                 else "hold"})
            if new != self.n:
                self.n = new
                self._skip = self.cooldown
                return new
            return None

    def summary(self) -> dict:
        counts = [h["workers"] for h in self.history] or [self.n]
        tail = counts[len(counts) // 2:]
        return {"start": self.start, "final": self.n, "min": min(counts + [self.start]),
                "max": max(counts + [self.start]), "bounds": [self.lo, self.hi], "windows": len(self.history),
                "changes": sum(1 for h in self.history if h["decision"] in ("grow", "shrink")),
                "second_half_range": [min(tail), max(tail)],
                "history": [[round(h["t"] - self.history[0]["t"], 3), h["workers"], h["backlog"], h["util"]]
                            for h in self.history]}
