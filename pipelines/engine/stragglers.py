"""The straggler rule of the graph servers (and of the planner's simulation of them): when a task counts as late,
and the tasks in flight it applies to (`InFlight`).

A task is relaunched when it has waited longer than its kind's limit x 2^relaunches (each relaunch of the same
task waits twice as long, so a task that is late because the workers are busy is not sent again and again). The
limit is max(min_s, k x the p90 of the last `TASK_TIMES` send-to-result times of its kind). The times include the
wait in the workers' queue, which grows with the load; an average over first attempts only (an older rule) learnt
nothing from the tasks it relaunched, so under load it stayed below the queue's wait and every relaunch lengthened
the queue further (a storm re-sending whole payloads). Until a kind has a time, its first tasks (which compile)
have no reference: `FIRST_TASK_S`.
"""
from __future__ import annotations

import collections
from typing import Callable

#: the window of send-to-result times kept per task kind
TASK_TIMES = 64
#: the limit for a kind's first tasks, which compile and have no reference yet
FIRST_TASK_S = 30.0


def p90(times) -> float:
    """The 0.9 quantile of a few times, linearly interpolated as `numpy.quantile`'s default: on the window of 64
    that a graph server recomputes after every result, sorting in Python costs 2 us where numpy's takes 45."""
    s = sorted(times)
    x = 0.9 * (len(s) - 1)
    lo = int(x)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (x - lo))


class StragglerLimits:
    """Per task kind: the observed send-to-result times (`observe`) and the limit they give (`limit`)."""

    def __init__(self, k: float, min_s: float):
        self.k, self.min_s = k, min_s
        self.times = collections.defaultdict(lambda: collections.deque(maxlen=TASK_TIMES))
        self._limits: dict[str, float] = {}  # task kind -> limit, until its next time arrives

    def limit(self, kind: str) -> float:
        """Seconds after which a first attempt of this kind counts as late."""
        limit = self._limits.get(kind)
        if limit is None:
            times = self.times.get(kind)
            limit = FIRST_TASK_S if not times else self.k * p90(times)
            limit = self._limits[kind] = max(self.min_s, limit)
        return limit

    def deadline(self, kind: str, sent: float, attempts: int) -> float:
        """When a task of this kind, last launched at `sent` after `attempts` relaunches, is late."""
        return sent + self.limit(kind) * 2 ** attempts

    def observe(self, kind: str, seconds: float) -> None:
        """One send-to-result time of a task of this kind (from its first launch, relaunched or not)."""
        self.times[kind].append(seconds)
        self._limits.pop(kind, None)  # recomputed when next needed


class InFlight:
    """The tensor tasks a graph server has sent and not yet had answered, keyed by `Message.key`: each one's
    [message, last launch, relaunches, first launch], how many each interval has (`busy`), and the relaunches of
    the late ones under the `StragglerLimits`. `send(message)` puts a first launch on the wire; `resend(message,
    attempt, reason)` a relaunch; `clock()` is the time (the engine's monotonic clock, or the planner's simulated
    one): the engine and its simulation share this bookkeeping."""

    def __init__(self, limits: StragglerLimits, clock: Callable[[], float], send: Callable, resend: Callable):
        self.limits, self.clock, self._send, self._resend = limits, clock, send, resend
        self.tasks: dict[tuple, list] = {}
        self._per_interval = collections.Counter()  # checked on every step: a scan of `tasks` cost more
        self.relaunches = 0
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self.tasks)

    def __contains__(self, key) -> bool:
        return key in self.tasks

    def busy(self, interval: int) -> int:
        """Tasks of this interval in flight."""
        return self._per_interval[interval]

    def launch(self, msg) -> None:
        now = self.clock()
        self.tasks[msg.key] = [msg, now, 0, now]
        self._per_interval[msg.interval] += 1
        self._send(msg)

    def relaunch(self, key, reason: str) -> None:
        entry = self.tasks[key]
        msg, attempts = entry[0], entry[2]
        entry[1] = self.clock()
        entry[2] = attempts + 1
        self.relaunches += 1
        self._resend(msg, attempts + 1, reason)

    def relaunch_late(self) -> None:
        """Relaunch every task whose deadline has passed."""
        now = self.clock()
        for key, (msg, sent, attempts, _) in list(self.tasks.items()):
            if now > self.limits.deadline(msg.kind, sent, attempts):
                self.relaunch(key, "late")

    def next_deadline(self) -> float | None:
        """When the first task in flight becomes late, or None when none is in flight."""
        return min((self.limits.deadline(msg.kind, sent, attempts) for msg, sent, attempts, _ in self.tasks.values()),
                   default=None)

    def complete(self, msg) -> list | None:
        """The answer to a task: its entry (which leaves the flight, and whose time from its first launch feeds the
        limits), or None for an answer already taken (a relaunch's duplicate, counted)."""
        entry = self.tasks.pop(msg.key, None)
        if entry is None:
            self.duplicates += 1
            return None
        self._per_interval[msg.interval] -= 1
        self.limits.observe(msg.kind, self.clock() - entry[3])
        return entry
