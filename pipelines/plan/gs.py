"""The simulated graph server: `pipelines.engine.graph_server.GraphServer`'s loop, gates and stores as counts.

Mirrors the engine method for method (run, handle, _on_result, _on_outputs, _scatter, _col_grad, _bwd_total,
_try_step, _check_stragglers); instead of arrays it keeps which intervals, epochs and partitions have
delivered what, and instead of computing it yields the task's time on the graph server's thread.
"""
from __future__ import annotations

import collections

from ops import models
from pipelines.engine.ghosts import FRESH_GHOST_GRADS, FRESH_INPUT_TRANSFORMS, ghost_epoch, input_transforms
from pipelines.engine.stragglers import InFlight, StragglerLimits
from pipelines.engine.param_server import staleness_at, weight_version, weights_due
from pipelines.plan import des
from pipelines.plan.shape import Step, Task, group_of, schedule, step_task, widths, wrt_inputs
from schemas.tasks import StalenessMode
from pipelines.plan.world import GS_POLL_BUSY_S, GS_POLL_IDLE_S, Msg, World, model_reads

TENSOR_RESULTS = {Task.AV.value, Task.AE.value, Task.LAST.value, Task.LOSS.value, Task.AV_BWD.value,
                  Task.AE_BWD.value}


class GraphServerSim:
    def __init__(self, world: World, p: int, pool, epochs: int):
        self.w = world
        self.loop = world.loop
        self.p = p
        L = world.L
        self.P = L.partitions
        self.K = world.shape.intervals
        self.S = 0 if L.staleness is None else L.staleness
        self.sync_barrier = L.staleness is None
        self.mode = StalenessMode(L.staleness_mode)
        self.warmup = L.sync_warmup
        self.stages = world.stages
        self.fresh_ghosts = input_transforms(self.stages) if self.mode in FRESH_INPUT_TRANSFORMS else frozenset()
        self.sched = schedule(self.stages)
        self.group_of = group_of(self.stages)
        self.tasks = {(k, s): step_task(self.stages, k, s) for k, s in self.sched}
        self.producers, self.col_reads, self.row_consumers = model_reads(self.stages)
        self.widths = widths(self.stages, world.shape.features)
        self.recv_from = sorted(world.shape.recv(p))   # partitions whose rows this one ghosts
        self.send_to = sorted(world.shape.send[p])     # partitions that ghost this one's rows
        self.pool = pool
        self.peers: list = []
        self.inbox = des.Inbox(self.loop)
        self.cpu = world.gs_cpu[p]
        self.epoch = [0] * self.K
        self.step = [0] * self.K
        self.grads = [set() for _ in range(self.K)]
        self.fwd_done = collections.defaultdict(lambda: collections.defaultdict(set))
        self.ghost_wm = collections.defaultdict(lambda: {q: -1 for q in self.recv_from})
        self.bwd_local = collections.defaultdict(lambda: collections.defaultdict(set))
        self.bwd_sum = collections.defaultdict(set)
        self.bwd_remote = collections.defaultdict(lambda: collections.defaultdict(set))
        self.bwd_wm = collections.defaultdict(lambda: {q: -1 for q in self.send_to})
        self.bwd_total = collections.defaultdict(set)
        self.global_wm = collections.defaultdict(set)
        self.latest_version = -1
        self.arrived_version = -1     # newest version on the weights channel, seen at the loop's top
        self.inflight = InFlight(StragglerLimits(world.L.straggler_k, world.L.straggler_min_s),
                                 lambda: self.loop.now, self.pool.submit, self._resend)
        self.max_staleness = 0
        self.busy = 0.0
        self.stop_after = epochs - 1
        self.lane = f"graph-server-{p}"
        self._waiting: list = [None] * self.K
        # Â·X of the input features without dropout is the same every epoch: the engine computes such a GA once
        # (`_static_ga`).
        self.static_ga = {st.index for st in self.stages
                          if self.tasks.get((Step.FORWARD, st.index)) == Task.GA
                          and models.static_over_features(st, self.producers[st.index]["h"])}
        self.ga_done: set = set()
        # unweighted GA stages run once per epoch over the partition's block (`GraphServer._whole_forward`)
        self.whole_done: set = set()
        self.whole_grad = collections.defaultdict(set)
        self.poll_s = world.costs.poll_s if world.L.kind == "local" else 0.0

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def finished(self) -> bool:
        return all(e > self.stop_after for e in self.epoch)

    def describe(self) -> str:
        return f"graph server {self.p}: epochs {self.epoch}, steps {self.step}, in flight {len(self.inflight)}"

    def version_for(self, e: int) -> int:
        return weight_version(e, self.S, self.mode, sync_warmup=self.warmup)

    def grad_epoch(self, e: int) -> int:
        """The epoch of the ghost gradients a backward step of epoch e reads (the engine's `_bwd_total`)."""
        return e if self.mode in FRESH_GHOST_GRADS else max(e - staleness_at(e, self.S, self.warmup), 0)

    def receive(self, msg: Msg) -> None:
        self.inbox.put(msg)

    def weights(self, version: int) -> None:
        self.arrived_version = max(self.arrived_version, version)
        if self.inflight:
            # The engine would see it within one busy poll (2 ms); the simulated loop, which sleeps until a
            # message or a straggler deadline rather than every 2 ms, is woken then instead.
            self.loop.after(GS_POLL_BUSY_S, self.inbox.put, Msg("NUDGE", -1, -1, -1, self.p))
        elif weights_due(self.epoch, self.step, self.latest_version, self.version_for, self.stop_after):
            self.inbox.put(Msg("NUDGE", -1, -1, -1, self.p))  # the engine blocks on the weights channel then

    def _run_task(self, kind: Task, s: int):
        cmd = self.w.compute("gs", self.cpu, kind, s, self.p)
        t0 = self.loop.now
        yield cmd
        self.busy += self.loop.now - t0
        return t0

    def _wait(self, i: int, gate: str) -> bool:
        w = self._waiting[i]
        if w is None:
            self._waiting[i] = [self.loop.now, gate]
        else:
            w[1] = gate
        return False

    def _end_wait(self, i: int, e: int, step: str) -> None:
        w = self._waiting[i]
        if w is not None:
            self._waiting[i] = None
            self.w.span(self.lane, Task.WAIT, e, i, w[0], self.loop.now, gate=w[1], step=step)

    def _send_peer(self, q: int, msg: Msg, nbytes: int, channel: str) -> None:
        nic = self.w.gs_nic[q] if self.w.L.kind != "local" else None
        self.w.deliver(str(self.p), nic, nbytes, channel, self.peers[q].receive, msg)

    # ------------------------------------------------------------------------------------------------ forward
    def _col_gate(self, e: int, ps: int, name: str) -> str | None:
        if ps == -1:
            return None
        if len(self.fwd_done[ps][e]) < self.K:
            return "local"
        e_ghost = ghost_epoch(e, staleness_at(e, self.S, self.warmup), 0, ps, self.fresh_ghosts)
        wm = self.ghost_wm[(ps, name)]
        if wm and min(wm.values()) < e_ghost:
            return "ghosts"
        if self.sync_barrier and len(self.global_wm[("F", ps, e)]) < self.P - 1:
            return "barrier"
        if wm and e_ghost != e:
            self.max_staleness = max(self.max_staleness, e - e_ghost)
        return None

    def _inputs_gate(self, e: int, s: int) -> str | None:
        for name, where in models.reads(self.stages[s]).items():
            if where == "cols":
                gate = self._col_gate(e, self.producers[s][name], name)
                if gate:
                    return gate
        return None

    def _on_outputs(self, i: int, e: int, s: int):
        self.fwd_done[s][e].add(i)
        if len(self.fwd_done[s][e]) == self.K:
            yield from self._scatter(s, e)

    def _scatter(self, s: int, e: int):
        t0 = yield from self._run_task(Task.SC, s)
        for (ps, name) in self.col_reads:
            if ps != s:
                continue
            width = self.widths[s]["out"].get(name, 1)
            for q in self.send_to:
                n = self.w.shape.send[self.p][q]
                self._send_peer(q, Msg("SC", e, s, -1, self.p, meta={"name": name}), n * (4 * width + 8), "ghosts")
        for q in range(self.P):
            if q != self.p:
                self._send_peer(q, Msg("WM", e, s, -1, self.p, meta={"dir": "F"}), 0, "watermarks")
        self.w.span(self.lane, Task.SC, e, -1, t0, self.loop.now)

    # ------------------------------------------------------------------------------------------------ backward
    def _bwd_gate(self, ps: int, name: str, e: int) -> str | None:
        if e in self.bwd_total[(ps, name)]:
            return None
        if e not in self.bwd_sum[(ps, name)]:
            return "local"
        e_ghost = self.grad_epoch(e)
        wm = self.bwd_wm[(ps, name)]
        if wm and min(wm.values()) < e_ghost:
            return "ghost_grads"
        if self.sync_barrier and len(self.global_wm[("B", ps, e)]) < self.P - 1:
            return "barrier"
        if any(q not in self.bwd_remote[(ps, name)][e_ghost] for q in self.send_to):
            return "ghost_grads"
        self.bwd_total[(ps, name)].add(e)
        return None

    def _out_grads_gate(self, i: int, e: int, s: int) -> str | None:
        for name in models.writes(self.stages[s]):
            if (s, name) in self.col_reads:
                gate = self._bwd_gate(s, name, e)
                if gate:
                    return gate
            elif (s, name) in self.grads[i]:
                continue
            elif self.row_consumers.get((s, name)):
                return "local"
        return None

    def _col_grad(self, i: int, e: int, ps: int, name: str):
        done = self.bwd_local[(ps, name)][e]
        done.add(i)
        if len(done) < self.K:
            return
        del self.bwd_local[(ps, name)][e]
        yield from self._col_grad_sum(e, ps, name)

    def _col_grad_sum(self, e: int, ps: int, name: str):
        t0 = yield from self._run_task(Task.SC_BWD, ps)
        self.bwd_sum[(ps, name)].add(e)
        width = self.widths[ps]["out"].get(name, 1)
        for q in self.recv_from:
            n = self.w.shape.send[q][self.p]
            self._send_peer(q, Msg("SC_BWD", e, ps, -1, self.p, meta={"name": name}), n * (4 * width + 8),
                            "ghosts.grad")
        for q in range(self.P):
            if q != self.p:
                self._send_peer(q, Msg("WM", e, ps, -1, self.p, meta={"dir": "B"}), 0, "watermarks")
        self.w.span(self.lane, Task.SC_BWD, e, -1, t0, self.loop.now)

    def _deposit(self, i: int, e: int, s: int, names):
        for name in names:
            ps = self.producers[s][name]
            if ps == -1:
                continue
            if models.reads(self.stages[s])[name] == "cols":
                yield from self._col_grad(i, e, ps, name)
            else:
                self.grads[i].add((ps, name))

    def _wrt(self, s: int) -> list[str]:
        return wrt_inputs(self.stages, s)

    # ------------------------------------------------------------------------------------------------ tasks
    def _overhead(self):
        """The graph server's own work around a tensor task (gathering its inputs, handling its result), which
        its timeline does not show as a span: calibrated per task (`Costs.gs_step_s`)."""
        sec = self.w.costs.gs_step_s / self.w.speed["gs"]
        if sec > 0:
            t0 = self.loop.now
            yield des.Compute(self.cpu, sec, 1.0)
            self.busy += self.loop.now - t0

    def _dispatch(self, kind: Task, i: int, e: int, s: int):
        yield from self._overhead()
        msg = Msg(kind.value, e, s, i, self.p, self.version_for(e), meta={"attempt": 0})
        self.inflight.launch(msg)

    def _resend(self, msg: Msg, attempt: int, reason: str) -> None:
        self.pool.submit(Msg(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version,
                             meta={"attempt": attempt, "reason": reason}))

    def _check_stragglers(self) -> None:
        self.inflight.relaunch_late()

    def _on_result(self, msg: Msg):
        entry = self.inflight.complete(msg)
        if entry is None:
            return
        now = self.loop.now
        self.w.span("tensor-workers", msg.kind, msg.epoch, msg.interval, entry[1], now, partition=self.p,
                    attempt=entry[2], busy=msg.meta.get("busy_s"))
        yield from self._overhead()
        i, e, s = msg.interval, msg.epoch, msg.stage
        if e != self.epoch[i]:
            raise RuntimeError(f"simulated result {msg.kind} for interval {i} epoch {e} in epoch {self.epoch[i]}")
        if msg.kind in (Task.AV.value, Task.AE.value):
            yield from self._on_outputs(i, e, self.group_of[s][-1])
        elif msg.kind in (Task.LAST.value, Task.LOSS.value):
            yield from self._deposit(i, e, s, ["h"])
        else:
            yield from self._deposit(i, e, s, self._wrt(s))
        self.step[i] += 1

    def handle(self, msg: Msg):
        if msg.kind == "NUDGE":
            return
        if msg.kind == "WM":
            self.global_wm[(msg.meta["dir"], msg.stage, msg.epoch)].add(msg.partition)
        elif msg.kind == "SC":
            wm = self.ghost_wm[(msg.stage, msg.meta["name"])]
            wm[msg.partition] = max(wm[msg.partition], msg.epoch)
        elif msg.kind == "SC_BWD":
            key = (msg.stage, msg.meta["name"])
            self.bwd_remote[key][msg.epoch].add(msg.partition)
            self.bwd_wm[key][msg.partition] = max(self.bwd_wm[key][msg.partition], msg.epoch)
        elif msg.kind in TENSOR_RESULTS:
            yield from self._on_result(msg)
        else:
            raise RuntimeError(f"simulated graph server got {msg.kind}")

    def try_step(self, i: int):
        """Fire interval i's next step if its inputs are there (the engine's `_try_step`); True if it did."""
        e = self.epoch[i]
        if e > self.stop_after:
            return False
        if self.step[i] == len(self.sched):
            self.epoch[i] += 1
            self.step[i] = 0
            self.grads[i] = set()
            return True
        step, s = self.sched[self.step[i]]
        if self.inflight.busy(i):
            return False
        if self.step[i] == 0 and self.latest_version < self.version_for(e):
            return self._wait(i, "weights")
        task = self.tasks[(step, s)]
        if step != Step.BACKWARD:
            gate = self._inputs_gate(e, s)
            if gate:
                return self._wait(i, gate)
            self._end_wait(i, e, f"{step.value}{s}")
            if task == Task.GA and models.runs_whole(self.stages[s]):
                key = (s, -1 if s in self.static_ga else e)
                if key not in self.whole_done:
                    t0 = yield from self._run_task(Task.GA, s)
                    self.whole_done.add(key)
                    self.w.span(self.lane, Task.GA, e, -1, t0, self.loop.now, stage=s)
                self.step[i] += 1
                yield from self._on_outputs(i, e, s)
                return True
            if task == Task.GA:
                if (i, s) in self.ga_done:
                    t0 = self.loop.now
                else:
                    t0 = yield from self._run_task(Task.GA, s)
                    if s in self.static_ga:
                        self.ga_done.add((i, s))
                self.w.span(self.lane, Task.GA, e, i, t0, self.loop.now)
                self.step[i] += 1
                yield from self._on_outputs(i, e, s)
                return True
            yield from self._dispatch(task, i, e, s)
            return True
        gate = self._out_grads_gate(i, e, self.group_of[s][-1])
        if gate:
            return self._wait(i, gate)
        self._end_wait(i, e, f"B{s}")
        if task is None:
            self.step[i] += 1
            return True
        if task == Task.GA_BWD and models.runs_whole(self.stages[s]):
            self.step[i] += 1
            got = self.whole_grad[(s, e)]
            got.add(i)
            if len(got) == self.K:   # the last interval's gradient: ∇GA over the whole block, then ∇SC
                del self.whole_grad[(s, e)]
                t0 = yield from self._run_task(Task.GA_BWD, s)
                self.w.span(self.lane, Task.GA_BWD, e, -1, t0, self.loop.now, stage=s)
                yield from self._col_grad_sum(e, self.producers[s]["h"], "h")
            return True
        if task == Task.GA_BWD:
            t0 = yield from self._run_task(Task.GA_BWD, s)
            self.w.span(self.lane, Task.GA_BWD, e, i, t0, self.loop.now)
            self.step[i] += 1
            yield from self._deposit(i, e, s, self._wrt(s))
            return True
        yield from self._dispatch(task, i, e, s)
        return True

    def _poll_timeout(self, fresh: bool) -> float:
        """The engine polls every 2 ms while tasks are in flight, to check for stragglers. Where a pass of the
        loop costs CPU (`poll_s`, local runs: it takes the GIL) every poll is simulated; elsewhere nothing
        happens on such a timeout, so the simulation sleeps until the first straggler deadline (same events)."""
        if not self.inflight:
            return GS_POLL_IDLE_S
        if fresh or self.poll_s > 0:   # a new weight version: the next step may fire after this poll
            return GS_POLL_BUSY_S
        due = self.inflight.next_deadline()
        return max(GS_POLL_BUSY_S, due - self.loop.now + 1e-9)

    def run(self):
        while not self.finished:
            fresh = self.arrived_version > self.latest_version
            self.latest_version = max(self.latest_version, self.arrived_version)
            yield des.Poll(self.inbox, self._poll_timeout(fresh))
            if self.poll_s > 0:
                t0 = self.loop.now
                yield des.Compute(self.cpu, self.poll_s / self.w.speed["gs"], 1.0)
                self.busy += self.loop.now - t0
            for msg in self.inbox.drain():
                yield from self.handle(msg)
            progressed = True
            while progressed:
                progressed = False
                for i in range(self.K):
                    while (yield from self.try_step(i)):
                        progressed = True
            self._check_stragglers()
