"""Tensor-worker backends beyond the fixed local pool, and the factory the runner uses.

- `QueuedPool`: a local pool whose worker count can change while it runs; with an `Autotuner` it follows the
  trend of the task backlog (`--tensor-workers auto`). A dispatcher thread takes tasks off the tensor channel
  into a queue; the workers drain it. The queue's length is the backlog the autotuner watches.
- `InlinePool`: `--mode cpu-only`: every graph server runs its own tensor tasks (one executor per graph server,
  fed only that server's tasks), as a CPU-only deployment would; priced as graph-server time, no Lambdas.
- `pipelines.engine.aws_lambda.AwsLambdaPool`: tasks on AWS Lambda (`--tensor-workers aws`).
"""
from __future__ import annotations

import queue
import threading
import time

from pipelines.engine import messages as M
from pipelines.engine.autotune import Autotuner
from pipelines.engine.messages import EngineError
from pipelines.engine.tensor_worker import LocalPool

MAX_WORKERS = 100


class QueuedPool(LocalPool):
    """A local pool with a dispatcher, a task queue and a resizable set of workers."""

    backend = "local"
    billing = "lambda"   # what the cost model charges the pool's busy time as

    def __init__(self, transport, model_spec: dict, size: int, *, autotuner: Autotuner | None = None, **kw):
        super().__init__(transport, model_spec, size, **kw)
        self.autotuner = autotuner
        self._target = size
        self._alive: dict[int, threading.Thread] = {}
        self._qs = [queue.Queue()]
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
        wc = self.t.consumer([(M.WEIGHTS, 0)], group=f"tensor-pool-weights-{id(self)}")
        tc = self.t.consumer([(M.TENSOR_TASKS, 0)], group="tensor-workers")
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
                self._safe_run(msg)
            finally:
                with self._lock:
                    self.occupied_s += time.monotonic() - t0
                    self._running.pop(k, None)

    def occupied_now(self) -> float:
        """Occupied worker-seconds so far, the running tasks' elapsed time included."""
        now = time.monotonic()
        with self._lock:
            return self.occupied_s + sum(now - t for t in self._running.values())

    def _safe_run(self, msg) -> None:
        try:
            self._run(msg)
        except EngineError as e:
            self.error = e
            self.t.send(M.TENSOR_RESULTS, msg.partition, msg.replace(
                kind="ERROR", arrays={}, meta={**msg.meta, "error": str(e), "task": msg.kind}))

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
        self._qs = [queue.Queue() for _ in range(graph_servers)]

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


def make_tensor_workers(cfg, transport, model_spec: dict):
    """The tensor-worker backend a config asks for (mode and tensor_workers)."""
    faults = dict(fail_rate=cfg.fail_rate, delay_rate=cfg.delay_rate, delay_s=cfg.delay_s, seed=cfg.seed,
                  task_latency_s=getattr(cfg, "task_latency_s", 0.0))
    mode = getattr(cfg, "mode", "serverless")
    tw = cfg.tensor_workers
    if mode == "cpu-only":
        return InlinePool(transport, model_spec, cfg.partitions, **faults)
    if tw == "aws":
        from pipelines.engine.aws_lambda import AwsLambdaPool

        return AwsLambdaPool.from_config(cfg, transport, model_spec)
    if tw == "auto":
        start = autotune_start(cfg)
        return QueuedPool(transport, model_spec, start, autotuner=Autotuner(start, 1, MAX_WORKERS), **faults)
    return LocalPool(transport, model_spec, int(tw), **faults)
