"""The plan's discrete-event kernel: a clock, generator processes, and shared resources (cores, links).

A process is a generator that yields commands: `Compute(resource, work, cap)` (work in resource-seconds at full
speed, shared by processor sharing), `Sleep(dt)`, `Poll(inbox, timeout)` (resume when the inbox holds something
or after timeout), `Get(queue)` (take the first item, waiting while empty), `Until(predicate, signal)` (resume
when a signal fires and the predicate holds). Plain Python, deterministic: ties break by scheduling order.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
from typing import Any, Callable


@dataclasses.dataclass
class Compute:
    resource: "Shared"
    work: float          # seconds at a rate of 1 (one core, or one unit of bandwidth)
    cap: float = 1.0     # the most of the resource this job can use at once (a thread: one core)


@dataclasses.dataclass
class Sleep:
    dt: float


@dataclasses.dataclass
class Poll:
    inbox: "Inbox"
    timeout: float


@dataclasses.dataclass
class Get:
    queue: "Inbox"


@dataclasses.dataclass
class Until:
    predicate: Callable[[], bool]
    signal: "Signal"


class Loop:
    """The clock and the event heap."""

    def __init__(self):
        self.now = 0.0
        self._q: list = []
        self._seq = itertools.count()
        self.stopped = False

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._q, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = math.inf, max_events: int = 50_000_000) -> None:
        n = 0
        while self._q and not self.stopped:
            t, _, fn, args = self._q[0]
            if t > until:
                break
            heapq.heappop(self._q)
            self.now = t
            fn(*args)
            n += 1
            if n >= max_events:
                raise RuntimeError(f"simulation did not finish within {max_events} events")

    def spawn(self, gen, name: str = "") -> "Process":
        p = Process(self, gen, name)
        self.at(self.now, p.resume, None)
        return p


class Signal:
    """Wakes processes waiting in `Until` when something they depend on changed."""

    def __init__(self, loop: Loop):
        self.loop = loop
        self.waiters: list = []

    def fire(self) -> None:
        waiters, self.waiters = self.waiters, []
        for proc, pred in waiters:
            if pred():
                self.loop.at(self.loop.now, proc.resume, None)
            else:
                self.waiters.append((proc, pred))


class Inbox:
    """A FIFO of items, or with `key` a priority queue (the lowest key first, FIFO among equals); processes poll it
    (Poll) or take from it (Get)."""

    def __init__(self, loop: Loop, key=None):
        self.loop = loop
        self.key = key
        self.items: collections.deque = collections.deque()
        self._pollers: list = []   # (process, token)
        self._getters: collections.deque = collections.deque()

    def put(self, item: Any) -> None:
        self.items.append(item)
        if self._getters:
            proc = self._getters.popleft()
            self.loop.at(self.loop.now, proc.resume, self.take())
            return
        pollers, self._pollers = self._pollers, []
        for proc, token in pollers:
            self.loop.at(self.loop.now, proc.wake, token)

    def take(self) -> Any:
        """The next item (the inbox is not empty)."""
        if self.key is None:
            return self.items.popleft()
        best = min(range(len(self.items)), key=lambda k: self.key(self.items[k]))  # first of the lowest
        item = self.items[best]
        del self.items[best]
        return item

    def drain(self) -> list:
        out = list(self.items)
        self.items.clear()
        return out


class Process:
    def __init__(self, loop: Loop, gen, name: str):
        self.loop = loop
        self.gen = gen
        self.name = name
        self.done = False
        self._token = 0

    def wake(self, token: int) -> None:
        if token == self._token:   # a stale wake-up (the poll already returned) is ignored
            self.resume(None)

    def resume(self, value) -> None:
        self._token += 1
        try:
            cmd = self.gen.send(value)
        except StopIteration:
            self.done = True
            return
        loop = self.loop
        if isinstance(cmd, Compute):
            cmd.resource.submit(cmd.work, cmd.cap, self.resume)
        elif isinstance(cmd, Sleep):
            loop.after(cmd.dt, self.resume, None)
        elif isinstance(cmd, Poll):
            if cmd.inbox.items:
                loop.at(loop.now, self.resume, None)
            else:
                tok = self._token
                cmd.inbox._pollers.append((self, tok))
                loop.after(cmd.timeout, self.wake, tok)
        elif isinstance(cmd, Get):
            if cmd.queue.items:
                loop.at(loop.now, self.resume, cmd.queue.take())
            else:
                cmd.queue._getters.append(self)
        elif isinstance(cmd, Until):
            if cmd.predicate():
                loop.at(loop.now, self.resume, None)
            else:
                cmd.signal.waiters.append((self, cmd.predicate))
        else:
            raise TypeError(f"process {self.name} yielded {cmd!r}")


class Shared:
    """A resource shared by processor sharing (cores of a machine, bandwidth of a link): `capacity` units, each
    job at most `cap` of them, the rest divided equally among the jobs that could use more (water filling).
    `background` jobs of one unit each are always there (other processes on a shared machine)."""

    def __init__(self, loop: Loop, capacity: float, name: str = "", background: float = 0.0):
        self.loop = loop
        self.capacity = float(capacity)
        self.background = float(background)
        self.name = name
        self.jobs: dict[int, list] = {}   # id -> [remaining work, cap, callback, rate, work]
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0
        self.busy = 0.0                   # resource-seconds delivered

    def submit(self, work: float, cap: float, callback: Callable) -> None:
        if work <= 0:
            self.loop.at(self.loop.now, callback, None)
            return
        self._advance()
        self.jobs[next(self._ids)] = [work, cap, callback, 0.0, work]
        self._reschedule()

    def _advance(self) -> None:
        dt = self.loop.now - self._last
        if dt > 0:
            for j in self.jobs.values():
                j[0] -= j[3] * dt
                self.busy += j[3] * dt
        self._last = self.loop.now

    def _rates(self) -> None:
        left = self.capacity
        pending = sorted(self.jobs.values(), key=lambda j: j[1])
        n = len(pending)
        for k, j in enumerate(pending):
            share = left / (n - k + self.background)
            j[3] = min(j[1], share)
            left -= j[3]

    def _reschedule(self) -> None:
        self._rates()
        self._version += 1
        if not self.jobs:
            return
        t = min(j[0] / j[3] for j in self.jobs.values() if j[3] > 0)
        self.loop.after(max(t, 0.0), self._tick, self._version)

    def _tick(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        # Done within rounding: a few ulps of the job's size, or less than a nanosecond of its rate.
        done = [k for k, j in self.jobs.items() if j[0] <= max(1e-9 * j[4], 1e-9 * j[3])]
        for k in done:
            cb = self.jobs.pop(k)[2]
            self.loop.at(self.loop.now, cb, None)
        self._reschedule()
