"""Tensor-worker backends beyond the fixed local pool (the factory is `pipelines.engine.runner.make_tensor_workers`).

- `QueuedPool`: a local pool whose worker count can change while it runs; with an `Autotuner` it follows the
  trend of the task backlog (`--tensor-workers auto`). A dispatcher thread takes tasks off the tensor channel
  into a queue; the workers drain it. The queue's length is the backlog the autotuner watches.
- `InlinePool`: `--mode cpu-only`: every graph server runs its own tensor tasks (one executor per graph server,
  fed only that server's tasks), as a CPU-only deployment would; priced as graph-server time, no Lambdas.
- `pipelines.engine.aws_lambda.AwsLambdaPool`: tasks on AWS Lambda (`--tensor-workers aws`).
"""
from __future__ import annotations

import itertools
import queue
import threading
import time

from ops import models
from pipelines.engine.autotune import Autotuner
from pipelines.engine.messages import EngineError
from pipelines.engine.tensor_worker import LocalPool
from schemas.tasks import Channel, Step, TaskKind

MAX_WORKERS = 100


_STEP_OF = {TaskKind.AV: Step.FORWARD, TaskKind.AE: Step.FORWARD, TaskKind.LAST: Step.LAST,
            TaskKind.LOSS: Step.LOSS, TaskKind.AV_BWD: Step.BACKWARD, TaskKind.AE_BWD: Step.BACKWARD}


def task_urgency(schedule):
    """msg -> its rank in a pool's queue (lower first), from an epoch schedule (`ops.models.epoch_schedule`): the
    oldest epoch, then the task furthest along the schedule, then partition and interval. `TaskQueue` orders
    by it, and so does the planner's simulated pool."""
    pos = {step: i for i, step in enumerate(schedule)}

    def rank(msg) -> tuple:
        return (msg.epoch, -pos.get((_STEP_OF.get(msg.kind), msg.stage), 0), msg.partition, msg.interval)
    return rank


class TaskQueue(queue.PriorityQueue):
    """The pool's queue of tensor tasks, oldest epoch first and, within an epoch, the task furthest along the
    epoch's schedule first (then partition, interval, arrival).

    Taken in arrival order, a partition's LOSS tasks waited behind the AV forwards the other partitions sent
    before them, so every partition's ∇GA, and with it the ghost-gradient exchange every AV_BWD waits for,
    came at the end of the forward phase, while the workers idled (P=4 x 8 at ogbn-arxiv's size: LOSS tasks
    sent at 104 ms ran at 262 ms, the workers then idled 60 ms of a 0.76 s epoch). Results do not depend on the
    order tasks run in (fixed versions), only when they arrive."""

    def __init__(self, model):
        super().__init__()
        self.rank = task_urgency(models.epoch_schedule(model))
        self._seq = itertools.count()

    def put(self, msg, block=True, timeout=None) -> None:
        super().put((self.rank(msg), next(self._seq), msg), block, timeout)

    def get(self, block=True, timeout=None):
        return super().get(block, timeout)[2]


class QueuedPool(LocalPool):
    """A local pool with a dispatcher, a task queue (`TaskQueue`: the most urgent task first) and a resizable set
    of workers."""

    backend = "local"
    billing = "lambda"   # what the cost model charges the pool's busy time as

    def __init__(self, transport, model_spec: dict, size: int, *, autotuner: Autotuner | None = None, **kw):
        super().__init__(transport, model_spec, size, **kw)
        self.autotuner = autotuner
        self._target = size
        self._alive: dict[int, threading.Thread] = {}
        self._qs = [TaskQueue(self.model)]
        self.occupied_s = 0.0
        self._running: dict[int, float] = {}   # worker -> start of its current task
        self.peak_workers = size

    # -------------------------------------------------------------------------------------------- structure
    def _queue_for(self, msg) -> queue.Queue:
        return self._qs[0]

    def _queue_of(self, k: int) -> queue.Queue:
        return self._qs[0]

    def backlog(self) -> int:
        return sum(q.qsize() for q in self._qs)

    # -------------------------------------------------------------------------------------------- threads
    def start(self) -> None:
        wc = self.transport.consumer([(Channel.WEIGHTS, 0)], group=f"tensor-pool-weights-{id(self)}")
        tc = self.transport.consumer([(Channel.TENSOR_TASKS, 0)], group="tensor-workers")
        for name, target, args in [("tensor-weights", self._weights_loop, (wc,)),
                                   ("tensor-dispatch", self._dispatch_loop, (tc,))] + (
                [("tensor-autotune", self._tune_loop, ())] if self.autotuner else []):
            th = threading.Thread(target=target, args=args, daemon=True, name=name)
            self._threads.append(th)
            th.start()
        self.resize(self.size)

    def _dispatch_loop(self, consumer) -> None:
        try:
            while not self._stop.is_set():
                for msg in consumer.poll(0.05):
                    self._queue_for(msg).put(msg)
                consumer.commit()
        finally:
            consumer.close()

    def resize(self, n: int) -> None:
        """Set the number of workers: new ones start at once, surplus ones leave after their current task."""
        with self._lock:
            self._target = self.size = n
            self.peak_workers = max(self.peak_workers, n)
            for k in range(n):
                if k not in self._alive:
                    th = threading.Thread(target=self._worker, args=(k,), daemon=True, name=f"tensor-{k}")
                    self._alive[k] = th
                    self._threads.append(th)
                    th.start()

    def _worker(self, k: int) -> None:
        q = self._queue_of(k)
        while not self._stop.is_set():
            with self._lock:
                if k >= self._target:
                    del self._alive[k]
                    return
            try:
                msg = q.get(timeout=0.05)
            except queue.Empty:
                continue
            t0 = time.monotonic()
            with self._lock:
                self._running[k] = t0
            try:
                self.run_task(msg)
            finally:
                with self._lock:
                    self.occupied_s += time.monotonic() - t0
                    self._running.pop(k, None)

    def occupied_now(self) -> float:
        """Occupied worker-seconds so far, the running tasks' elapsed time included."""
        now = time.monotonic()
        with self._lock:
            return self.occupied_s + sum(now - t for t in self._running.values())

    def run_task(self, msg) -> None:
        """Run one tensor task in the caller's thread (what each worker thread does with a task it takes): its
        replies go out on the transport, an EngineError as an ERROR reply to the task's graph server."""
        try:
            self._run(msg)
        except EngineError as e:
            self.error = e
            self.transport.send(Channel.TENSOR_RESULTS, msg.partition, msg.replace(
                kind=TaskKind.ERROR, arrays={}, meta={**msg.meta, "error": str(e), "task": msg.kind}))

    def _tune_loop(self) -> None:
        tuner = self.autotuner
        while not self._stop.wait(tuner.period_s):
            new = tuner.observe(self.backlog(), self.occupied_now())
            if new is not None:
                self.resize(new)

    def stats(self) -> dict:
        st = super().stats()
        st.update(backend=self.backend, billing=self.billing, peak_workers=self.peak_workers,
                  occupied_s=self.occupied_s)
        if self.autotuner is not None:
            st["autotune"] = self.autotuner.summary()
        return st


class InlinePool(QueuedPool):
    """cpu-only: graph server p's tensor tasks run on graph server p (one executor each), not on Lambdas."""

    backend = "inline"
    billing = "server"

    def __init__(self, transport, model_spec: dict, graph_servers: int, **kw):
        super().__init__(transport, model_spec, graph_servers, **kw)
        self._qs = [TaskQueue(self.model) for _ in range(graph_servers)]

    def _queue_for(self, msg) -> queue.Queue:
        if not 0 <= msg.partition < len(self._qs):
            raise EngineError(f"tensor task for unknown graph server {msg.partition}")
        return self._qs[msg.partition]

    def _queue_of(self, k: int) -> queue.Queue:
        return self._qs[k]

    def resize(self, n: int) -> None:
        if n != len(self._qs):
            raise EngineError("cpu-only runs one tensor executor per graph server")
        super().resize(n)


def autotune_start(cfg) -> int:
    """Dorylus's starting point: one worker per vertex interval (of all partitions), at most 100."""
    return max(1, min(cfg.partitions * cfg.intervals, MAX_WORKERS))


def autotuned_pool(cfg, transport, model_spec: dict, **faults) -> QueuedPool:
    """`--tensor-workers auto`: a queued pool starting at `autotune_start` workers, resized by an Autotuner."""
    start = autotune_start(cfg)
    return QueuedPool(transport, model_spec, start, autotuner=Autotuner(start, 1, MAX_WORKERS), **faults)
