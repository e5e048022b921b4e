"""The plan's simulated world: machines, links, the timeline and message records shared by the roles."""
from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from ops import models
from pipelines.plan import des
from pipelines.plan.cluster import Layout
from pipelines.plan.shape import DENSE_TASKS, Shape, Task, task_size

#: Which quantile of epoch (and task) times stands for "the" time (0.5: the median).
QUANTILE = 0.5
GS_POLL_BUSY_S = 0.002      # the graph server's poll timeout while tasks are in flight (engine: 0.002)
GS_POLL_IDLE_S = 0.02       # ... and while none are (engine: 0.02)


@dataclasses.dataclass
class Msg:
    kind: str
    epoch: int
    stage: int
    interval: int
    partition: int
    version: int = -1
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.kind, self.epoch, self.stage, self.interval, self.partition)


class World:
    """Machines, links, the timeline and byte counters shared by every simulated role."""

    def __init__(self, layout: Layout, costs, shape: Shape, stages):
        self.loop = des.Loop()
        self.L = layout
        self.costs = costs
        self.shape = shape
        self.stages = stages
        self.rows: list = []
        self.worker_rows: list = []   # per tensor task on its worker: taken, compute start and end, done
        self.bytes = collections.Counter()
        self.sizes = {}
        L = layout
        if L.kind == "local":
            m = des.Shared(self.loop, L.cores, "local", background=L.background)
            self.gs_cpu = [m] * L.partitions
            self.ps_cpu = m
            self.pool_cpu = m
            self.speed = {"gs": 1.0, "ps": 1.0, "worker": 1.0}
            self.vcpus = {"gs": 1.0, "ps": 1.0, "worker": 1.0}
        else:
            gi, pi = L.instance(L.graph_instance), L.instance(L.ps_instance)
            self.gs_cpu = [des.Shared(self.loop, gi.vcpus, f"gs{p}") for p in range(L.partitions)]
            self.ps_cpu = des.Shared(self.loop, pi.vcpus, "ps")
            self.gs_nic = [des.Shared(self.loop, gi.network_bytes_s, f"nic{p}") for p in range(L.partitions)]
            self.ps_nic = des.Shared(self.loop, pi.network_bytes_s, "ps-nic")
            rel = 1.0 / L.net.local_speed
            self.speed = {"gs": gi.speed * rel, "ps": pi.speed * rel, "worker": L.lam.speed * rel}
            self.vcpus = {"gs": gi.vcpus, "ps": pi.vcpus, "worker": L.lam.vcpus}
            if L.backend == "inline":
                self.speed["worker"], self.vcpus["worker"] = self.speed["gs"], gi.vcpus

    def size(self, kind: Task, s: int, p: int = 0):
        key = (kind, s, p)
        if key not in self.sizes:
            self.sizes[key] = task_size(self.stages, self.shape, kind, s, p)
        return self.sizes[key]

    def compute(self, role: str, cpu: des.Shared, kind: Task, s: int, p: int = 0) -> des.Compute:
        """The compute command of one task on a role's machine: its calibrated seconds at that machine's speed;
        a dense task may use several cores there (diminishing returns), a sparse one runs on its thread."""
        sec = self.costs.seconds(kind, self.size(kind, s, p)) / self.speed[role]
        cap = 1.0
        if kind in DENSE_TASKS and self.L.kind != "local":
            cap = min(cpu.capacity, 1.0 + (self.vcpus[role] - 1.0) * self.L.net.dense_efficiency)
        return des.Compute(cpu, sec * cap if cap > 1 else sec, cap)

    def span(self, lane: str, kind, e: int, i: int, t0: float, t1: float, **detail) -> None:
        self.rows.append({"lane": lane, "kind": str(getattr(kind, "value", kind)), "epoch": e, "interval": i,
                          "t0": t0, "t1": t1, **detail})

    def deliver(self, src: str, dst_nic, nbytes: int, channel: str, fn, *args) -> None:
        """A message between instances (Kafka): the sender's link, then the broker's latency; locally in memory."""
        self.bytes[channel] += nbytes
        L = self.L
        if L.kind == "local":
            self.loop.after(L.net.local_latency_s, fn, *args)
            return

        def go():
            nic = self.ps_nic if src == "ps" else self.gs_nic[int(src)]
            yield des.Compute(nic, nbytes, dst_nic.capacity if dst_nic is not None else nic.capacity)
            yield des.Sleep(L.net.kafka_latency_s)
            fn(*args)

        self.loop.spawn(go(), f"msg-{channel}")


def model_reads(stages):
    """Each stage's producers, and which (producer stage, tensor) pairs are read at columns (needing ghosts, SC)
    and which at rows (`ops.models.column_reads`)."""
    model = type("M", (), {"stages": stages})
    return (models.producers(model), *models.column_reads(model))


def epoch_time(wu_ends: list[float], warmup: int = 1) -> float:
    """Seconds per epoch in steady state: the median gap between consecutive weight updates, the first `warmup`
    gaps (compilation) left out. The median, not the mean: on a shared machine a few epochs are slowed by other
    processes' bursts, which no schedule explains."""
    ends = sorted(wu_ends)
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    w = min(warmup, max(len(gaps) - 1, 0))
    return float(np.quantile(gaps[w:], QUANTILE)) if gaps else (ends[0] if ends else math.nan)
