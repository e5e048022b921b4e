"""Autotuning the number of tensor workers from the trend of the task queue, as Dorylus does for its Lambdas.

Dorylus starts with as many Lambdas as vertex intervals and watches the graph servers' queue of pending tensor
tasks: a growing queue means the tensor workers cannot keep up (add some), an empty one that the graph servers
cannot feed them (remove some). Here the pool samples its backlog (tasks taken off the tensor channel and not yet
started) and the workers' occupied time every `period_s`, and, per window of `window` samples, decides:

- grow when the workers are saturated (smoothed occupancy >= `hi_util`) and the backlog is there (mean >=
  `grow_backlog`) and rising (above the previous window's, or rising within the window) or at least one task per
  worker waits: add ceil(mean backlog / 2) workers (at least one, at most doubling);
- shrink when the backlog is empty or falling to empty (mean < `empty_backlog`) and the workers are mostly idle
  (smoothed occupancy < `lo_util`): go to the size that would have been `target_util` occupied (at most
  halving, at least one fewer);
- hold through windows without any work at all (a pause of the pipeline says nothing about the right size);
- otherwise hold. After a change the next `cooldown` windows hold (a change acts gradually), and after a
  reversal of direction twice as many, so the count settles instead of oscillating.

Occupancy gates both directions because the engine's demand comes in bursts (every interval's task of a layer is
dispatched at once): a burst's backlog alone would add workers that then idle. The count stays in [lo, hi].
"Occupied" is wall time a worker spends on tasks, waits for weights and injected delays included: what a Lambda
would be billed for.
"""
from __future__ import annotations

import math
import threading
import time


class Autotuner:
    def __init__(self, start: int, lo: int = 1, hi: int = 100, *, period_s: float = 0.1, window: int = 10,
                 grow_backlog: float = 0.5, empty_backlog: float = 0.25, hi_util: float = 0.8,
                 lo_util: float = 0.35, target_util: float = 0.6, idle_util: float = 0.02, cooldown: int = 1):
        if not 1 <= lo <= hi:
            raise ValueError(f"autotuner bounds must satisfy 1 <= lo <= hi, got {lo}, {hi}")
        if not 0 < lo_util < target_util < hi_util <= 1:
            raise ValueError("autotuner needs 0 < lo_util < target_util < hi_util <= 1")
        self.lo, self.hi = lo, hi
        self.n = min(max(start, lo), hi)
        self.start = self.n
        self.period_s, self.window = period_s, window
        self.grow_backlog, self.empty_backlog = grow_backlog, empty_backlog
        self.hi_util, self.lo_util, self.target_util = hi_util, lo_util, target_util
        self.idle_util = idle_util
        self.cooldown = cooldown
        self._skip = 0
        self._last_dir = 0
        self._samples: list[int] = []
        self._occ0: float | None = None
        self._t0: float | None = None
        self._prev_mean: float | None = None
        self._util: float | None = None
        self.history: list[dict] = []
        self._lock = threading.Lock()

    def observe(self, backlog: int, occupied_s: float, now: float | None = None) -> int | None:
        """One sample: the backlog now and the workers' cumulative occupied seconds. Returns the new worker
        count when a window closes with a change, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._t0 is None:
                self._t0, self._occ0 = now, occupied_s
            self._samples.append(int(backlog))
            if len(self._samples) < self.window:
                return None
            b = self._samples
            span = max(now - self._t0, 1e-9)
            u = min(1.0, (occupied_s - self._occ0) / (self.n * span))
            mean = sum(b) / len(b)
            idle = u < self.idle_util and mean == 0
            if not idle:  # a pause of the pipeline does not count toward the smoothed occupancy
                self._util = u if self._util is None else 0.5 * self._util + 0.5 * u
            util = u if self._util is None else self._util
            half = len(b) // 2
            trend = sum(b[half:]) / (len(b) - half) - sum(b[:half]) / half
            rising = trend > 0 or (self._prev_mean is not None and mean > self._prev_mean)
            self._samples, self._t0, self._occ0, self._prev_mean = [], now, occupied_s, mean
            new, why = self.n, "hold"
            if self._skip > 0:
                self._skip -= 1
                why = "cooldown"
            elif idle:
                why = "idle"  # no work at all (a pause of the pipeline): no signal either way
            elif util >= self.hi_util and mean >= self.grow_backlog and (rising or mean >= self.n):
                new = min(self.hi, self.n + min(self.n, max(1, math.ceil(mean / 2))))
                why = "grow"
            elif mean < self.empty_backlog and util < self.lo_util and self.n > self.lo:
                need = math.ceil(self.n * util / self.target_util)
                new = max(self.lo, -(-self.n // 2), min(need, self.n - 1))
                why = "shrink"
            if new == self.n and why in ("grow", "shrink"):
                why = "hold"
            self.history.append({"t": now, "workers": new, "backlog": round(mean, 3), "trend": round(trend, 3),
                                 "util": round(util, 3), "decision": why})
            if new != self.n:
                direction = 1 if new > self.n else -1
                self._skip = self.cooldown * (2 if self._last_dir and direction != self._last_dir else 1)
                self._last_dir = direction
                self._util = util * self.n / new  # the same work spread over the new count
                self.n = new
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
