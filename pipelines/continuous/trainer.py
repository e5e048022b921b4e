"""Warm-started whole-graph rounds on a growing graph with static shapes: one compile per capacity bucket.

The graph of a round is padded to a capacity bucket (vertices and adjacency entries rounded up to the next
power of ``BUCKET``, with at least one padding vertex): padding vertices have no features, labels or masks and
the padding entries are zero-valued and sit in a padding row (`ops.sparse.Adjacency.from_scipy`), so every real
vertex's logits are those of the unpadded graph. The jitted train step, evaluation and forward pass are built
once per stream and reused, so XLA compiles again only when a bucket is outgrown. On small graphs (where a
compile costs more than many epochs) an outgrown bucket is sized for the growth of the next few compiles'
seconds, and the next one is compiled ahead in the background from the measured growth rate. Compiles are
counted from JAX's own compile events (:func:`compile_count`).
"""
from __future__ import annotations

import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ops import models, xla
from ops.optim import dropout_seeds, make_optimizer
from ops.sparse import Adjacency
from pipelines.config import TrainConfig
from pipelines.data.graph import Graph
from pipelines.epochs import DeviceGraph, EarlyStopping, Evaluator, TrainResult, model_inputs, summary_head

BUCKET = 1.25
MIN_CAPACITY = 64

_compiles = 0
_lock = threading.Lock()


_precompiles = 0
PRECOMPILE_THREAD = "stream-precompile"
PRECOMPILE_ROUNDS = 3  # compile the next bucket ahead when the last round's growth would outgrow it this soon
# ... on graphs up to this many adjacency entries: there a compile costs more than many epochs, while on big graphs
# the warm-up's epoch on dummy inputs and its memory would slow the rounds more than the compile saves
PRECOMPILE_MAX_ENTRIES = 1 << 21
# On those small graphs a bucket outgrown by a growing stream is sized for LEAD x the last compile's seconds of the
# measured growth (at least LEAD_MIN_S, at most 2x the graph): at 1.25x steps a fast-growing small graph outgrew
# its bucket every few rounds, and each compile stalled the stream for seconds (the event-to-prediction lag)
LEAD, LEAD_MIN_S, COMPILE_S = 4.0, 5.0, 2.0
RATE_WINDOW = 8  # rounds over which the growth rate is measured


def _on_event(event: str, duration: float, **kw) -> None:
    global _compiles, _precompiles
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            if threading.current_thread().name == PRECOMPILE_THREAD:
                _precompiles += 1
            else:
                _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """XLA compiles in this process so far (every jit of a new function or shape counts one)."""
    return _compiles


def precompile_count() -> int:
    """XLA compiles done ahead, in the background, for a bucket the graph has not reached yet."""
    return _precompiles


def capacity(n: int, minimum: int = MIN_CAPACITY) -> int:
    """The bucket for `n` items: the smallest minimum x BUCKET^k that is > n (room for one padding item)."""
    if n < minimum:
        return minimum
    k = math.ceil(math.log((n + 1) / minimum, BUCKET))
    cap = int(math.ceil(minimum * BUCKET ** k))
    while cap <= n:  # float rounding
        cap = int(math.ceil(cap * BUCKET))
    return cap


class RoundTrainer:
    """The model, optimizer and jitted functions of a stream, reused round after round."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.model = None
        self.tx = None
        self.step = None
        self.evaluator = None
        self.logits = None
        self.shape: tuple[int, int] | None = None  # (vertex, entry) capacity of the last device graph
        self.growths = 0
        self.precompile = True
        self._last_size: tuple[int, int] | None = None
        self._sizes: list[tuple[float, int, int]] = []  # (monotonic time, vertices, entries) of recent rounds
        self.compile_s = COMPILE_S  # the last compile ahead's seconds (how far ahead to size and compile)
        self._warmed: set[tuple[int, int]] = set()
        self._warming: threading.Thread | None = None
        self.precompile_error: BaseException | None = None

    def _build(self, graph: Graph) -> None:
        from pipelines.train import build_model, make_train_step

        self.model = build_model(self.cfg, graph)
        params = self.model.init(jax.random.PRNGKey(self.cfg.seed))
        self.tx = make_optimizer(self.cfg.lr, self.cfg.weight_decay, self.model.decay_mask(params))
        self.step = make_train_step(self.model, self.tx)
        self.evaluator = Evaluator(self.model)
        model = self.model
        self.logits = xla.jit(lambda p, adj, x: models.forward(model, p, adj, x, None))

    def device_graph(self, graph: Graph) -> DeviceGraph:
        """The round's graph padded to its capacity bucket, on the device."""
        if self.model is None:
            self._build(graph)
        x, a = model_inputs(self.cfg, graph)
        n = graph.num_nodes
        self.observe(n, a.nnz)
        shape = self._shape_for((n, a.nnz))
        if shape != self.shape:
            self.growths += 1
        self.shape = shape
        nc, ec = shape
        adj = Adjacency.from_scipy(a, nnz_pad=ec, rows_pad=nc, cols_pad=nc).to_device()
        xp = np.zeros((nc, x.shape[1]), np.float32)
        xp[:n] = x
        labels = np.full(nc, -1, np.int32)
        labels[:n] = graph.labels

        def pad(m):
            out = np.zeros(nc, bool)
            out[:n] = m
            return jnp.asarray(out)

        masks = tuple(pad(m) for m in (graph.train_mask, graph.val_mask, graph.test_mask))
        self._warmed.add(shape)
        if self.precompile:
            self._maybe_precompile(a, x.shape[1], (n, a.nnz))
        return DeviceGraph(adj, jnp.asarray(xp), jnp.asarray(labels), masks)

    def observe(self, vertices: int, entries: int, at: float | None = None) -> None:
        """Record the graph's size (vertices, adjacency entries with self-loops) for the growth rate that
        buckets are planned from; the stream calls it every round, also for rounds that do not train, so that
        the first bucket already has room for the growth seen before it."""
        if not self._sizes or self._sizes[-1][1:] != (vertices, entries):
            at = time.monotonic() if at is None else at
            self._sizes = (self._sizes + [(at, vertices, entries)])[-RATE_WINDOW:]

    def _rate(self) -> tuple[float, float]:
        """Growth per second (vertices, entries) over the recent rounds (0 before two of them)."""
        if len(self._sizes) < 2 or self._sizes[-1][0] <= self._sizes[0][0]:
            return 0.0, 0.0
        (t0, n0, e0), (t1, n1, e1) = self._sizes[0], self._sizes[-1]
        return max(n1 - n0, 0) / (t1 - t0), max(e1 - e0, 0) / (t1 - t0)

    def _planned(self, size: tuple[int, int], rate: tuple[float, float]) -> tuple[int, int]:
        """The buckets for `size` (vertices, entries): with room for LEAD compiles' seconds of growth on small
        graphs (at most 2x), so that a growing stream compiles every few seconds at most, not every few rounds."""
        if size[1] > PRECOMPILE_MAX_ENTRIES:
            return capacity(size[0]), capacity(size[1])
        lead = max(LEAD_MIN_S, LEAD * self.compile_s)
        return tuple(capacity(int(min(s + r * lead, 2 * s))) for s, r in zip(size, rate))

    def _shape_for(self, size: tuple[int, int]) -> tuple[int, int]:
        """The device shape of a graph of `size`: the current one while it fits (buckets never shrink), else the
        smallest shape compiled ahead that fits (and wastes at most 2x), else the planned buckets."""
        if self.shape is not None and size[0] < self.shape[0] and size[1] < self.shape[1]:
            return self.shape
        fits = [w for w in self._warmed if size[0] < w[0] <= 2 * size[0] + MIN_CAPACITY
                and size[1] < w[1] <= 2 * size[1] + MIN_CAPACITY]
        if fits:
            return min(fits, key=lambda w: w[0] * w[1])
        shape = self._planned(size, self._rate())
        return shape if self.shape is None else (max(shape[0], self.shape[0]), max(shape[1], self.shape[1]))

    def _maybe_precompile(self, a, width: int, size: tuple[int, int]) -> None:
        """When the measured growth would outgrow the bucket within PRECOMPILE_ROUNDS rounds or twice the last
        compile's seconds, compile the step, evaluation and forward of the planned next buckets in a background
        thread (the jit caches are per shape), so the round that outgrows them finds them compiled instead of
        waiting for XLA."""
        last, self._last_size = self._last_size, size
        if last is None or (self._warming is not None and self._warming.is_alive()):
            return
        rate = self._rate()
        span = self._sizes[-1][0] - self._sizes[0][0]
        ahead = max(2 * self.compile_s, PRECOMPILE_ROUNDS * span / max(len(self._sizes) - 1, 1))
        soon = tuple(max(s + r * ahead, s + PRECOMPILE_ROUNDS * (s - l)) for s, r, l in zip(size, rate, last))
        if soon[0] < self.shape[0] and soon[1] < self.shape[1]:
            return
        plan = self._planned(tuple(int(x) for x in soon), rate)
        nxt = (max(plan[0], self.shape[0]), max(plan[1], self.shape[1]))
        if nxt in self._warmed or nxt[1] > PRECOMPILE_MAX_ENTRIES:
            return
        self._warmed.add(nxt)
        # not a daemon: an interpreter exiting under a running XLA compile aborts the process
        self._warming = threading.Thread(target=self._warm, args=(nxt, a, width), name=PRECOMPILE_THREAD)
        self._warming.start()

    def close(self) -> None:
        """Wait for a compile ahead to finish."""
        if self._warming is not None:
            self._warming.join()

    def _warm(self, shape: tuple[int, int], a, width: int) -> None:
        t0 = time.monotonic()
        try:
            nc, ec = shape
            # the arrays are built as device_graph and train build theirs, so the jit cache keys match
            adj = Adjacency.from_scipy(a, nnz_pad=ec, rows_pad=nc, cols_pad=nc).to_device()
            x = jnp.asarray(np.zeros((nc, width), np.float32))
            labels = jnp.asarray(np.full(nc, -1, np.int32))
            masks = tuple(jnp.asarray(np.zeros(nc, bool)) for _ in range(3))
            params, opt_state = self.init_state(None, self.cfg.seed)
            params = jax.tree_util.tree_map(lambda v: jax.device_put(np.array(v)), params)
            opt_state = jax.tree_util.tree_map(lambda v: jax.device_put(np.array(v)), opt_state)
            seeds = jnp.asarray(dropout_seeds(0, 0, len(self.model.stages)))
            params, opt_state, loss = self.step(params, opt_state, adj, x, labels, masks[0], seeds)
            float(loss)
            self.evaluator(params, adj, x, labels, masks)
            self.logits(params, adj, x).block_until_ready()
            self.compile_s = time.monotonic() - t0
        except BaseException as e:  # noqa: BLE001 - an optimization only: the round compiles as it would anyway
            self.precompile_error = e

    def init_state(self, graph: Graph, seed: int):
        if self.model is None:
            self._build(graph)
        params = self.model.init(jax.random.PRNGKey(seed))
        return params, self.tx.init(params)

    def train(self, graph: Graph, g: DeviceGraph, epochs: int, seed: int, init_params=None,
              init_opt_state=None) -> TrainResult:
        """`epochs` epochs from the given weights (as `pipelines.train.train` does, on the padded graph)."""
        params, opt_state = self.init_state(graph, seed)
        # Fresh device buffers (the step donates its inputs); device_put of a host copy compiles nothing, where
        # jnp.array would compile a copy per parameter shape.
        if init_params is not None:
            params = jax.tree_util.tree_map(lambda a: jax.device_put(np.array(a)), init_params)
        if init_opt_state is not None:
            opt_state = jax.tree_util.tree_map(lambda a: jax.device_put(np.array(a)), init_opt_state)
        stopper = EarlyStopping(self.cfg.patience)
        history: list[dict] = []
        best_params = params
        t_start = time.perf_counter()
        for epoch in range(epochs):
            seeds = jnp.asarray(dropout_seeds(seed, epoch, len(self.model.stages)))
            t0 = time.perf_counter()
            params, opt_state, loss = self.step(params, opt_state, g.adj, g.train_input, g.labels, g.masks[0], seeds)
            row = {"epoch": epoch, "loss": float(loss), **self.evaluator.on(g, params),
                   "epoch_s": time.perf_counter() - t0}
            history.append(row)
            if stopper.update(epoch, row):
                best_params = jax.tree_util.tree_map(np.array, params)
            if stopper.should_stop:
                break
        summary = summary_head(self.cfg, graph, "whole-graph", history, stopper.best_epoch,
                               time.perf_counter() - t_start)
        return TrainResult(jax.tree_util.tree_map(np.asarray, params), best_params, history, summary,
                           jax.tree_util.tree_map(np.asarray, opt_state))

    def predict(self, params, g: DeviceGraph, rows: np.ndarray) -> np.ndarray:
        """Logits (no dropout) of the given rows of the padded graph."""
        out = self.logits(params, g.adj, g.x)
        return np.asarray(out)[rows]
