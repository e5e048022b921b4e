"""The plan's simulator: the engine's schedule (graph servers, tensor-worker pool, parameter server) as events.

It runs what `pipelines.engine` runs, step for step, on simulated time: each graph server is one thread that
polls its channels, handles results (SC once all its intervals produced a stage, ∇SC once all contributed a
gradient), then walks its intervals in order firing every step whose inputs are there (GA and ∇GA on its own
thread, tensor tasks dispatched to the pool; one task in flight per interval); reads of ghost columns wait for
the ghost watermark (>= e - S), S = None adds the per-layer barrier, and step 0 of epoch e waits for weight
version max(e - S, 0), which a graph server notices at the top of its loop. Tensor workers take tasks in
arrival order, wait for the task's weight version, run it and send dW to the parameter server, which applies
WU once every interval's gradients of an epoch are in and publishes the next version. Straggler relaunch:
a task in flight longer than max(min, k x EMA of its kind's time) is sent again; the first result wins.

Task times come from `pipelines.plan.calibrate.Costs`; machines and links from `pipelines.plan.cluster`.
The result holds the engine-shaped timeline (`rows`, the same fields as timeline.jsonl) and epoch times.
"""
from __future__ import annotations

import dataclasses

from pipelines.plan.cluster import Layout
from pipelines.plan.gs import GraphServerSim
from pipelines.plan.shape import Shape
from pipelines.plan.workers import ParamServerSim, WorkerPoolSim
from pipelines.plan.world import World, epoch_time


@dataclasses.dataclass
class SimResult:
    rows: list                  # timeline rows, as the engine's timeline.jsonl
    wu_end: dict                # epoch -> time its WU finished
    epochs: int
    relaunches: int
    busy: dict                  # role -> busy seconds (compute)
    lambda_billed_s: float      # sum of Lambda invocations' durations (compute + transfers + cold starts)
    invocations: int
    bytes: dict                 # channel -> bytes sent
    max_staleness: int = 0      # the largest e - (ghost epoch) any read saw, as the engine reports it
    billed_by_epoch: dict = dataclasses.field(default_factory=dict)   # epoch -> Lambda seconds
    calls_by_epoch: dict = dataclasses.field(default_factory=dict)    # epoch -> Lambda invocations
    worker_rows: list = dataclasses.field(default_factory=list)       # each task on its worker (`World`)

    def epoch_time(self, warmup: int = 1) -> float:
        """Steady-state seconds per epoch, measured as for a real run (`calibrate.epoch_time`)."""
        return epoch_time(list(self.wu_end.values()), warmup)


def simulate(layout: Layout, costs, shape: Shape, stages, epochs: int = 6) -> SimResult:
    """Run `epochs` epochs of the engine's schedule for this layout; returns the timeline and epoch times."""
    if epochs < 1:
        raise ValueError("epochs must be >= 1")
    world = World(layout, costs, shape, stages)
    ps = ParamServerSim(world, epochs)
    pool = WorkerPoolSim(world, ps)
    servers = [GraphServerSim(world, p, pool, epochs) for p in range(layout.partitions)]
    for gs in servers:
        gs.peers = servers
    ps.subscribers = servers
    ps.pool = pool
    pool.servers = servers
    ps.start()
    pool.start()
    for gs in servers:
        world.loop.spawn(gs.run(), f"graph-server-{gs.p}")
    world.loop.run()
    if not all(gs.finished for gs in servers) or len(ps.wu_end) < epochs:
        raise RuntimeError("the simulated schedule deadlocked (a gate never opened): "
                           + "; ".join(gs.describe() for gs in servers))
    busy = {"graph_servers": sum(gs.busy for gs in servers), "tensor_workers": pool.busy, "param_server": ps.busy}
    return SimResult(world.rows, dict(ps.wu_end), epochs, sum(gs.inflight.relaunches for gs in servers), busy,
                     pool.billed_s, pool.invocations, dict(world.bytes),
                     max(gs.max_staleness for gs in servers), dict(pool.billed_by_epoch), dict(pool.calls_by_epoch),
                     world.worker_rows)
