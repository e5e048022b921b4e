"""Calibration: task costs of the plan from measured runs (their timeline.jsonl, summary.json and config.toml).

Per task kind the time of one task is c + a x base + b x wide (`shape.task_size`: nonzeros or rows, and those
times the width moved or multiplied, on the padded block sizes every task of the run used), so it scales with
the blocks of another partition plan; c is the kind's fixed cost per task (dispatch, conversions: it dominates
small blocks) and can be told apart from a and b only by runs of different block sizes (give two, e.g. the same
graph with 2 and 6 intervals). c, a and b are fitted with non-negative least squares to the runs' measured
spans: a tensor task's compute time (`busy`, measured on the worker), a graph server's GA/∇GA/SC/∇SC span, the
parameter server's WU. Epoch 0 is left out (it compiles every stage). The measured times include the machine's
other load: with `background` other runnable threads on `cores` cores, one of the run's threads got
min(1, cores / (background + 1)) of a core, so a task's work is its time times that (the simulator then shares
the cores among the simulated threads and the same background). Up to three numbers are fitted to the runs'
epoch times (`fit_overheads`): the graph server's untimed work per tensor task, the CPU of one pass of its poll
loop and the per-message hand-off latency.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from pipelines.config import ConfigError, build_config, load_toml
from pipelines.engine import spans as span_log
from ops import models
from pipelines.plan.shape import (TENSOR_TASKS, Shape, Step, Task, build_stages, group_of, schedule, step_task,
                                  task_size)
from pipelines.engine.pools import autotune_start
from pipelines.plan.cluster import Layout, Network
from pipelines.plan.meter import measured_poll_s
from pipelines.plan.sim import simulate
from pipelines.plan import world
from schemas.tasks import StalenessMode
from pipelines.plan.world import epoch_time, model_reads

#: A kind the calibration run did not time borrows the coefficients of kinds that do the same work (the fused
#: last layer is an AV's forward and backward plus the loss; a VJP walks the same block as its forward).
FALLBACK = {Task.LAST: (Task.AV_BWD, Task.LOSS), Task.LOSS: (Task.LAST,), Task.GA_BWD: (Task.GA,),
            Task.GA: (Task.GA_BWD,), Task.SC_BWD: (Task.SC,), Task.SC: (Task.SC_BWD,), Task.AE_BWD: (Task.AE,),
            Task.AE: (Task.AE_BWD,), Task.AV_BWD: (Task.AV,), Task.AV: (Task.AV_BWD,)}


#: Cores a local run's process can use at once: its threads share one GIL (see `local_layout`).
PROCESS_CORES = 1.0


@dataclasses.dataclass
class Costs:
    """Seconds of one task of each kind on one free core of the calibration machine: c + a x base + b x wide."""

    coef: dict           # Task -> (a, b, c)
    local_latency_s: float = 0.0002
    source: str = ""
    samples: dict = dataclasses.field(default_factory=dict)   # Task -> number of measured spans
    background: float = 0.0     # other runnable threads on the calibration machine while it ran
    cores: float = 1.0
    gs_step_s: float = 0.0      # graph-server thread time per tensor task outside any span (fitted)
    poll_s: float = 0.0         # local: CPU of one pass of a graph server's poll loop (metered, else fitted)

    def seconds(self, kind: Task, size) -> float:
        a, b, c = self.coefficients(kind)
        return c + a * size.base + b * size.wide

    def coefficients(self, kind: Task) -> tuple[float, float, float]:
        if kind in self.coef:
            return tuple(self.coef[kind]) + (0.0,) * (3 - len(self.coef[kind]))
        borrowed = [self.coef[k] for k in FALLBACK.get(kind, ()) if k in self.coef]
        if not borrowed:
            raise ConfigError(f"the calibration run ({self.source}) has no {kind.value} tasks (nor any alike) to "
                              f"time; calibrate with a run of the same model")
        return tuple(sum(c[k] if k < len(c) else 0.0 for c in borrowed) for k in range(3))

    def to_json(self) -> dict:
        return {"source": self.source, "local_latency_s": self.local_latency_s, "background": self.background,
                "cores": self.cores, "gs_step_s": self.gs_step_s, "poll_s": self.poll_s,
                "kinds": {k.value: dict(zip(("per_base_s", "per_wide_s", "per_task_s"), self.coefficients(k)),
                                        samples=self.samples.get(k, 0)) for k in sorted(self.coef)}}


@dataclasses.dataclass
class Measured:
    """A measured run: its config, the shape of its partition plan and its timeline."""

    cfg: object
    shape: Shape
    stages: tuple
    rows: list
    summary: dict

    def epoch_time(self, warmup: int = 1) -> float:
        """Steady-state seconds per epoch (`epoch_time` of its WU completion times)."""
        ends = sorted(r["t1"] for r in self.rows if r["kind"] == Task.WU.value)
        if len(ends) < 2:
            raise ConfigError("the measured run has fewer than two weight updates in its timeline")
        return epoch_time(ends, warmup)


def shape_of_summary(summary: dict) -> Shape:
    """The partition plan's sizes as the run's summary records them (ghost rows spread evenly over peers)."""
    ds, st = summary["dataset"], summary["partition_stats"]
    P, K, n = int(st["partitions"]), int(st["intervals"]), int(ds["nodes"])
    per = 0 if P == 1 else max(1, round(st["ghost_ratio"] * n / P / (P - 1)))
    send = [{q: per for q in range(P) if q != p} for p in range(P)]
    return Shape(n, int(ds["edges"]), int(ds["features"]), int(ds["classes"]), P, K, int(st["rows_pad"]),
                 int(st["cols_pad"]), int(st["nnz_pad"]), send, [math.ceil(n / P)] * P)


def load_run(run_dir: str | Path) -> Measured:
    d = Path(run_dir)
    for f in ("timeline.jsonl", "summary.json", "config.toml"):
        if not (d / f).is_file():
            raise ConfigError(f"calibration run {d}: no {f} (give the directory of an engine run)")
    summary = json.loads((d / "summary.json").read_text())
    if "partition_stats" not in summary:
        raise ConfigError(f"calibration run {d}: not an engine run (no partition stats in summary.json)")
    cfg = build_config(load_toml(d / "config.toml"), {})
    shape = shape_of_summary(summary)
    stages = build_stages(cfg.model, shape.features, shape.classes, hidden=cfg.hidden, layers=cfg.layers,
                          heads=cfg.heads, out_heads=cfg.out_heads, order=cfg.order).stages
    rows = span_log.read(d / "timeline.jsonl")
    return Measured(cfg, shape, stages, rows, summary)


def stage_order(stages) -> dict:
    """Task -> the stages its tasks run for, in the order one interval (or graph server, for SC and ∇SC) meets
    them within an epoch: the timeline has no stage field, so the n-th span of a kind is the n-th of these."""
    producers, col_reads, _ = model_reads(stages)
    order: dict = {}
    for step, s in schedule(stages):
        t = step_task(stages, step, s)
        if t is not None:
            order.setdefault(t, []).append(s)
    # A graph server closes a stage (and records an SC span) per task group: fused AV stages close at their last.
    ends = {g[-1] for g in group_of(stages).values()}
    order[Task.SC] = [st.index for st in stages if st.kind in ("AV", "AE", "GA") and st.index in ends]
    bwd = []
    for step, s in schedule(stages):
        if step == Step.BACKWARD or step in (Step.LAST, Step.LOSS):
            for name, where in models.reads(stages[s]).items():
                ps = producers[s][name]
                if where == "cols" and ps != -1 and ps not in bwd:
                    bwd.append(ps)
    order[Task.SC_BWD] = bwd
    order[Task.WU] = [0]
    return order


def tagged(rows: list, stages) -> list[tuple[dict, int]]:
    """Every span with the stage it ran for, by its order within (partition, interval, epoch, kind)."""
    order = stage_order(stages)
    seen: dict = {}
    out = []
    for r in sorted(rows, key=lambda r: r["t0"]):
        try:
            kind = Task(r["kind"])
        except ValueError:
            continue
        if kind == Task.WAIT:
            continue
        if "stage" in r:   # a span that names its stage (a GA over a partition's whole block)
            out.append((r, int(r["stage"])))
            continue
        part = r.get("partition", r["lane"])
        key = (part, r["interval"], r["epoch"], kind)
        n = seen.get(key, 0)
        seen[key] = n + 1
        stages_of = order.get(kind, [])
        if kind in (Task.GA, Task.GA_BWD):   # a whole-block GA's spans name their stage (above)
            stages_of = [s for s in stages_of if not models.runs_whole(stages[s])]
        if n < len(stages_of):
            out.append((r, stages_of[n]))
    return out


def _partition(r: dict) -> int:
    if "partition" in r:
        return int(r["partition"])
    lane = r["lane"]
    return int(lane.rsplit("-", 1)[1]) if lane.startswith("graph-server-") else 0


def samples(m: Measured, skip_epochs: int = 1) -> dict:
    """Task -> list of (work, seconds) measured in the run (epochs below skip_epochs left out)."""
    out: dict = {}
    producers = model_reads(m.stages)[0]
    for r, s in tagged(m.rows, m.stages):
        kind = Task(r["kind"])
        if r["epoch"] < skip_epochs:
            continue
        if kind == Task.GA and models.static_over_features(m.stages[s], producers[s]["h"]):
            continue   # Â·X of the input features: computed in epoch 0 only, later spans time a cache lookup
        if kind in TENSOR_TASKS:
            if r.get("busy") is None or r.get("attempt", 0):
                continue
            secs = float(r["busy"])
        else:
            secs = r["t1"] - r["t0"]
        size = task_size(m.stages, m.shape, kind, s, _partition(r))
        out.setdefault(kind, []).append((size.base, size.wide, secs))
    return out


def fit(points: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """(a, b, c) >= 0 minimizing the squared error of c + a x base + b x wide on per-size median times (the
    median epoch is what the plan predicts, so the typical task, not the one a burst of other load slowed); c
    only when the points have more than one block size (one size cannot tell a fixed cost from a slope). None
    when every task had no work (SC with one partition sends nothing): such a run cannot time the kind."""
    by_size: dict = {}
    for base, wide, t in points:
        if base > 0 or wide > 0:
            by_size.setdefault((base, wide), []).append(t)
    if not by_size:
        return None
    keys = sorted(by_size)
    ys = np.array([float(np.quantile(by_size[k], world.QUANTILE)) for k in keys])
    a = np.array([[k[0], k[1]] for k in keys], float)
    if len(keys) == 1:   # one size: all of it per base unit (both scale with the block)
        return (float(ys[0] / a[0, 0]), 0.0, 0.0) if a[0, 0] > 0 else (0.0, float(ys[0] / max(a[0, 1], 1.0)), 0.0)
    sizes = len({k[0] for k in keys})
    if sizes > 1:
        a = np.column_stack([a, np.ones(len(keys))])
    scale = np.maximum(a.max(axis=0), 1e-30)
    sol, _ = nnls(a / scale, ys)
    sol = sol / scale
    return float(sol[0]), float(sol[1]), float(sol[2]) if sizes > 1 else 0.0


def calibrate(run_dirs, skip_epochs: int = 1, *, background: float | list = 0.0,
              cores: float | None = None) -> tuple[Costs, Measured]:
    """Task costs of measured engine runs (one directory or several; each measured with `background` other
    runnable threads on `cores`: one figure, or one per run). Returns the costs and the first run."""
    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    bgs = list(background) if isinstance(background, (list, tuple)) else [background] * len(dirs)
    runs = [load_run(d) for d in dirs]
    model = {(m.cfg.model, m.cfg.hidden, m.cfg.layers, m.cfg.order) for m in runs}
    if len(model) > 1:
        raise ConfigError(f"calibration runs {', '.join(map(str, dirs))} trained different models: calibrate with "
                          f"runs of one model")
    cores = float(cores or os.cpu_count() or 1)
    pts: dict = {}
    for m, d, bg in zip(runs, dirs, bgs):
        share = min(1.0, cores / (bg + 1.0))
        got = samples(m, skip_epochs)
        if not got:
            raise ConfigError(f"calibration run {d}: no timed tasks after epoch {skip_epochs - 1} "
                              f"(train for more epochs)")
        for kind, p in got.items():
            pts.setdefault(kind, []).extend((base * 1.0, wide * 1.0, t * share) for base, wide, t in p)
    fits = {kind: fit(p) for kind, p in pts.items()}
    coef = {kind: f for kind, f in fits.items() if f is not None}

    kinds = {t.value for t in TENSOR_TASKS}
    lat = [r["t1"] - r["t0"] - float(r["busy"]) for m in runs for r in m.rows
           if r["kind"] in kinds and r.get("busy") is not None and r["epoch"] >= skip_epochs]
    latency = max(float(np.percentile(lat, 5)) / 2, 0.0) if lat else 0.0002
    source = ",".join(map(str, dirs))
    costs = Costs(coef, latency, source, {k: len(v) for k, v in pts.items()}, float(np.mean(bgs)), cores)
    poll = measured_poll_s(dirs)   # metered on the graph servers' threads (`meter.LoopMeter`): not fitted then
    if poll is not None:
        costs = dataclasses.replace(costs, poll_s=poll)
    costs = dataclasses.replace(costs, **fit_overheads(costs, runs, fit_poll=poll is None))
    return costs, runs[0]


def local_layout(cfg, costs: Costs, *, background: float | None = None, cores: float | None = None) -> Layout:
    """The simulated layout of a local engine run of `cfg` on this machine.

    Every role of a local run is a thread of one Python process, and for tasks of this size the Python around
    the kernels (dispatch, conversions, messages) holds the GIL most of the time: the process runs as on one
    core (`PROCESS_CORES`), whatever the machine has. The machine's other load (`background` runnable threads
    on `cores`) leaves one thread min(1, cores / (background + 1)) of a core; on the process's one core that is
    a background of (background + 1) / cores - 1 (none when the machine has a core to spare)."""
    backend = "inline" if cfg.mode == "cpu-only" else "pool"
    tw = cfg.tensor_workers
    if tw == "aws":
        raise ConfigError("a local layout has no AWS Lambdas: give a pool size")
    workers = autotune_start(cfg) if tw == "auto" else int(tw)
    bg = costs.background if background is None else background
    machine = costs.cores if cores is None else cores
    return Layout("local", cfg.partitions, workers, backend=backend, staleness=cfg.staleness,
                  staleness_mode=StalenessMode(cfg.staleness_mode), sync_warmup=cfg.sync_warmup, cores=PROCESS_CORES,
                  background=max(0.0, (bg + 1.0) / machine - 1.0),
                  task_latency_s=cfg.task_latency_s, net=Network(local_latency_s=costs.local_latency_s),
                  straggler_k=cfg.straggler_k, straggler_min_s=cfg.straggler_min_s)


#: Bounds of the fitted overheads: (name, lower bound or None for the spans' latency floor, upper bound).
OVERHEADS = (("gs_step_s", 0.0, 0.05), ("poll_s", 0.0, 0.002), ("local_latency_s", None, 0.1))


def fit_overheads(costs: Costs, runs: list, iterations: int = 5, fit_poll: bool = True) -> dict:
    """The numbers the spans do not show, fitted so that the simulated calibration runs are as slow as the
    measured ones (name -> value, for `Costs`):

    - gs_step_s: the graph server's CPU per tensor task outside any span. The Python around each task (slicing
      its inputs, building the message, padding and storing the result) holds the GIL, so it is work on the
      process's core, paid at dispatch and at the result; with several graph servers it adds up instead of
      overlapping. Told apart from the rest by runs of two block sizes (more, smaller tasks at about the same
      kernel time).
    - poll_s: one pass of a graph server's loop (poll the channels, walk its intervals, check stragglers),
      which runs every 2 ms while it has tasks in flight (`gs.GraphServerSim.run`): several graph servers
      waiting on one worker take the GIL from it that often. Needs a run with several graph servers (one
      graph server polls only while the worker computes, which hides it). Even then the fit is ill-posed (a pass
      costs little against the tasks of such a run), so where the runs were metered (`meter.LoopMeter`) the
      measured figure is used and not fitted (`fit_poll=False`).
    - local_latency_s: the per-message hand-off latency (a woken thread waiting for a core), which overlaps
      with other threads' work.

    Gauss-Newton on the runs' relative epoch-time errors (finite differences of the simulated epoch times, the
    `OVERHEADS` bounds, the latency at least the spans' floor); a number the runs cannot tell stays 0."""
    from scipy.optimize import lsq_linear

    runs = [runs] if isinstance(runs, Measured) else runs
    targets = np.array([m.epoch_time() for m in runs])
    floor = costs.local_latency_s
    names = ["local_latency_s"]
    if len({m.shape.intervals * m.shape.partitions for m in runs if m.shape.partitions == 1}) > 1:
        names.append("gs_step_s")
    if fit_poll and any(m.shape.partitions > 1 for m in runs) and len({(m.shape.partitions, m.shape.intervals)
                                                          for m in runs}) > len(names):
        names.append("poll_s")
    bounds = {n: (floor if lo is None else lo, hi) for n, lo, hi in OVERHEADS}
    x = {n: bounds[n][0] for n in names}

    def times(v: dict) -> np.ndarray:
        c = dataclasses.replace(costs, **v)
        return np.array([simulate(local_layout(m.cfg, c), c, m.shape, m.stages, max(int(m.cfg.epochs), 3))
                         .epoch_time() for m in runs])

    t = times(x)
    steps = {"local_latency_s": 5e-4, "gs_step_s": 1e-4, "poll_s": 2e-5}
    for _ in range(iterations):
        cols = []
        for n in names:
            d = max(steps[n], 0.3 * x[n])
            cols.append((times({**x, n: x[n] + d}) - t) / d)
        jac = np.column_stack(cols) / targets[:, None]
        lo = [bounds[n][0] - x[n] for n in names]
        hi = [bounds[n][1] - x[n] for n in names]
        step = lsq_linear(jac, (targets - t) / targets, bounds=(lo, hi)).x
        x = {n: x[n] + float(d) for n, d in zip(names, step)}
        t_new = times(x)
        converged = float(np.max(np.abs(t_new - t) / targets)) < 0.005
        t = t_new
        if converged:
            break
    return x
