"""Tensor workers: the `TensorWorker` interface every backend implements, and the local pool backend (threads)
with fault injection."""
from __future__ import annotations

import abc
import collections
import functools
import math
import threading
import time

import jax.numpy as jnp
import numpy as np

from ops import models
from ops.tasks import run_tensor_task
from pipelines.engine.messages import EngineError
from ops.params import flatten, stage_slice, stages_of, unflatten
from schemas.tasks import Channel, Message, TaskKind


class WeightCache:
    """Weight versions a worker has seen on the weights channel, minus those the parameter server retired."""

    def __init__(self):
        self._versions: dict[int, dict] = {}
        self._retired_below = 0
        self._cv = threading.Condition()

    def put(self, msg: Message) -> None:
        with self._cv:
            # on the device once per version, not once per task that reads it
            self._versions[msg.version] = unflatten({k: jnp.asarray(v) for k, v in msg.arrays.items()})
            self._retired_below = max(self._retired_below, int(msg.meta.get("retire_below", 0)))
            for v in [v for v in self._versions if v < self._retired_below]:
                del self._versions[v]
            self._cv.notify_all()

    def get(self, version: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while version not in self._versions:
                if version < self._retired_below:
                    raise EngineError(f"weight version {version} does not exist (retired; the stash keeps "
                                      f">= {self._retired_below})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"weight version {version} does not exist (not published within "
                                      f"{timeout:.0f}s)")
                self._cv.wait(left)
            return self._versions[version]


class ResidualCache:
    """AV forwards' residuals (`ops.tasks.Saved`) that a local pool keeps for the same interval's AV_BWD, within
    a byte cap.

    The backward then skips its forward's matrix products (about a fifth of the dense work of a GCN epoch). A
    miss (the cache was full, the forward ran in another process, the weight version differs) only means the
    backward runs the forward again, with the same bits, so hits change no result. A full cache takes no new
    entries instead of evicting old ones: the oldest are the closest to their backward."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: dict[tuple, tuple[int, int, object, int]] = {}   # (partition, interval, stage) -> entry
        self.bytes = self.peak_bytes = 0
        self.hits = self.misses = self.refused = 0
        self._lock = threading.Lock()

    def put(self, msg: Message, saved) -> None:
        nbytes = saved.nbytes
        key = (msg.partition, msg.interval, msg.stage)
        with self._lock:
            old = self._entries.pop(key, None)   # an older epoch's forward whose backward ran elsewhere
            if old is not None:
                self.bytes -= old[3]
            if self.bytes + nbytes > self.max_bytes:
                self.refused += 1
                return
            self._entries[key] = (msg.epoch, msg.version, saved, nbytes)
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def take(self, msg: Message):
        """The residuals kept for backward task `msg` (same interval, epoch and weight version), or None."""
        key = (msg.partition, msg.interval, msg.stage)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[:2] != (msg.epoch, msg.version):
                self.misses += 1
                return None
            del self._entries[key]
            self.bytes -= entry[3]
            self.hits += 1
            return entry[2]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "refused": self.refused,
                "peak_mb": round(self.peak_bytes / 2**20, 1), "max_mb": round(self.max_bytes / 2**20, 1)}


class TensorWorker(abc.ABC):
    """The interface of every tensor-worker backend: runs the tensor tasks (`schemas.tasks.TENSOR_TASK_KINDS`)
    sent on the tensor channel, replies on the graph server's result channel and sends dW to the parameter
    server. Implemented by `LocalPool` and, through it, `pipelines.engine.pools.QueuedPool` / `InlinePool` and
    `pipelines.engine.aws_lambda.AwsLambdaPool`; the runner and the tensor-worker role use only this."""

    #: set when the backend failed for good (the driver raises it)
    error: BaseException | None = None

    @abc.abstractmethod
    def start(self) -> None:
        """Start consuming tasks (threads, clients)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop consuming and wait for the workers."""

    def stats(self) -> dict:
        """Counters for the summary and the cost meter (tasks, busy_s, workers, billing, ...)."""
        return {}


def execute(model: models.Model, msg: Message, params: dict,
            residuals: ResidualCache | None = None) -> tuple[Message, dict | None]:
    """Run a task message against a weight version; returns the reply for the graph server and the dW (if any).
    With `residuals`, an AV forward keeps its residuals there and an AV_BWD reads its forward's."""
    keep = saved = None
    if residuals is not None and msg.kind == TaskKind.AV:
        keep = functools.partial(residuals.put, msg)
    elif residuals is not None and msg.kind == TaskKind.AV_BWD:
        saved = residuals.take(msg)
    arrays, grads, scalars = run_tensor_task(model, msg.kind, msg.stage, params, msg.arrays, msg.meta,
                                             keep=keep, saved=saved)
    reply = Message(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version,
                    arrays={k: np.asarray(v) for k, v in arrays.items()},
                    meta={"attempt": msg.meta.get("attempt", 0), **scalars})
    return reply, (flatten(grads) if grads else None)


class LocalPool(TensorWorker):
    """A pool of worker threads on this machine (JAX releases the GIL while it computes).

    Fault injection for tests and benchmarks: each task fails with probability `fail_rate` (the reply is an
    error, as a crashed Lambda's would be) or is delayed by an exponential time of mean `delay_s` with
    probability `delay_rate`, so the graph servers' straggler relaunch can be exercised.

    `task_latency_s` adds a fixed latency to every task, as a remote worker's round trip would (a Lambda
    invocation over the network): the worker thread sleeps, which holds no core and releases the GIL, so a pool
    of N such workers behaves like N remote ones. It is not billed (Lambda bills the function's run, not the
    network around it).

    The pool's workers share one `ResidualCache` of `residual_cache_mb` (0: none), so a backward skips the
    matrix products of its forward when the same pool ran that forward.
    """

    def __init__(self, transport, model_spec: dict, size: int, *, fail_rate: float = 0.0, delay_rate: float = 0.0,
                 delay_s: float = 0.0, seed: int = 0, weight_timeout: float = 120.0, task_latency_s: float = 0.0,
                 residual_cache_mb: float = 0.0):
        self.transport = transport
        self.model = models.from_spec(model_spec)
        self.size = size
        self.fail_rate, self.delay_rate, self.delay_s = fail_rate, delay_rate, delay_s
        self.task_latency_s = task_latency_s
        self.residuals = ResidualCache(int(residual_cache_mb * 2**20)) if residual_cache_mb > 0 else None
        self.rng = np.random.default_rng(seed + 7919)
        self.rng_lock = threading.Lock()
        self.weights = WeightCache()
        self.weight_timeout = weight_timeout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.busy_s = 0.0
        self.billed_ms = 0     # sum over tasks of the busy time rounded up to 1 ms (what Lambda would bill)
        self.tasks = 0
        self.failed = 0
        self.delayed = 0
        self.active = 0
        self.peak_concurrency = 0
        self.duplicates_skipped = 0
        self._done: collections.OrderedDict = collections.OrderedDict()  # keys of tasks this pool completed
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        wc = self.transport.consumer([(Channel.WEIGHTS, 0)], group=f"tensor-pool-weights-{id(self)}")
        self._threads.append(threading.Thread(target=self._weights_loop, args=(wc,), daemon=True,
                                              name="tensor-weights"))
        for k in range(self.size):
            c = self.transport.consumer([(Channel.TENSOR_TASKS, 0)], group="tensor-workers")
            self._threads.append(threading.Thread(target=self._loop, args=(c,), daemon=True, name=f"tensor-{k}"))
        for th in self._threads:
            th.start()

    def _weights_loop(self, consumer) -> None:
        while not self._stop.is_set():
            for msg in consumer.poll(0.05):
                self.weights.put(msg)

    def _draw(self) -> tuple[bool, float]:
        with self.rng_lock:
            fail = self.rng.random() < self.fail_rate
            delay = self.rng.exponential(self.delay_s) if (self.delay_s > 0 and self.rng.random() < self.delay_rate) \
                else 0.0
        return fail, delay

    def _loop(self, consumer) -> None:
        while not self._stop.is_set():
            for msg in consumer.poll(0.05, max_messages=1):
                try:
                    self._run(msg)
                except EngineError as e:
                    # A relaunched duplicate may ask for a version the stash already dropped; the graph server
                    # ignores errors for tasks it no longer waits on and fails the run for those it does.
                    error = msg.replace(kind=TaskKind.ERROR, arrays={},
                                        meta={**msg.meta, "error": str(e), "task": msg.kind})
                    self.transport.send(Channel.TENSOR_RESULTS, msg.partition, error)
            consumer.commit()  # the task is handled: a restarted worker need not run it again

    def _run(self, msg: Message) -> None:
        with self._lock:  # tasks in progress at once (sleeping through their latency included)
            if msg.key in self._done:
                # a relaunch of a task this pool already answered (it was late in the queue, not lost): running
                # it again would only lengthen the queue the relaunch came from
                self.duplicates_skipped += 1
                return
            self.active += 1
            self.peak_concurrency = max(self.peak_concurrency, self.active)
        try:
            self._run_one(msg)
        finally:
            with self._lock:
                self.active -= 1

    def _run_one(self, msg: Message) -> None:
        fail, delay = self._draw()
        if fail:
            with self._lock:
                self.failed += 1
            self.transport.send(Channel.TENSOR_RESULTS, msg.partition, msg.replace(
                kind=TaskKind.ERROR, arrays={}, meta={**msg.meta, "error": "injected failure", "task": msg.kind,
                                               "retryable": True}))
            return
        params = self.weights.get(msg.version, self.weight_timeout)
        if self.task_latency_s > 0:
            time.sleep(self.task_latency_s)
        t0 = time.perf_counter()
        reply, grads = execute(self.model, msg, params, self.residuals)
        dt = time.perf_counter() - t0
        if delay:
            with self._lock:
                self.delayed += 1
            time.sleep(delay)
        with self._lock:
            self.busy_s += dt
            self.billed_ms += max(1, math.ceil(dt * 1000))
            self.tasks += 1
        if grads is not None:
            gmsg = Message(TaskKind.GRAD, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version, arrays=grads)
            for name in stages_of(grads):  # one GRAD message per stage: the parameter server collects by stage
                self.transport.send(Channel.GRADS, 0, gmsg.replace(arrays=stage_slice(grads, name),
                                                                   meta={"stage_name": name}))
        reply.meta["busy_s"] = dt
        self.transport.send(Channel.TENSOR_RESULTS, msg.partition, reply)
        with self._lock:
            self._done[msg.key] = True
            while len(self._done) > 100_000:
                self._done.popitem(last=False)

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(timeout=5)
        if self.residuals is not None:
            self.residuals.clear()

    def stats(self) -> dict:
        return {"workers": self.size, "tasks": self.tasks, "busy_s": self.busy_s, "injected_failures": self.failed,
                "injected_delays": self.delayed, "billed_ms": self.billed_ms,
                "duplicates_skipped": self.duplicates_skipped,
                "peak_concurrency": self.peak_concurrency,
                **({"residual_cache": self.residuals.stats()} if self.residuals is not None else {})}
