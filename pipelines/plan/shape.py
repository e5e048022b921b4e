"""The plan's view of a workload: the model's stages and schedule, the partition plan's sizes, work and bytes.

Everything the simulator needs about a (graph, model, partitions, intervals) and nothing else: the padded block
sizes every task of the plan runs on (the engine pads each interval to the plan-wide rows, columns and nonzeros,
so all tasks of one stage cost the same), the ghost rows each graph server sends every other one, and per task
kind and stage a work measure (what its time scales with) and the bytes of its task and result messages.
A shape comes from a real partition plan (a dataset or prepared graph) or is estimated from sizes alone.
"""
from __future__ import annotations

import dataclasses
import math
import types

from ops import models
from ops.spec import ModelSpec
from pipelines.config import TrainConfig
from schemas.tasks import Step, TaskKind as Task  # the engine's own vocabulary


#: Task kinds a graph server runs on its own thread; the others go to the tensor workers.
GRAPH_SERVER_TASKS = (Task.GA, Task.GA_BWD, Task.SC, Task.SC_BWD)
TENSOR_TASKS = (Task.AV, Task.AE, Task.LAST, Task.LOSS, Task.AV_BWD, Task.AE_BWD)
#: Dense task kinds (matrix products): they can use several cores of a machine; sparse ones run on one thread.
DENSE_TASKS = (Task.AV, Task.AV_BWD, Task.LAST, Task.LOSS, Task.AE, Task.AE_BWD, Task.WU)

F32 = 4


def build_stages(model: str, features: int, classes: int, *, hidden: int | None = None, layers: int = 2,
                 heads: int | None = None, out_heads: int | None = None, order: str = "auto"):
    """The model the config names, built from its `ops.spec.ModelSpec` (so the plan runs the engine's stage list)."""
    cfg = TrainConfig(model=model, hidden=hidden, layers=layers, heads=heads, out_heads=out_heads,
                      order=order).resolved()
    return ModelSpec.from_config(cfg, features, classes).build()


def _model(stages):
    return types.SimpleNamespace(stages=stages)


def group_of(stages) -> dict[int, tuple[int, ...]]:
    """First stage -> the stages one engine task runs (consecutive row-local AV stages fuse into one)."""
    return {g[0]: g for g in models.tensor_groups(_model(stages))}


def schedule(stages) -> list[tuple[Step, int]]:
    """One epoch of an interval, as the engine's graph server walks it (`ops.models.epoch_schedule`)."""
    return models.epoch_schedule(_model(stages))


def step_task(stages, step: Step, s: int) -> Task | None:
    """The task kind a step runs (None: a backward step with nothing to compute, which the engine skips)."""
    st = stages[s]
    if step in (Step.LAST, Step.LOSS):
        return Task(step.value)
    if step == Step.FORWARD:
        return Task(st.kind)
    if not wrt_inputs(stages, s) and not any(stages[k].has_params for k in group_of(stages)[s]):
        return None
    return Task(f"{st.kind}_BWD")


def wrt_inputs(stages, s: int) -> list[str]:
    """The inputs of stage s whose gradient someone needs (the engine's `wrt`)."""
    producers = models.producers(_model(stages))
    need = models.requires_grad(_model(stages))
    return [n for n in models.reads(stages[s]) if producers[s][n] != -1 and need[producers[s][n]]]


def widths(stages, features: int) -> dict[int, dict[str, int]]:
    """Per stage, the row width (floats) of every tensor it reads and writes."""
    cur = {"h": features}
    out = {}
    for st in stages:
        w = dict(cur)
        if st.kind == "AV":
            h = max(st.heads, 1)
            cur = {**cur, "h": st.out_dim * h}
            if st.heads:
                cur.update(s_src=h, s_dst=h)
        elif st.kind == "AE":
            cur = {**cur, "alpha": max(st.heads, 1)}
        elif st.kind == "GA" and st.heads and not st.concat_heads:
            cur = {**cur, "h": cur["h"] // st.heads}
        w["out"] = cur
        out[st.index] = w
    return out


@dataclasses.dataclass
class Shape:
    """Sizes of one partition plan: P graph servers of K intervals, every block padded to (rows, cols, nnz)."""

    vertices: int
    edges: int                  # adjacency nonzeros without self-loops (directed count)
    features: int
    classes: int
    partitions: int
    intervals: int
    rows_pad: int
    cols_pad: int
    nnz_pad: int
    send: list                  # p -> {q: rows p sends q (forward SC)}
    owned: list                 # p -> owned vertices
    source: str = "plan"        # "plan" (a real partition plan) or "estimate" (from sizes)

    @property
    def ghosts(self) -> list[int]:
        return [sum(self.send[q].get(p, 0) for q in range(self.partitions)) for p in range(self.partitions)]

    def recv(self, p: int) -> dict[int, int]:
        return {q: self.send[q][p] for q in range(self.partitions) if p in self.send[q]}

    def to_json(self) -> dict:
        return {"vertices": self.vertices, "edges": self.edges, "features": self.features, "classes": self.classes,
                "partitions": self.partitions, "intervals": self.intervals, "rows_pad": self.rows_pad,
                "cols_pad": self.cols_pad, "nnz_pad": self.nnz_pad, "ghosts": self.ghosts, "source": self.source}


def from_plan(plan, vertices: int, edges: int, features: int, classes: int) -> Shape:
    """The shape of a real partition plan (`pipelines.engine.partition.build_plan`)."""
    send = [{int(q): int(idx.size) for q, idx in pp.send.items()} for pp in plan.partitions]
    return Shape(vertices, edges, features, classes, len(plan.partitions), len(plan.partitions[0].intervals),
                 plan.rows_pad, plan.cols_pad, plan.nnz_pad, send, [pp.num_owned for pp in plan.partitions])


def estimate(vertices: int, edges: int, features: int, classes: int, partitions: int, intervals: int, *,
             cut_fraction: float | None = None, imbalance: float = 1.05) -> Shape:
    """A shape from sizes alone. Edges fall uniformly on vertices (no degree skew), a fraction `cut_fraction`
    of each partition's edges crosses to others (default: METIS-like 0.35 for P > 1), and the padded block
    sizes are the mean ones times `imbalance`. These are assumptions, not measurements: see docs/plan.md."""
    n, m, P, K = vertices, edges, partitions, intervals
    cut = (0.35 if P > 1 else 0.0) if cut_fraction is None else cut_fraction
    own = math.ceil(n / P)
    rows = math.ceil(own / K * imbalance)
    nnz = math.ceil((m + n) / (P * K) * imbalance)
    # Distinct columns of an interval: its rows (self-loops) plus the distinct neighbours its edges hit.
    cols = min(n, math.ceil(rows + n * (1 - math.exp(-(nnz - rows) / max(n, 1)))))
    send = [{} for _ in range(P)]
    if P > 1:
        others = n - own
        cut_edges = m / P * cut
        ghosts = others * (1 - math.exp(-cut_edges / max(others, 1)))
        per = max(1, round(ghosts / (P - 1)))
        for p in range(P):
            send[p] = {q: per for q in range(P) if q != p}
    return Shape(n, m, features, classes, P, K, rows, cols, nnz, send, [own] * P, source="estimate")


@dataclasses.dataclass(frozen=True)
class TaskSize:
    """What one task of a (kind, stage) costs in work units and moves in bytes.

    Its time is modelled as a x base + b x wide (per kind a and b, calibrated): `base` is the size of the
    structure the task walks (nonzeros for GA and AE, rows for AV and the loss, rows copied for SC), `wide` that
    size times the width of the values it moves or multiplies (multiply-adds for AV)."""

    base: float
    wide: float
    bytes_in: int     # task message (graph server -> worker)
    bytes_out: int    # result message (worker -> graph server), or SC rows sent


def task_size(stages, shape: Shape, kind: Task, s: int, p: int = 0) -> TaskSize:
    """Work units and message bytes of one task of stage s on graph server p."""
    st = stages[s]
    w = widths(stages, shape.features)[s]
    R, C, Z = shape.rows_pad, shape.cols_pad, shape.nnz_pad
    block = Z * (4 + 4 + 4) + (R + 1) * 4 + R * 8 + C * 8     # data, indices, row_ids, indptr, row/col gids
    if kind in (Task.GA, Task.GA_BWD):
        if models.runs_whole(st):  # once per epoch over the partition's block: its intervals' entries and rows
            K = shape.intervals
            return TaskSize(K * Z, K * Z * w["h"], C * w["h"] * F32, K * R * w["out"]["h"] * F32)
        return TaskSize(Z, Z * w["h"], C * w["h"] * F32, R * w["out"]["h"] * F32)
    if kind in (Task.SC, Task.SC_BWD):
        width = w["out"].get("h", 1)
        sent = sum(shape.send[p].values()) if kind == Task.SC else sum(shape.recv(p).values())
        rows = sent if kind == Task.SC else shape.intervals * C + sent
        return TaskSize(rows, rows * width, 0, sent * (width * F32 + 8))
    if kind == Task.WU:
        n = sum(_params(x) for x in stages)
        return TaskSize(1, n, n * F32, n * F32)
    gids = R * 8
    heads = max(st.heads, 1)
    if kind in (Task.AV, Task.AV_BWD):
        out = w["out"]["h"] + (2 * heads if st.heads else 0)
        mults = 3 if kind == Task.AV_BWD else 1
        b_in = R * (w["h"] + (out if kind == Task.AV_BWD else 0)) * F32 + gids
        b_out = R * (w["h"] if kind == Task.AV_BWD else out) * F32
        return TaskSize(R, mults * R * w["h"] * w["out"]["h"], b_in, b_out)
    if kind in (Task.LAST, Task.LOSS):
        dense = 3 * R * w["h"] * w["out"]["h"] if kind == Task.LAST else R * shape.classes
        return TaskSize(R, dense, R * w["h"] * F32 + gids + R * 5, R * w["h"] * F32)
    if kind == Task.AE:
        return TaskSize(Z, Z * heads, (C + R) * heads * F32 + block, Z * heads * F32)
    if kind == Task.AE_BWD:
        return TaskSize(Z, 3 * Z * heads, (C + R) * heads * F32 + block + Z * heads * F32, (C + R) * heads * F32)
    raise ValueError(f"no size for task kind {kind}")


def _params(st) -> int:
    if not st.has_params:
        return 0
    n = 0
    if st.kind == "AV":
        h = max(st.heads, 1)
        n += st.in_dim * st.out_dim * h + (2 * h * st.out_dim if st.heads else 0) + (st.out_dim * h if st.b_out else 0)
    if st.b_in:
        n += st.in_dim
    return n
