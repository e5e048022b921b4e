"""The simulated tensor workers (local pool, Lambdas, cpu-only inline executors) and parameter server.

Tensor workers mirror `pipelines.engine.tensor_worker.LocalPool` / `pools.InlinePool` / `aws_lambda.AwsLambdaPool`:
take the most urgent task (`pipelines.engine.pools.task_urgency`), wait until its weight version is cached, run it, send dW to the parameter server
and the result to its graph server. The parameter server mirrors `param_server.ParameterServer`: it collects
dW per (partition, interval) and stage, applies WU once an epoch is complete and publishes the next version.
"""
from __future__ import annotations

import collections

from pipelines.engine.pools import task_urgency
from pipelines.plan import des
from pipelines.plan.shape import Task, group_of, schedule
from pipelines.plan.world import Msg, World

PS_POLL_S = 0.05


def grad_stages(stages, kind: str, s: int) -> list[str]:
    """Stage names whose dW a task of this kind sends the parameter server (one GRAD message each)."""
    group = [stages[k] for k in group_of(stages)[s]]  # a task over fused AV stages sends each one's dW
    if kind == Task.AV_BWD.value:
        return [st.name for st in group if st.has_params]
    if kind == Task.LAST.value:
        return [st.name for st in (*group, stages[-1]) if st.has_params]
    if kind == Task.LOSS.value:
        return [stages[-1].name] if stages[-1].has_params else []
    return []


class ParamServerSim:
    def __init__(self, world: World, epochs: int):
        self.w = world
        self.loop = world.loop
        self.epochs = epochs
        self.inbox = des.Inbox(world.loop)
        self.version = 0
        self.expected = world.L.partitions * world.shape.intervals
        self.param_stages = [st.name for st in world.stages if st.has_params]
        self.pending = collections.defaultdict(lambda: collections.defaultdict(set))
        self.wu_end: dict = {}
        self.busy = 0.0
        self.subscribers: list = []
        self.pool = None

    def start(self) -> None:
        self.loop.spawn(self.run(), "param-server")

    def receive(self, msg: Msg) -> None:
        self.inbox.put(msg)

    def publish(self, version: int) -> None:
        nbytes = self.w.size(Task.WU, 0).bytes_out
        L = self.w.L
        for gs in self.subscribers:
            nic = self.w.gs_nic[gs.p] if L.kind != "local" else None
            self.w.deliver("ps", nic, nbytes, "weights", gs.weights, version)
        # Workers cache versions from the weights channel (Lambdas: from the parameter server, once per version).
        self.w.deliver("ps", None, nbytes, "weights", self.pool.weights, version)

    def _complete(self, e: int) -> bool:
        got = self.pending.get(e, {})
        return len(got) == self.expected and all(len(v) == len(self.param_stages) for v in got.values())

    def run(self):
        self.publish(0)
        while self.version < self.epochs:
            yield des.Poll(self.inbox, PS_POLL_S)
            for msg in self.inbox.drain():
                if msg.epoch < self.version:
                    continue   # a relaunched task's duplicate, for an epoch already applied
                self.pending[msg.epoch][(msg.partition, msg.interval)].add(msg.meta["stage_name"])
                while self._complete(self.version):
                    e = self.version
                    t0 = self.loop.now
                    yield self.w.compute("ps", self.w.ps_cpu, Task.WU, 0)
                    self.busy += self.loop.now - t0
                    del self.pending[e]
                    self.wu_end[e] = self.loop.now
                    self.w.span("param-server", Task.WU, e, -1, t0, self.loop.now)
                    self.version = e + 1
                    self.publish(self.version)


class WorkerPoolSim:
    """`workers` tensor workers sharing one task queue (cpu-only: one executor per graph server, fed its own)."""

    def __init__(self, world: World, ps: ParamServerSim):
        self.w = world
        self.loop = world.loop
        self.ps = ps
        L = world.L
        self.backend = L.backend
        self.n = L.partitions if L.backend == "inline" else L.workers
        nq = L.partitions if L.backend == "inline" else 1
        urgency = task_urgency(schedule(world.stages))  # the engine's pools take the most urgent task first
        self.queues = [des.Inbox(world.loop, key=urgency) for _ in range(nq)]
        self.versions: set = set()
        self.signal = des.Signal(world.loop)
        self.servers: list = []
        self.busy = 0.0
        self.billed_s = 0.0
        self.invocations = 0
        self.billed_by_epoch = collections.Counter()   # epoch -> Lambda seconds (without cold starts)
        self.calls_by_epoch = collections.Counter()

    def start(self) -> None:
        for k in range(self.n):
            self.loop.spawn(self.worker(k), f"tensor-{k}")

    def weights(self, version: int) -> None:
        self.versions.add(version)
        self.signal.fire()

    def submit(self, msg: Msg) -> None:
        q = self.queues[msg.partition if self.backend == "inline" else 0]
        if self.backend != "pool":
            # A Lambda invocation carries its task (the transfer is part of the worker's time); cpu-only tasks
            # stay inside their graph server's process.
            self.loop.at(self.loop.now, q.put, msg)
        else:
            self.w.deliver(str(msg.partition), None, self.w.size(Task(msg.kind), msg.stage).bytes_in, "tensor",
                           q.put, msg)

    def _cpu(self, k: int):
        if self.backend == "lambda":
            return des.Shared(self.loop, self.w.L.lam.vcpus, f"lambda-{k}")
        if self.backend == "inline":
            return self.w.gs_cpu[k]
        return self.w.pool_cpu

    def worker(self, k: int):
        L = self.w.L
        q = self.queues[k if self.backend == "inline" else 0]
        cpu = self._cpu(k)
        cold = True
        lam = self.backend == "lambda"
        while True:
            msg = yield des.Get(q)
            taken = self.loop.now
            yield des.Until(lambda v=msg.version: v in self.versions, self.signal)
            kind = Task(msg.kind)
            size = self.w.size(kind, msg.stage)
            if lam and cold:
                yield des.Sleep(L.lam.cold_start_s)
                cold = False
            start = self.loop.now
            if lam:
                yield des.Compute(self.w.gs_nic[msg.partition], size.bytes_in, L.lam.bandwidth_bytes_s)
                yield des.Sleep(L.lam.rtt_s / 2)
            elif L.task_latency_s > 0:
                yield des.Sleep(L.task_latency_s)
            t0 = self.loop.now
            yield self.w.compute("worker", cpu, kind, msg.stage)
            busy = self.loop.now - t0
            self.busy += busy
            if lam:
                yield des.Compute(self.w.gs_nic[msg.partition], size.bytes_out, L.lam.bandwidth_bytes_s)
                yield des.Sleep(L.lam.rtt_s / 2)
                self.billed_s += self.loop.now - start
                self.invocations += 1
                self.billed_by_epoch[msg.epoch] += self.loop.now - start
                self.calls_by_epoch[msg.epoch] += 1
            self._send_grads(msg)
            reply = Msg(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version,
                        meta={"attempt": msg.meta.get("attempt", 0), "busy_s": busy})
            gs = self.servers[msg.partition]
            self.w.worker_rows.append({"worker": k, "kind": msg.kind, "epoch": msg.epoch, "partition": msg.partition,
                                       "interval": msg.interval, "stage": msg.stage, "taken": taken, "t0": t0,
                                       "t1": t0 + busy, "done": self.loop.now})
            if self.backend != "pool":
                self.w.bytes["tensor.out" if lam else "in_process"] += size.bytes_out
                self.loop.at(self.loop.now, gs.receive, reply)
            else:
                self.w.deliver(str(msg.partition), None, size.bytes_out, "tensor.out", gs.receive, reply)

    def _send_grads(self, msg: Msg) -> None:
        names = grad_stages(self.w.stages, msg.kind, msg.stage)
        nbytes = self.w.size(Task.WU, 0).bytes_in // max(len(self.ps.param_stages), 1)
        for name in names:
            g = Msg("GRAD", msg.epoch, msg.stage, msg.interval, msg.partition, msg.version,
                    meta={"stage_name": name})
            if self.w.L.kind == "local":
                self.w.deliver("pool", None, nbytes, "grads", self.ps.receive, g)
            else:
                self.w.bytes["grads"] += nbytes
                self.loop.spawn(self._grad_transfer(nbytes, g), "grad")

    def _grad_transfer(self, nbytes: int, g: Msg):
        cap = self.w.L.lam.bandwidth_bytes_s if self.backend == "lambda" else self.w.ps_nic.capacity
        yield des.Compute(self.w.ps_nic, nbytes, cap)
        yield des.Sleep(self.w.L.net.kafka_latency_s)
        self.ps.receive(g)
