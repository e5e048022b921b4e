"""The engine's epoch driver and role statistics, shared by the in-memory engine (`pipelines.engine.runner`)
and the Kafka driver (`pipelines.launch`): each keeps only its wiring (threads or processes, consumers).

The driver reads the graph servers' EPOCH and DONE reports. An epoch is complete once every partition reported
it and the parameter server published the weight version it produced; the driver then computes the loss (sum
over count of the partitions' partial sums), evaluates that version, logs the row, tracks the best epoch, tells
the graph servers to stop after it when early stopping fires, and drops the weight versions it no longer needs.
`RoleStats` is what the roles reported at the end (the memory engine fills it from its objects, the Kafka
driver from the roles' FINAL reports); `engine_summary` turns it into the summary both engines write.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from ops import models
from ops.spec import ModelSpec
from pipelines.config import TrainConfig
from pipelines.data.graph import Graph
from pipelines.epochs import NO_EVALUATION, EarlyStopping, Evaluator, device_graph, progress, summary_head
from pipelines.transports.base import Transport
from schemas.tasks import DATA_CHANNELS, Channel, Lifecycle, Message, StageKind, WireDtype


class EpochDriver:
    """Completes epochs from the graph servers' reports (see the module doc).

    transport: where STOP_AFTER goes (control channel of each partition). history / stopper: earlier rows of a
    resumed run (the stopper already replayed them). evaluate=False skips the accuracy pass; a callable
    (params -> row of train/val/test loss and accuracy) replaces it. row_extras(row):
    engine-specific columns appended to each row; on_best(epoch, params): called when an epoch is the best."""

    def __init__(self, cfg: TrainConfig, graph: Graph, transport: Transport, *, log=None, start: int = 0,
                 history: list[dict] | None = None, stopper: EarlyStopping | None = None,
                 evaluate: bool | Callable[[dict], dict] = True,
                 show_progress: bool = False, desc: str = "",
                 row_extras: Callable[[dict], dict] | None = None,
                 on_best: Callable[[int, dict], None] | None = None):
        self.cfg, self.transport, self.log = cfg, transport, log
        self.partitions = cfg.partitions
        if callable(evaluate):
            self.evaluate = evaluate
        elif evaluate:
            evaluator, dg = Evaluator(ModelSpec.for_graph(cfg, graph).build()), device_graph(cfg, graph)
            self.evaluate = lambda params: evaluator.on(dg, params)
        else:
            self.evaluate = None
        self.stopper = stopper or EarlyStopping(cfg.patience)
        self.history = history if history is not None else []
        self.row_extras, self.on_best = row_extras, on_best
        self.start = start
        self.next_epoch = start
        self.stop_at = start - 1 if self.stopper.should_stop else cfg.epochs - 1
        self.epoch_parts: dict[int, list] = {}
        self.done_parts: dict[int, Message] = {}
        self.reports: dict[int, dict] = {}      # partition -> its latest EPOCH/DONE report
        self.spread = 0                         # the largest interval-epoch spread seen
        self.best_params = None
        self.t_epoch = time.perf_counter()
        self.c_epoch = time.process_time()
        self.bar = progress(cfg.epochs - start, show_progress, desc)

    # ------------------------------------------------------------------------------------------- reports
    def observe(self, msg: Message) -> bool:
        """Take an EPOCH or DONE report; False for any other kind (the caller's wiring handles it)."""
        if msg.kind == Lifecycle.DONE:
            self.done_parts[msg.partition] = msg
            self.reports[msg.partition] = msg.meta
            return True
        if msg.kind != Lifecycle.EPOCH:
            return False
        self.epoch_parts.setdefault(msg.epoch, []).append(msg)
        self.reports[msg.partition] = msg.meta
        eps = self._interval_epochs()
        if eps:
            self.spread = max(self.spread, max(eps) - min(eps))
        return True

    def _interval_epochs(self) -> list[int]:
        return [e for m in self.reports.values() for e in m.get("interval_epochs", [])]

    def current_spread(self) -> int:
        """How far the fastest interval is ahead of the slowest, by the latest reports."""
        eps = self._interval_epochs()
        return max(eps) - min(eps) if eps else 0

    @property
    def finished(self) -> bool:
        """Every epoch up to the stop is complete and every graph server said DONE."""
        return self.next_epoch > self.stop_at and len(self.done_parts) >= self.partitions

    @property
    def progress_marker(self) -> tuple:
        """Changes whenever a report arrived (for stall detection)."""
        return len(self.epoch_parts), len(self.done_parts)

    # ------------------------------------------------------------------------------------------- epochs
    def complete(self, versions: dict) -> None:
        """Complete every epoch whose reports and weight version (``versions[epoch + 1]``) are in."""
        while (self.next_epoch <= self.stop_at and len(self.epoch_parts.get(self.next_epoch, [])) == self.partitions
               and (self.next_epoch + 1) in versions):
            self._complete_one(versions)

    def _complete_one(self, versions: dict) -> None:
        e = self.next_epoch
        parts = self.epoch_parts.pop(e)
        loss = sum(m.meta["loss_sum"] for m in parts) / max(sum(m.meta["count"] for m in parts), 1.0)
        params = versions[e + 1]
        now = time.perf_counter()
        accs = self.evaluate(params) if self.evaluate is not None else dict(NO_EVALUATION)
        cpu = time.process_time()
        row = {"epoch": e, "loss": loss, **accs, "epoch_s": now - self.t_epoch, "cpu_s": cpu - self.c_epoch,
               "max_staleness_observed": max(m.meta["max_staleness"] for m in parts),
               "relaunches": sum(m.meta["relaunches"] for m in parts)}
        if self.row_extras is not None:
            row.update(self.row_extras(row))
        self.t_epoch, self.c_epoch = now, cpu
        self.history.append(row)
        if self.log is not None:
            self.log.write(row)
        if self.stopper.update(e, row):
            self.best_params = params
            if self.on_best is not None:
                self.on_best(e, params)
        self.bar.update(1)
        eps = self._interval_epochs()
        self.bar.set_postfix(loss=f"{loss:.4f}", val=f"{row['val_acc']:.3f}",
                             slowest=min(eps) if eps else 0, fastest=max(eps) if eps else 0)
        if self.stopper.should_stop and self.stop_at > e:
            self.stop_at = e
            for p in range(self.partitions):
                self.transport.send(Channel.CONTROL, p, Message(Lifecycle.STOP_AFTER, e, -1, -1, p, -1))
        self.next_epoch += 1
        # Versions the driver no longer needs (it evaluates each once) are dropped.
        for v in [v for v in versions if v <= e]:
            if versions[v] is not self.best_params:
                del versions[v]

    def close(self) -> None:
        self.bar.close()


@dataclasses.dataclass
class RoleStats:
    """What the roles reported by the end of a run.

    graph_servers: each partition's last report (busy_s per stage, max_staleness, relaunches, duplicates);
    interval_epoch_spread: the largest spread the driver saw; pool: the tensor-worker pool statistics (tasks,
    busy_s, injected_failures, injected_delays; summed over pools); workers: tensor workers in all;
    tensor_lane: the busy_s key of the tensor tasks ("tensor_workers", or "graph_server.tensor" when the graph
    servers ran them); param_server_busy_s: WU time; transport: the transport's counters."""

    graph_servers: dict
    interval_epoch_spread: int
    pool: dict
    workers: int
    tensor_lane: str
    param_server_busy_s: float
    transport: dict

    def busy(self) -> dict[str, float]:
        """Busy seconds per role and stage, as the summary's ``busy_s``."""
        busy: dict[str, float] = {}
        for m in self.graph_servers.values():
            for k, v in m.get("busy_s", {}).items():
                busy[f"graph_server.{k}"] = busy.get(f"graph_server.{k}", 0.0) + v
        busy[self.tensor_lane] = self.pool.get("busy_s", 0.0)
        busy["param_server.WU"] = self.param_server_busy_s
        return busy

    def _gs_total(self, key: str) -> int:
        return sum(int(m.get(key, 0)) for m in self.graph_servers.values())


def engine_summary(cfg: TrainConfig, graph: Graph, driver: EpochDriver, stats: RoleStats, meter,
                   seconds: float, head: dict | None = None, after_workers: dict | None = None) -> dict:
    """The summary of an engine run: `summary_head`, the engine's settings, the roles' statistics and the cost.

    head: keys after ``engine`` (the Kafka run's ids); after_workers: keys after ``tensor_workers``."""
    busy = stats.busy()
    gs_busy = sum(v for k, v in busy.items() if k.startswith("graph_server."))
    pool = stats.pool
    summary = summary_head(cfg, graph, "pipelined", driver.history, driver.stopper.best_epoch, seconds,
                           start=driver.start)
    if head:
        summary = {**{k: summary.pop(k) for k in ("status", "dataset", "model", "engine")}, **head, **summary}
    summary.update({
        "partitions": cfg.partitions,
        "intervals": cfg.intervals,
        "staleness": "none" if cfg.staleness is None else cfg.staleness,
        "staleness_mode": cfg.staleness_mode,
        "sync_warmup": cfg.sync_warmup,
        "wu": cfg.wu,
        "tensor_workers": cfg.tensor_workers,
        **(after_workers or {}),
        "max_staleness_observed": max([int(m.get("max_staleness", 0)) for m in stats.graph_servers.values()]
                                      or [0]),
        "max_interval_epoch_spread": stats.interval_epoch_spread,
        "relaunches": stats._gs_total("relaunches"),
        "duplicates_discarded": stats._gs_total("duplicates"),
        "duplicates_skipped": int(pool.get("duplicates_skipped", 0)),  # relaunches the pool had already answered
        "busy_s": busy,
        "utilization": {
            "graph_servers": gs_busy / (seconds * cfg.partitions),
            "tensor_workers": pool.get("busy_s", 0.0) / (seconds * max(stats.workers, 1)),
            "param_server": stats.param_server_busy_s / seconds,
        },
        "tensor_tasks": int(pool.get("tasks", 0)),
        "tensor_concurrency_peak": pool.get("peak_concurrency"),
        "wire": wire_summary(cfg, graph, stats, len(driver.history) - driver.start),
        "injected_failures": int(pool.get("injected_failures", 0)),
        "injected_delays": int(pool.get("injected_delays", 0)),
    })
    return summary


def wire_minimum(model: models.Model, in_dim: int, owned_rows: int, ghost_rows: int,
                 itemsize: int = 4) -> dict | None:
    """Bytes per epoch that must cross each data channel, from the stage shapes: consecutive row-local stages
    fused into one task, no padding rows, stateless workers (a backward task is sent its forward inputs again;
    nothing it can recompute), values of `itemsize` bytes (4: float32; 2: the bfloat16 wire), int32 labels and a bool mask for the loss; no routing or vertex
    ids; ghost rows of the input features are placed once, not per epoch.
    owned_rows: vertices (summed over partitions); ghost_rows: ghost copies (summed). None for models with
    per-edge tensor stages (GAT), whose blocks have no row width."""
    w = models.row_widths(model, in_dim)
    if w is None:
        return None
    prod, need = models.producers(model), models.requires_grad(model)
    st = model.stages
    last = len(st) - 1
    groups = [g for g in models.tensor_groups(model) if st[g[0]].kind == StageKind.AV]
    fused_last = st[last - 1].kind == StageKind.AV
    to_w = from_w = 0  # floats per row to / from the tensor workers
    for g in groups:
        w_in, w_out = w[(prod[g[0]]["h"], "h")], w[(g[-1], "h")]
        if fused_last and g[-1] == last - 1:
            to_w, from_w = to_w + w_in, from_w + w_in      # LAST: h in, dh out (+ labels below)
            continue
        to_w, from_w = to_w + w_in, from_w + w_out         # forward
        to_w += w_in + w_out                               # backward: inputs again and the output gradient
        from_w += w_in if need[prod[g[0]]["h"]] else 0     # the input gradient, where anyone needs it
    if not fused_last:
        w_loss = w[(prod[last]["h"], "h")]
        to_w, from_w = to_w + w_loss, from_w + w_loss
    ghosts = grads = 0
    for s in st:
        if s.kind == StageKind.GA and prod[s.index]["h"] != -1:  # input features never change: no ghosts
            p = prod[s.index]["h"]
            ghosts += w[(p, "h")]
            grads += w[(p, "h")] if need[p] else 0
    b = itemsize
    return {Channel.TENSOR_TASKS.value: b * owned_rows * to_w + 5 * owned_rows,
            Channel.TENSOR_RESULTS.value: b * owned_rows * from_w,
            Channel.GHOSTS.value: b * ghost_rows * ghosts, Channel.GHOST_GRADS.value: b * ghost_rows * grads}


def wire_summary(cfg: TrainConfig, graph: Graph, stats: "RoleStats", epochs: int) -> dict:
    """Bytes per epoch on every channel (what the transport counted, over the epochs run) beside the model's
    minimum on the data channels, and their ratio."""
    reports = stats.graph_servers.values()
    owned = sum(int(m.get("owned_rows", 0)) for m in reports)
    ghost = sum(int(m.get("ghost_rows", 0)) for m in reports)
    model = ModelSpec.for_graph(cfg, graph).build()
    itemsize = WireDtype(cfg.wire_dtype).itemsize
    minimum = wire_minimum(model, graph.features.shape[1], owned, ghost, itemsize) if owned else None
    epochs = max(epochs, 1)
    counted = stats.transport.get("payload_bytes") or stats.transport.get("bytes", {})
    per_epoch = {str(k): v / epochs for k, v in counted.items()}
    out = {"bytes_per_epoch": per_epoch, "counted": "payload_bytes" if "payload_bytes" in stats.transport
           else "bytes", "epochs": epochs, "wire_dtype": str(WireDtype(cfg.wire_dtype)),
           "minimum_bytes_per_epoch": minimum}
    if "payload_bytes" in stats.transport:
        out["wire_bytes_per_epoch"] = {str(k): v / epochs for k, v in stats.transport.get("bytes", {}).items()}
    if minimum:
        data = sum(per_epoch.get(c.value, 0.0) for c in DATA_CHANNELS)
        out["data_bytes_per_epoch"] = data
        out["minimum_data_bytes_per_epoch"] = sum(minimum.values())
        out["ratio_to_minimum"] = data / max(sum(minimum.values()), 1)
    return out


def add_cost(summary: dict, meter, seconds: float, epochs: int, transport: dict, busy: dict) -> None:
    """The cost meter's summary and its headline numbers (time, cost, cost per epoch, value)."""
    summary["cost"] = meter.summary(seconds, epochs, transport, busy)
    summary.update(time_s=seconds, cost_usd=summary["cost"]["cost_usd"],
                   cost_per_epoch_usd=summary["cost"]["cost_per_epoch_usd"], value=summary["cost"]["value"])
