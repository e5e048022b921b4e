"""A graph server: owns one partition, runs GA/∇GA and SC/∇SC for its intervals, and drives their pipeline.

Each interval walks its own schedule (forward stages, then backward stages, epoch after epoch); a step fires as
soon as its inputs are there, so GA of one interval overlaps AV of another on the tensor workers. Reads of ghost
columns are gated by the ghost watermark (the last epoch every producing partition has sent): a task of epoch e
reads ghost values of epoch max(e - S, 0) (smoothed over epochs in SMOOTH, extrapolated in PREDICT; those of an
input transform of epoch e in both, `pipelines.engine.ghosts.input_transforms`), owned values of epoch e
and the weight version `weight_version` names. Reading fixed versions, rather than whatever is newest, keeps runs
deterministic; S = None adds a global barrier per layer.
"""
from __future__ import annotations

import collections
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ops import models
from ops.host import host_empty, host_zeros
from ops.optim import dropout_seeds
from ops.tasks import BLOCK_ARRAYS, ROW_LOCAL_KINDS, backward_fn, forward_fn, gather_transpose_fn
from ops.xla import to_device
from pipelines.engine.ghosts import (FRESH_GHOST_GRADS, FRESH_INPUT_TRANSFORMS, GhostReader, ghost_epoch,
                                     input_transforms)
from pipelines.engine.spans import clock
from pipelines.engine.messages import EngineError, check_routing
from pipelines.engine.param_server import staleness_at, weight_version, weights_due
from pipelines.engine.stragglers import InFlight, StragglerLimits
from schemas.tasks import Channel, Direction, Lifecycle, Message, StageKind, StalenessMode, Step, TaskKind


@functools.lru_cache(maxsize=256)
def _epoch_seeds(seed: int, e: int, num_stages: int) -> tuple[int, ...]:
    """`dropout_seeds` as ints, drawn once per epoch (a generator per task cost more than the task's bookkeeping)."""
    return tuple(int(v) for v in dropout_seeds(seed, e, num_stages))


def _as_run(idx: np.ndarray):
    """idx as a slice when it is one ascending run (the ghosts of one owner, `build_plan`'s order): numpy reads
    and writes a slice in place, where an index array gathers or scatters row by row."""
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and (idx.size == 1 or np.all(np.diff(idx) == 1)):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


class _Interval:
    """Per-interval, per-epoch working state."""

    def __init__(self):
        self.rows: dict = {}      # name -> produced row tensors (this epoch)
        self.saved: dict = {}     # stage -> the inputs it ran on (for its VJP)
        self.grads: dict = {}     # (producer stage, name) -> gradient w.r.t. that tensor's rows/edges
        self.step = 0


class GraphServer:
    """One partition's graph server (see the module doc).

    transport: its channels; plan: the partition's `PartitionPlan` (owned rows, ghosts, intervals); model /
    model_spec: the model and its `ops.spec.ModelSpec` JSON (sent with every tensor task); features: all
    vertices' features (read, not copied, but for a column space a GA gathers); labels / train_mask: of its
    owned vertices; num_partitions: graph servers in the run; staleness: S, or None for synchronous; epochs:
    how many it runs; seed: dropout seeds; loss_scale: 1 / training vertices of the whole graph; straggler_k /
    straggler_min_s: relaunch a task after max(min_s, k x the p90 time of its kind) (`pipelines.engine.stragglers`);
    start_epoch: where a resumed run starts; sync_warmup: epochs below it run with S = 0 (`staleness_at`)."""

    def __init__(self, transport, plan, model: models.Model, model_spec: dict, *, features: np.ndarray,
                 labels: np.ndarray, train_mask: np.ndarray, num_partitions: int, staleness: int | None,
                 epochs: int, seed: int, loss_scale: float, straggler_k: float = 2.0, straggler_min_s: float = 0.5,
                 start_epoch: int = 0, staleness_mode: StalenessMode = StalenessMode.SMOOTH, sync_warmup: int = 0):
        self.transport = transport
        self.plan = plan
        self.partition = plan.partition
        self.model = model
        self.spec = model_spec
        self.stages = model.stages
        self.num_partitions = num_partitions
        self.num_intervals = len(plan.intervals)
        self.staleness = 0 if staleness is None else staleness
        self.sync_barrier = staleness is None
        self.mode = StalenessMode(staleness_mode)
        self.sync_warmup = sync_warmup
        self.epochs = epochs
        self.seed = seed
        self.scale = loss_scale
        self.n_own = plan.num_owned
        colspace = plan.colspace
        self.n_cols = colspace.size
        self.labels = labels
        self.train_mask = train_mask
        self.producers = models.producers(model)
        self.req_grad = models.requires_grad(model)
        # Consecutive row-local AV stages run as one tensor task, keyed by the group's first stage.
        self.group_of = {g[0]: g for g in models.tensor_groups(model)}
        self.schedule = models.epoch_schedule(model)
        # Which (producer stage, tensor) pairs are read at columns, and by which stage.
        self.col_reads, self.row_consumers = models.column_reads(model)
        self._col_readers: dict[tuple[int, str], int] = collections.Counter(
            (self.producers[st.index][name], name) for st in self.stages
            for name, where in models.reads(st).items() if where == "cols")
        # The input features over the column space where a stage gathers them (ghosts too). A GA over them alone
        # runs once per interval (`_static_ga`); once every interval has run it, the columns are dropped (at 2^20
        # R-MAT vertices and P=4 they were 15 bytes per edge).
        self._feature_col_stages = {st for (ps, _), st in self.col_reads.items() if ps == -1}
        self.x_cols = np.ascontiguousarray(features[colspace]) if self._feature_col_stages else None
        # A GA that drops the features out before gathering them reads them every epoch: its padded view stays.
        self._keep_feature_view = any(not models.static_over_features(self.stages[k], -1)
                                      for k in self._feature_col_stages)
        # A stage reading the features at rows gets them gathered from `features` per task (`_feature_rows`):
        # a copy of the partition's rows was as large as the features themselves (R-MAT 2^20, P=4: 132 MB)
        self.features = features
        self._static_blocks()
        # Unweighted GA stages run over the partition's whole block (`build_plan(whole=True)`) once per epoch;
        # each interval takes its rows of the result, and ∇GA runs once all intervals gave their row gradients.
        self.whole_dev = plan.block.to_device() if plan.block is not None else None
        self._whole_stages = {st.index for st in self.stages if self.whole_dev is not None and models.runs_whole(st)}
        self._whole_out: dict[tuple[int, int], list] = {}   # (stage, epoch or -1 if static) -> [rows, takers]
        self._whole_grad: dict[tuple[int, int], list] = {}  # (stage, epoch) -> [row gradients, givers]
        self._static_cols: dict[int, jax.Array] = {}
        self._views: dict[tuple[int, str], np.ndarray] = {}  # (ps, name) -> `_col_view`'s buffer
        self._spare_grads: dict[tuple, np.ndarray] = {}       # shape -> a finished `_whole_backward` buffer
        self._static_ga: dict[tuple[int, int], dict] = {}  # (interval, stage) -> outputs of a GA over features
        self._col_split = [(np.flatnonzero(iv.cols < self.n_own), np.flatnonzero(iv.cols >= self.n_own))
                           for iv in plan.intervals]
        # Stores, keyed by epoch.
        self.fwd = collections.defaultdict(dict)         # (ps, name) -> e -> colspace array
        self.fwd_done = collections.defaultdict(lambda: collections.defaultdict(set))  # ps -> e -> intervals
        self.ghost_wm = collections.defaultdict(lambda: {q: -1 for q in plan.recv})      # (ps,name) -> q -> e
        self.bwd_local = collections.defaultdict(lambda: collections.defaultdict(dict))  # (ps,name)->e->i->grad
        self.bwd_sum = collections.defaultdict(dict)     # (ps, name) -> e -> colspace gradient sum (local)
        self.bwd_remote = collections.defaultdict(lambda: collections.defaultdict(dict))  # (ps,name)->e->q->rows
        self.bwd_wm = collections.defaultdict(lambda: {q: -1 for q in plan.send})
        self.bwd_total = collections.defaultdict(dict)   # (ps, name) -> e -> owned-row gradient
        self._bwd_takers: dict[tuple, set] = {}          # (ps, name, e) -> intervals that took their bwd_total rows
        self.global_wm = collections.defaultdict(set)  # (dir, stage, epoch) -> partitions that finished it
        self.latest_version = -1
        self.start_epoch = start_epoch  # a resumed run starts here; it counts as epoch 0 for staleness
        self.ghosts = GhostReader(self.mode, self.start_epoch, self.n_own, self.n_cols)
        self._fresh_ghosts = input_transforms(self.stages) if self.mode in FRESH_INPUT_TRANSFORMS else frozenset()
        self.epoch = [start_epoch] * self.num_intervals
        # Global ids of the rows SC sends to / receives from each partition (ghost rows travel as vertex blocks).
        self.sc_ids = {q: plan.owned[idx].astype(np.int64) for q, idx in plan.send.items()}
        self.ghost_ids = {q: plan.ghosts[idx].astype(np.int64) for q, idx in plan.recv.items()}
        self._recv_at = {q: _as_run(self.n_own + idx) for q, idx in plan.recv.items()}  # their column positions
        self.state = [_Interval() for _ in range(self.num_intervals)]
        self.inflight = InFlight(StragglerLimits(straggler_k, straggler_min_s), time.monotonic,
                                 lambda msg: transport.send(Channel.TENSOR_TASKS, 0, msg), self._resend)
        self.epoch_stats = collections.defaultdict(lambda: {"loss_sum": 0.0, "count": 0.0, "correct": 0.0, "n": 0})
        self.stop_after = epochs - 1
        self.busy_s = collections.Counter()
        self.max_staleness = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.spans = None  # a SpanLog, set by the driver to record the timeline
        self.lane = f"graph-server-{self.partition}"
        # interval -> [wait start, gate] while its next step is not ready
        self._waiting: list = [None] * self.num_intervals
        self._gate = None
        self.consumer = transport.consumer(
            [(ch, self.partition) for ch in (Channel.TENSOR_RESULTS, Channel.GHOSTS, Channel.GHOST_GRADS,
                                             Channel.WATERMARKS, Channel.CONTROL)], group=f"graph-server-{self.partition}")
        self.wconsumer = transport.consumer([(Channel.WEIGHTS, 0)], group=f"graph-server-{self.partition}-weights")

    # ------------------------------------------------------------------------------------------------ setup
    def _static_blocks(self) -> None:
        # Interval blocks (None where the plan has none: every gather runs over the whole block); all intervals
        # share one padded row count R.
        self.blocks, self.blocks_dev, self.rows_static = [], [], []
        R = self.rows_pad = int(self.plan.intervals[0].row_gids.size)
        for iv in self.plan.intervals:
            blk = iv.block
            self.blocks.append(blk)
            self.blocks_dev.append(None if blk is None else blk.to_device())
            n = iv.end - iv.start
            lab = host_zeros(R, np.int32)
            lab[:n] = self.labels[iv.start:iv.end]
            msk = host_zeros(R, bool)
            msk[:n] = self.train_mask[iv.start:iv.end]
            self.rows_static.append({"labels": lab, "mask": msk})

    # ------------------------------------------------------------------------------------------------ helpers
    def version_for(self, e: int) -> int:
        return weight_version(e, self.staleness, self.mode, self.start_epoch, self.sync_warmup)

    def _bound(self, e: int) -> int:
        """The staleness bound of epoch e: 0 during the synchronous warm-up, S after."""
        return staleness_at(e, self.staleness, self.sync_warmup)

    def seed_for(self, e: int, s: int) -> int:
        return _epoch_seeds(self.seed, e, len(self.stages))[s]

    def _needs_grad(self, ps: int) -> bool:
        return ps != -1 and self.req_grad[ps]

    def _wrt(self, s: int) -> tuple[str, ...]:
        """The inputs of stage s whose gradient a backward must return (their producer needs it)."""
        return tuple(n for n in models.reads(self.stages[s]) if self._needs_grad(self.producers[s][n]))

    def _span(self, kind: str, e: int, i: int, t0: float, t1: float | None = None, detail=None, lane=None) -> None:
        if self.spans is not None:
            self.spans.add(lane or self.lane, kind, e, i, t0, clock() if t1 is None else t1, detail)

    def _wait(self, i: int, gate: str | None) -> bool:
        """Interval i's next step is not ready: its wait starts now (or goes on, behind this gate)."""
        if self.spans is not None:
            w = self._waiting[i]
            if w is None:
                self._waiting[i] = [clock(), gate]
            else:
                w[1] = gate
        return False

    def _end_wait(self, i: int, e: int, step: str) -> None:
        w = self._waiting[i]
        if w is not None:
            self._waiting[i] = None
            self._span(TaskKind.WAIT, e, i, w[0], detail={"gate": w[1], "step": step})

    def _col_gate(self, e: int, ps: int, name: str) -> int | None:
        """The epoch of the ghost values epoch e reads from producer ps, or None while they (or the owned rows
        of epoch e) are not all there; sets the gate."""
        if len(self.fwd_done[ps][e]) < self.num_intervals:
            self._gate = "local"
            return None
        e_ghost = ghost_epoch(e, self._bound(e), self.start_epoch, ps, self._fresh_ghosts)
        wm = self.ghost_wm[(ps, name)]
        if wm and min(wm.values()) < e_ghost:
            self._gate = "ghosts"
            return None
        if self.sync_barrier and len(self.global_wm[(Direction.FORWARD, ps, e)]) < self.num_partitions - 1:
            self._gate = "barrier"
            return None
        if wm and e_ghost == e and self.staleness > 0 and ps not in self._fresh_ghosts:
            # a warm-up epoch: the ghost average the stale epochs after it read covers these values too
            self.ghosts.observe((ps, name), self.fwd[(ps, name)], e)
        return e if not wm else e_ghost

    def _col_input(self, i: int, e: int, ps: int, name: str) -> np.ndarray | None:
        """The column values interval i reads in epoch e, or None while the watermark is behind."""
        iv = self.plan.intervals[i]
        if ps == -1:
            if i not in self._static_cols:  # the input features never change: gather them once
                cols = host_empty((iv.cols.size, *self.x_cols.shape[1:]), self.x_cols.dtype)
                self._static_cols[i] = to_device(np.take(self.x_cols, iv.cols, axis=0, out=cols))
            return self._static_cols[i]
        e_ghost = self._col_gate(e, ps, name)
        if e_ghost is None:
            return None
        own = self.fwd[(ps, name)][e]
        if e_ghost == e:
            return own[iv.cols]
        self.max_staleness = max(self.max_staleness, e - e_ghost)
        # Owned columns from epoch e, ghost columns from epoch e - S: two gathers, no copy of the whole store.
        out = host_empty((iv.cols.size, *own.shape[1:]), own.dtype)
        own_pos, ghost_pos = self._col_split[i]
        out[own_pos] = own[iv.cols[own_pos]]
        out[ghost_pos] = self._ghost_values(ps, name, e, e_ghost)[iv.cols[ghost_pos] - self.n_own]
        return out

    def _col_view(self, e: int, ps: int, name: str) -> jax.Array | None:
        """All column values epoch e reads from producer ps (owned of epoch e, ghosts of the gated epoch), padded
        to the whole block's columns, on the device; None while the watermark is behind."""
        if ps == -1:
            if self._keep_feature_view:
                return to_device(self._feature_view())
            src, e_ghost = self.x_cols, e
        else:
            e_ghost = self._col_gate(e, ps, name)
            if e_ghost is None:
                return None
            src = self.fwd[(ps, name)][e]
        if e_ghost == e and src.shape[0] == self.whole_dev.shape[1]:
            return to_device(src)  # the store is padded to the block's columns: read in place
        view = self._views.get((ps, name))
        if view is None or view.shape[1:] != src.shape[1:]:
            # written over every epoch: the GA reading it has finished when the next is built (this thread
            # waits for its result), and its padding rows stay zero
            view = host_zeros((self.whole_dev.shape[1], *src.shape[1:]), np.float32)
            if ps != -1:
                self._views[(ps, name)] = view
        if e_ghost == e:
            view[: self.n_cols] = src[: self.n_cols]
        else:
            self.max_staleness = max(self.max_staleness, e - e_ghost)
            view[: self.n_own] = src[: self.n_own]
            view[self.n_own: self.n_cols] = self._ghost_values(ps, name, e, e_ghost)
        return to_device(view)

    def _feature_view(self) -> np.ndarray:
        """The feature columns padded to the whole block's columns, for a GA that reads them every epoch (it drops
        them out first), built once; where no per-interval stage gathers them, it replaces `x_cols` (one copy)."""
        view = self._views.get((-1, "h"))
        if view is None:
            view = self.x_cols
            if view.shape[0] != self.whole_dev.shape[1]:
                view = host_zeros((self.whole_dev.shape[1], *self.x_cols.shape[1:]), np.float32)
                view[: self.n_cols] = self.x_cols[: self.n_cols]
            self._views[(-1, "h")] = view
            if self._feature_col_stages <= self._whole_stages:
                self.x_cols = None
        return view

    def _whole_forward(self, i: int, e: int, s: int) -> dict | None:
        """Interval i's rows of GA stage s over the whole block: the first interval to ask computes it for all
        (once per epoch; once for good over the input features), or None while its columns are not there."""
        st = self.stages[s]
        ps = self.producers[s]["h"]
        static = models.static_over_features(st, ps)
        if static and (i, s) in self._static_ga:
            return self._static_ga[(i, s)]
        key = (s, -1 if static else e)
        entry = self._whole_out.get(key)
        if entry is None:
            view = self._col_view(e, ps, "h")
            if view is None:
                return None
            t0 = clock()
            full = np.asarray(forward_fn(st)({}, {"h": view}, self.whole_dev, jnp.uint32(self.seed_for(e, s)))["h"])
            t1 = clock()
            self.busy_s[TaskKind.GA] += t1 - t0
            self._span(TaskKind.GA, e, -1, t0, t1, detail={"stage": s})
            entry = self._whole_out[key] = [full, set()]
            if ps != -1 and self.staleness == 0 and self._col_readers[(ps, "h")] == 1:
                # no later epoch reads this epoch's columns (S = 0), and SC sent the rows others ghost
                self.fwd[(ps, "h")].pop(e, None)
            if static and all((k, -1) in self._whole_out or any(key[1] == k for key in self._static_ga)
                                for k in self._feature_col_stages):
                self.x_cols = None  # no stage gathers the features again
        full, takers = entry
        iv = self.plan.intervals[i]
        out = self._padded(full, iv)
        takers.add(i)
        if static:
            # Â·X never changes: each interval keeps its padded rows (read every epoch, no copy) and the
            # partition's rows go once every interval has its own
            self._static_ga[(i, s)] = {"h": out}
        if len(takers) == self.num_intervals:
            del self._whole_out[key]
        return {"h": out}

    def _whole_backward(self, i: int, e: int, s: int, g: np.ndarray) -> None:
        """Interval i's output gradient of GA stage s; with the last interval's, ∇GA over the whole block (its
        transpose), whose column gradients go out as `_col_grad`'s sum does."""
        iv = self.plan.intervals[i]
        entry = self._whole_grad.get((s, e))
        if entry is None:
            shape = (self.whole_dev.shape[0], *g.shape[1:])
            spare = self._spare_grads.pop(shape, None)  # every interval writes all its rows: padding stays 0
            entry = self._whole_grad[(s, e)] = [host_zeros(shape, np.float32) if spare is None else spare, set()]
        entry[0][iv.start:iv.end] = g[: iv.end - iv.start]
        entry[1].add(i)
        if len(entry[1]) < self.num_intervals:
            return
        del self._whole_grad[(s, e)]
        t0 = clock()
        st = self.stages[s]
        total = gather_transpose_fn(st.aggregator, st.rate)(self.whole_dev, to_device(entry[0]),
                                                            jnp.uint32(self.seed_for(e, s)))
        total = np.asarray(total)[: self.n_cols]
        self._spare_grads[entry[0].shape] = entry[0]  # the transpose that read it has finished
        self.busy_s[TaskKind.GA_BWD] += clock() - t0
        self._span(TaskKind.GA_BWD, e, -1, t0, detail={"stage": s})
        self._col_grad_sum(e, self.producers[s]["h"], "h", total)

    def _ghost_values(self, ps: int, name: str, e: int, e_ghost: int) -> np.ndarray:
        """The ghost rows epoch e reads (pipelines/engine/ghosts.py)."""
        return self.ghosts.read((ps, name), self.fwd[(ps, name)], e, e_ghost)

    def _store(self, ps: int, name: str, e: int) -> np.ndarray:
        st = self.fwd[(ps, name)]
        if e not in st:
            raise EngineError(f"no store for stage {ps} {name} epoch {e}")
        return st[e]

    def _ensure_store(self, ps: int, name: str, e: int, width: tuple) -> np.ndarray:
        st = self.fwd[(ps, name)]
        if e not in st:
            # padded to the whole block's columns where a whole GA reads it, so that GA reads it in place
            whole = self.whole_dev is not None and self._whole_reads(ps, name)
            rows = self.whole_dev.shape[1] if whole else self.n_cols
            st[e] = host_zeros((rows, *width), np.float32)
        return st[e]

    def _whole_reads(self, ps: int, name: str) -> bool:
        return (ps, name) in self.col_reads and self.col_reads[(ps, name)] in self._whole_stages

    # ------------------------------------------------------------------------------------------------ forward
    def _inputs(self, i: int, e: int, s: int) -> dict | None:
        st = self.stages[s]
        ist = self.state[i]
        out = {}
        for name, where in models.reads(st).items():
            ps = self.producers[s][name]
            if where == "cols":
                v = self._col_input(i, e, ps, name)
                if v is None:
                    return None
                out[name] = v
            elif where == "rows":
                out[name] = self._feature_rows(i) if ps == -1 else ist.rows[name]
            else:
                out[name] = ist.rows[name]
        return out

    def _feature_rows(self, i: int) -> np.ndarray:
        """Interval i's rows of the input features, padded to R rows. Read once per epoch (the forward task;
        its backward reads the saved inputs), so a gather costs less than holding the partition's rows."""
        iv = self.plan.intervals[i]
        out = host_zeros((self.rows_pad, *self.features.shape[1:]), self.features.dtype)
        np.take(self.features, self.plan.owned[iv.start:iv.end], axis=0, out=out[: iv.end - iv.start])
        return out

    def _on_outputs(self, i: int, e: int, s: int, outputs: dict) -> None:
        ist = self.state[i]
        iv = self.plan.intervals[i]
        n = iv.end - iv.start
        for name, val in outputs.items():
            val = np.asarray(val)
            if (s, name) not in self.col_reads or self.row_consumers.get((s, name)):
                ist.rows[name] = val   # a tensor read only at columns lives in its store alone
            if (s, name) in self.col_reads:
                store = self._ensure_store(s, name, e, val.shape[1:])
                store[iv.start:iv.end] = val[:n]
        self.fwd_done[s][e].add(i)
        if len(self.fwd_done[s][e]) == self.num_intervals:
            self._scatter(s, e)

    def _scatter(self, s: int, e: int) -> None:
        """SC: once every local interval produced stage s for epoch e, send each partition the rows it ghosts."""
        t0 = clock()
        for (ps, name) in self.col_reads:
            if ps != s:
                continue
            store = self._store(s, name, e)
            for q, idx in self.plan.send.items():
                self.transport.send(Channel.GHOSTS, q, Message(TaskKind.SC, e, s, -1, self.partition, -1,
                                                 arrays={name: store[idx], "vertex": self.sc_ids[q]},
                                                 meta={"name": name}))
        for q in range(self.num_partitions):
            if q != self.partition:
                self.transport.send(Channel.WATERMARKS, q, Message(TaskKind.WATERMARK, e, s, -1, self.partition, -1,
                                                                   meta={"dir": Direction.FORWARD}))
        t1 = clock()
        self.busy_s[TaskKind.SC] += t1 - t0
        self._span(TaskKind.SC, e, -1, t0, t1)

    def _on_ghosts(self, msg: Message) -> None:
        name = msg.meta["name"]
        q, e, s = msg.partition, msg.epoch, msg.stage
        self._check_ids(msg, self.ghost_ids)
        store = self._ensure_store(s, name, e, msg.arrays[name].shape[1:])
        store[self._recv_at[q]] = msg.arrays[name]
        self.ghost_wm[(s, name)][q] = max(self.ghost_wm[(s, name)][q], e)

    # ------------------------------------------------------------------------------------------------ backward
    def _out_grads(self, i: int, e: int, s: int) -> dict | None:
        st = self.stages[s]
        ist = self.state[i]
        iv = self.plan.intervals[i]
        grads = {}
        for name in models.writes(st):
            if (s, name) in self.col_reads:
                tot = self._bwd_total(s, name, e)
                if tot is None:
                    return None
                grads[name] = self._padded(tot, iv)
            elif (s, name) in ist.grads:
                grads[name] = ist.grads[(s, name)]
            elif self.row_consumers.get((s, name)):
                self._gate = "local"
                return None  # its consumer's backward has not run yet
        return grads

    def _bwd_total(self, ps: int, name: str, e: int) -> np.ndarray | None:
        tot = self.bwd_total[(ps, name)].get(e)
        if tot is not None:
            return tot
        local = self.bwd_sum[(ps, name)].get(e)
        if local is None:
            self._gate = "local"
            return None
        fresh = self.mode in FRESH_GHOST_GRADS
        e_ghost = e if fresh else max(e - self._bound(e), self.start_epoch)
        wm = self.bwd_wm[(ps, name)]
        if wm and min(wm.values()) < e_ghost:
            self._gate = "ghost_grads"
            return None
        if self.sync_barrier and len(self.global_wm[(Direction.BACKWARD, ps, e)]) < self.num_partitions - 1:
            self._gate = "barrier"
            return None
        remote = self.bwd_remote[(ps, name)]
        if any(q not in remote[e_ghost] for q in self.plan.send):
            self._gate = "ghost_grads"
            return None
        tot = np.array(local[: self.n_own])
        for q in sorted(self.plan.send):
            tot[self.plan.send[q]] += remote[e_ghost][q]  # send[q] has no repeats: a fancy add is np.add.at's
        self.bwd_total[(ps, name)][e] = tot
        self._bwd_takers[(ps, name, e)] = set()
        self.bwd_sum[(ps, name)].pop(e)  # its owned rows are in tot, its ghost rows went out in _col_grad
        if fresh or self.staleness == 0:
            remote.pop(e_ghost, None)  # no other epoch reads them (none came: a partition that sends no rows)
        return tot

    def _took_out_grads(self, i: int, e: int, s: int) -> None:
        """Interval i's backward of stage s took its output gradients: its row gradients are not read again, nor
        the owned-row gradients once every interval took its rows."""
        ist = self.state[i]
        for name in models.writes(self.stages[s]):
            ist.grads.pop((s, name), None)
            takers = self._bwd_takers.get((s, name, e))
            if takers is None:
                continue
            takers.add(i)
            if len(takers) == self.num_intervals:
                del self._bwd_takers[(s, name, e)]
                self.bwd_total[(s, name)].pop(e, None)

    def _col_grad(self, i: int, e: int, ps: int, name: str, g: np.ndarray) -> None:
        """A local ∇GA/∇AE contribution to columns; once all intervals gave theirs, ∇SC the ghost part."""
        self.bwd_local[(ps, name)][e][i] = np.asarray(g)
        if len(self.bwd_local[(ps, name)][e]) < self.num_intervals:
            return
        t0 = clock()
        parts = self.bwd_local[(ps, name)].pop(e)
        total = host_zeros((self.n_cols, *parts[0].shape[1:]), np.float32)
        for k in range(self.num_intervals):  # fixed order: results do not depend on timing
            iv = self.plan.intervals[k]
            total[iv.cols[: iv.num_cols]] += parts[k][: iv.num_cols]
        self._col_grad_sum(e, ps, name, total, t0)

    def _col_grad_sum(self, e: int, ps: int, name: str, total: np.ndarray, t0: float | None = None) -> None:
        """∇SC: the partition's column gradients of epoch e are summed; the ghost rows go to their owners."""
        t0 = clock() if t0 is None else t0
        self.bwd_sum[(ps, name)][e] = total
        for q, at in self._recv_at.items():
            self.transport.send(Channel.GHOST_GRADS, q, Message(TaskKind.SC_BWD, e, ps, -1, self.partition, -1,
                                                  arrays={name: total[at],
                                                          "vertex": self.ghost_ids[q]}, meta={"name": name}))
        for q in range(self.num_partitions):
            if q != self.partition:
                self.transport.send(Channel.WATERMARKS, q, Message(TaskKind.WATERMARK, e, ps, -1, self.partition, -1,
                                                                   meta={"dir": Direction.BACKWARD}))
        t1 = clock()
        self.busy_s[TaskKind.SC_BWD] += t1 - t0
        self._span(TaskKind.SC_BWD, e, -1, t0, t1)

    def _check_ids(self, msg: Message, expected: dict) -> None:
        ids = msg.arrays.get("vertex")
        if ids is not None and not np.array_equal(ids, expected.get(msg.partition, ())):
            raise EngineError(f"{msg.kind} rows from partition {msg.partition} (epoch {msg.epoch}) name vertices "
                              f"that partition {self.partition} does not exchange with it")

    def _on_ghost_grads(self, msg: Message) -> None:
        name = msg.meta["name"]
        self._check_ids(msg, self.sc_ids)
        self.bwd_remote[(msg.stage, name)][msg.epoch][msg.partition] = msg.arrays[name]
        wm = self.bwd_wm[(msg.stage, name)]
        wm[msg.partition] = max(wm[msg.partition], msg.epoch)

    def _deposit_input_grads(self, i: int, e: int, s: int, grads: dict) -> None:
        ist = self.state[i]
        for name, g in grads.items():
            ps = self.producers[s][name]
            if ps == -1:
                continue
            where = models.reads(self.stages[s])[name]
            if where == "cols":
                self._col_grad(i, e, ps, name, g)
            else:
                key = (ps, name)
                ist.grads[key] = np.asarray(g) if key not in ist.grads else ist.grads[key] + np.asarray(g)

    # ------------------------------------------------------------------------------------------------ tasks
    def _group_meta(self, e: int, s: int) -> dict:
        g = self.group_of[s]
        return {} if len(g) == 1 else {"stages": list(g), "seeds": [self.seed_for(e, k) for k in g]}

    def _dispatch(self, kind: str, i: int, e: int, s: int, arrays: dict, meta: dict) -> None:
        if kind in ROW_LOCAL_KINDS:  # row-local tasks travel without the interval's padding rows
            iv = self.plan.intervals[i]
            n = iv.end - iv.start
            arrays = {k: v[:n] for k, v in arrays.items()}
            meta = {**meta, "rows": self.rows_pad}
        self.inflight.launch(Message(kind, e, s, i, self.partition, self.version_for(e), arrays=arrays,
                                     meta={"model": self.spec, "attempt": 0, **meta}))

    def _resend(self, msg: Message, attempt: int, reason: str) -> None:
        self.transport.send(Channel.TENSOR_TASKS, 0, msg.replace(meta={**msg.meta, "attempt": attempt,
                                                                       "reason": reason}))

    def _check_stragglers(self) -> None:
        self.inflight.relaunch_late()

    def _on_result(self, msg: Message) -> None:
        check_routing(msg, self.num_partitions, self.num_intervals, len(self.stages))
        if msg.kind == TaskKind.ERROR:
            key = (msg.meta["task"], msg.epoch, msg.stage, msg.interval, msg.partition)
            if key in self.inflight:
                if not msg.meta.get("retryable"):
                    raise EngineError(f"tensor task {key} failed: {msg.meta.get('error')}")
                self.inflight.relaunch(key, "failed")
            return
        entry = self.inflight.complete(msg)
        if entry is None:
            return
        self._span(msg.kind, msg.epoch, msg.interval, entry[1], time.monotonic(), lane="tensor-workers",
                   detail={"partition": self.partition, "attempt": entry[2], "busy": msg.meta.get("busy_s")})
        i, e, s = msg.interval, msg.epoch, msg.stage
        arrays = msg.arrays
        if msg.kind in ROW_LOCAL_KINDS:  # back to the interval's static row count
            arrays = {k: self._pad_rows(i, v) for k, v in arrays.items()}
        if e != self.epoch[i]:
            raise EngineError(f"result {msg.kind} for interval {i} epoch {e}, but the interval is in epoch "
                              f"{self.epoch[i]}")
        ist = self.state[i]
        if msg.kind in (TaskKind.AV, TaskKind.AE):
            self._on_outputs(i, e, self.group_of[s][-1], arrays)
        elif msg.kind in (TaskKind.LAST, TaskKind.LOSS):
            stats = self.epoch_stats[e]
            for k in ("loss_sum", "count", "correct"):
                stats[k] += msg.meta[k]
            stats["n"] += 1
            if stats["n"] == self.num_intervals:
                self._report_epoch(e)
            # dh is the gradient w.r.t. the LAST/LOSS input rows, produced by the stage before it.
            self._deposit_input_grads(i, e, s, {"h": arrays["dh"]})
            ist.saved.pop(s, None)
            ist.rows.clear()  # the forward is done: only the saved inputs of backward steps are read again
        elif msg.kind in (TaskKind.AV_BWD, TaskKind.AE_BWD):
            self._deposit_input_grads(i, e, s, {k[2:]: v for k, v in arrays.items() if k.startswith("d_")})
        ist.step += 1

    def _padded(self, rows: np.ndarray, iv) -> np.ndarray:
        """Interval iv's rows of a partition-row array, padded to R rows: a view where the interval fills R."""
        if iv.end - iv.start == self.rows_pad:
            return rows[iv.start:iv.end]
        out = host_zeros((self.rows_pad, *rows.shape[1:]), np.float32)
        out[: iv.end - iv.start] = rows[iv.start:iv.end]
        return out

    def _pad_rows(self, i: int, v: np.ndarray) -> np.ndarray:
        R = self.rows_pad
        if v.shape[0] == R:
            return v
        out = host_zeros((R, *v.shape[1:]), v.dtype)
        out[: v.shape[0]] = v
        return out

    def _sizes(self) -> dict:
        """Rows this partition owns and ghosts: what the driver computes the model's wire minimum from."""
        return {"owned_rows": self.n_own, "ghost_rows": int(self.plan.ghosts.size)}

    def _report_epoch(self, e: int) -> None:
        stats = self.epoch_stats.pop(e)
        self.transport.send(Channel.METRICS, 0, Message(Lifecycle.EPOCH, e, -1, -1, self.partition, -1, meta={
            "loss_sum": stats["loss_sum"], "count": stats["count"], "correct": stats["correct"],
            "max_staleness": self.max_staleness, "relaunches": self.inflight.relaunches,
            "duplicates": self.inflight.duplicates, "busy_s": dict(self.busy_s), "interval_epochs": list(self.epoch),
            **self._sizes()}))

    def _try_step(self, i: int) -> bool:
        """Fire interval i's next step if its inputs are ready; True if anything happened."""
        e = self.epoch[i]
        if e > self.stop_after:
            return False
        ist = self.state[i]
        if ist.step == len(self.schedule):
            self._finish_epoch(i)
            return True
        kind, s = self.schedule[ist.step]
        st = self.stages[s]
        if self.inflight.busy(i):
            return False
        if ist.step == 0 and self.latest_version < self.version_for(e):
            return self._wait(i, "weights")
        if kind == Step.FORWARD and s in self._whole_stages:
            self._gate = None
            out = self._whole_forward(i, e, s)
            if out is None:
                return self._wait(i, self._gate)
            self._end_wait(i, e, f"{kind}{s}")
            ist.saved[s] = {}
            ist.step += 1
            self._on_outputs(i, e, s, out)
            return True
        if kind in (Step.FORWARD, Step.LAST, Step.LOSS):
            self._gate = None
            inputs = {} if (i, s) in self._static_ga else self._inputs(i, e, s)
            if inputs is None:
                return self._wait(i, self._gate)
            self._end_wait(i, e, f"{kind}{s}")
            # Keep what the stage's VJP reads: an unweighted GA's backward needs no inputs (∇GA is Âᵀ·g).
            ist.saved[s] = {} if (st.kind == StageKind.GA and not st.weighted) else inputs
            seed = self.seed_for(e, s)
            if kind == Step.FORWARD and st.kind == StageKind.GA:
                t0 = clock()
                out = self._static_ga.get((i, s))
                if out is None:
                    out = forward_fn(st)({}, inputs, self.blocks_dev[i], jnp.uint32(seed))
                    out = {k: np.asarray(v) for k, v in out.items()}
                    if models.static_over_features(st, self.producers[s]["h"]):
                        # Â·X of the input features is the same every epoch (no dropout): computed once.
                        self._static_ga[(i, s)] = out
                        self._static_cols.pop(i, None)  # its gathered feature columns are not read again
                        if all((k, f) in self._static_ga for k in range(self.num_intervals)
                               for f in self._feature_col_stages):
                            self.x_cols = None  # no stage gathers the features again
                t1 = clock()
                self.busy_s[TaskKind.GA] += t1 - t0
                self._span(TaskKind.GA, e, i, t0, t1)
                ist.step += 1
                self._on_outputs(i, e, s, out)
                return True
            blk = self.blocks[i]
            arrays = {**inputs, "row_gids": self.plan.intervals[i].row_gids}
            meta = {"seed": seed, **self._group_meta(e, s)}
            if st.kind == StageKind.AV:  # a worker that keeps the forward's residuals keeps them for these
                meta["wrt"] = list(self._wrt(s))
            if st.kind == StageKind.AE:
                arrays.update({k: getattr(blk, k) for k in BLOCK_ARRAYS})
            if kind in (Step.LAST, Step.LOSS):
                arrays.update(labels=self.rows_static[i]["labels"], mask=self.rows_static[i]["mask"])
                meta["scale"] = self.scale
            self._dispatch(TaskKind(kind) if kind != Step.FORWARD else TaskKind(st.kind), i, e, s, arrays, meta)
            return True
        # backward
        self._gate = None
        group = self.group_of[s]
        out_grads = self._out_grads(i, e, group[-1])
        if out_grads is None:
            return self._wait(i, self._gate)
        self._took_out_grads(i, e, group[-1])
        self._end_wait(i, e, f"B{s}")
        wrt = self._wrt(s)
        if not wrt and not any(self.stages[k].has_params for k in group):
            ist.step += 1
            return True
        if s in self._whole_stages:
            ist.step += 1
            self._whole_backward(i, e, s, out_grads["h"])
            return True
        inputs = ist.saved.pop(s)  # its backward is the last to read them
        seed = self.seed_for(e, s)
        if st.kind == StageKind.GA:
            t0 = clock()
            if st.weighted:
                _, gin = backward_fn(st, wrt)({}, inputs, self.blocks_dev[i], jnp.uint32(seed),
                                              {k: jnp.asarray(v) for k, v in out_grads.items()})
            else:
                gin = {"h": gather_transpose_fn(st.aggregator, st.rate)(
                    self.blocks_dev[i], jnp.asarray(out_grads["h"]), jnp.uint32(seed))}
            gin = {k: np.asarray(v) for k, v in gin.items()}
            t1 = clock()
            self.busy_s[TaskKind.GA_BWD] += t1 - t0
            self._span(TaskKind.GA_BWD, e, i, t0, t1)
            ist.step += 1
            self._deposit_input_grads(i, e, s, gin)
            return True
        blk = self.blocks[i]
        arrays = {**inputs, "row_gids": self.plan.intervals[i].row_gids,
                  **{f"g_{k}": v for k, v in out_grads.items()}}
        if st.kind == StageKind.AE:
            arrays.update({k: getattr(blk, k) for k in BLOCK_ARRAYS})
        self._dispatch(TaskKind(f"{st.kind}_BWD"), i, e, s, arrays,
                       {"seed": seed, "wrt": list(wrt), **self._group_meta(e, s)})
        return True

    def _finish_epoch(self, i: int) -> None:
        self.epoch[i] += 1
        self.state[i] = _Interval()
        self._gc()

    def _gc(self) -> None:
        """Drop what no interval reads again. Every interval has finished epoch min(epoch) - 1, and epoch e reads
        stores of epochs >= e - S (PREDICT also e - S - 1): the whole-partition stores of one epoch more would
        be a third of a graph server's memory at S=0. A ghost average of epoch t is built from that of t - 1,
        which is kept until epoch t's has been built."""
        low = min(self.epoch) - self.staleness - (1 if self.mode is StalenessMode.PREDICT else 0)
        for stores in (self.fwd, self.bwd_sum, self.bwd_total, self.bwd_remote, self.fwd_done):
            for st in stores.values():
                for e in [e for e in st if e < low]:
                    del st[e]
        self.ghosts.drop_below(low - 1)

    # ------------------------------------------------------------------------------------------------ loop
    def handle(self, msg: Message) -> None:
        if msg.kind == Lifecycle.STOP_AFTER:
            self.stop_after = min(self.stop_after, msg.epoch)
            return
        if msg.kind == Lifecycle.STOP:
            self._stop.set()
            return
        if msg.kind == TaskKind.WATERMARK:
            check_routing(msg, self.num_partitions, self.num_intervals, len(self.stages))
            self.global_wm[(msg.meta["dir"], msg.stage, msg.epoch)].add(msg.partition)
            return
        if msg.kind == TaskKind.SC:
            check_routing(msg, self.num_partitions, self.num_intervals, len(self.stages))
            self._on_ghosts(msg)
            return
        if msg.kind == TaskKind.SC_BWD:
            check_routing(msg, self.num_partitions, self.num_intervals, len(self.stages))
            self._on_ghost_grads(msg)
            return
        self._on_result(msg)

    def _weights_due(self) -> bool:
        return not self.inflight and weights_due(self.epoch, [st.step for st in self.state], self.latest_version,
                                                 self.version_for, self.stop_after)

    @property
    def finished(self) -> bool:
        return all(e > self.stop_after for e in self.epoch)

    def run(self) -> None:
        try:
            while not self._stop.is_set() and not self.finished:
                # Where every interval waits for the next weight version (S = 0 between epochs), block on the
                # weights: polling the other channels instead noticed them up to a poll timeout late, every epoch.
                due = self._weights_due()
                for w in self.wconsumer.poll(0.02 if due else 0.0):
                    self.latest_version = max(self.latest_version, w.version)
                timeout = 0.0 if due else 0.002 if self.inflight else 0.02
                for msg in self.consumer.poll(timeout):
                    self.handle(msg)
                self.consumer.commit()
                progressed = True
                while progressed:
                    progressed = False
                    for i in range(self.num_intervals):
                        while self._try_step(i):
                            progressed = True
                self._check_stragglers()
            self.transport.flush()  # DONE means every message this server sent has been delivered
            self.transport.send(Channel.METRICS, 0, Message(Lifecycle.DONE, min(self.epoch) - 1, -1, -1,
                                                            self.partition, -1, meta={
                "busy_s": dict(self.busy_s), "relaunches": self.inflight.relaunches,
                "duplicates": self.inflight.duplicates, "max_staleness": self.max_staleness, **self._sizes()}))
        except BaseException as e:
            self.error = e
            self.transport.send(Channel.METRICS, 0, Message(Lifecycle.FAILED, -1, -1, -1, self.partition, -1,
                                                            meta={"error": repr(e)}))
        finally:
            self.consumer.close()
            self.wconsumer.close()

    def stop(self) -> None:
        self._stop.set()
