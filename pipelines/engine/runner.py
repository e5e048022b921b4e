"""Runs the separated engine in one process: graph servers, a tensor-worker pool and the parameter server as
threads talking only through a transport; the driver gathers metrics, evaluates and writes the run directory."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import jax
import numpy as np

from ops.optim import make_optimizer
from pipelines import rundir
from pipelines.config import TrainConfig
from pipelines.data.graph import Graph
from pipelines.engine import messages as M
from pipelines.engine.graph_server import GraphServer
from pipelines.engine.messages import EngineError, Message
from pipelines.engine.param_server import ParameterServer, StalenessMode
from pipelines.engine.partition import build_plan
from pipelines.engine.pools import make_tensor_workers
from pipelines.engine.tensor_worker import LocalPool
from pipelines.train import EarlyStopping, Evaluator, TrainResult, build_model, model_inputs, progress


def model_spec(cfg: TrainConfig, graph: Graph) -> dict:
    """The JSON-able description a stateless tensor worker rebuilds the model from."""
    if cfg.model == "gcn":
        return {"name": "gcn", "in_dim": graph.feature_dim, "hidden": [cfg.hidden] * (cfg.layers - 1),
                "num_classes": graph.num_classes, "dropout": cfg.dropout, "order": cfg.order}
    return {"name": "gat", "in_dim": graph.feature_dim, "hidden": cfg.hidden, "num_classes": graph.num_classes,
            "heads": cfg.heads, "out_heads": cfg.out_heads, "layers": cfg.layers, "dropout": cfg.dropout}


@dataclasses.dataclass
class Engine:
    """The roles of one run, wired to one transport."""

    cfg: TrainConfig
    graph: Graph
    plan: object
    transport: object
    ps: ParameterServer
    pool: LocalPool
    servers: list
    threads: list
    versions: dict


@dataclasses.dataclass
class RunContext:
    """What every role derives from (config, graph) alone. Deterministic: the partition plan, the initial weights
    and the optimizer are functions of the config and its seed, so separate processes build the same ones."""

    model: object
    spec: dict
    x: object
    a: object
    plan: object
    params: dict
    tx: object
    param_stages: list
    n_train: int


def run_context(cfg: TrainConfig, graph: Graph) -> RunContext:
    from ops import models

    model = build_model(cfg, graph)
    spec = model_spec(cfg, graph)
    assert models.from_spec(spec).stages == model.stages
    x, a = model_inputs(cfg, graph)
    plan = build_plan(a, cfg.partitions, cfg.intervals, cfg.partitioner, cfg.seed)
    params = model.init(jax.random.PRNGKey(cfg.seed))
    k = cfg.partitions * cfg.intervals
    # Async WU takes one optimizer step per interval: scale the step so an epoch moves as far as one sync step.
    lr = cfg.lr if cfg.wu == "sync" else cfg.lr / k
    tx = make_optimizer(lr, cfg.weight_decay, model.decay_mask(params))
    param_stages = [s.name for s in model.stages if s.has_params]
    return RunContext(model, spec, x, a, plan, params, tx, param_stages, int(graph.train_mask.sum()))


def build_param_server(cfg: TrainConfig, graph: Graph, transport, *, ctx: RunContext | None = None,
                       epochs: int | None = None, on_version=None) -> ParameterServer:
    ctx = ctx or run_context(cfg, graph)
    return ParameterServer(transport, ctx.params, ctx.tx, partitions=cfg.partitions, intervals=cfg.intervals,
                           param_stages=ctx.param_stages, mode=cfg.wu, staleness=cfg.staleness,
                           epochs=cfg.epochs if epochs is None else epochs, on_version=on_version)


def build_graph_server(cfg: TrainConfig, graph: Graph, transport, partition: int, *,
                       ctx: RunContext | None = None, epochs: int | None = None,
                       start_epoch: int = 0) -> GraphServer:
    ctx = ctx or run_context(cfg, graph)
    pp = ctx.plan.partitions[partition]
    return GraphServer(
        transport, pp, ctx.model, ctx.spec, features=ctx.x, labels=graph.labels[pp.owned],
        train_mask=graph.train_mask[pp.owned], num_partitions=cfg.partitions, staleness=cfg.staleness,
        epochs=cfg.epochs if epochs is None else epochs, seed=cfg.seed, loss_scale=1.0 / max(ctx.n_train, 1),
        straggler_k=cfg.straggler_k, straggler_min_s=cfg.straggler_min_s, start_epoch=start_epoch,
        staleness_mode=StalenessMode(cfg.staleness_mode))


def build_tensor_workers(cfg: TrainConfig, graph: Graph, transport, *, ctx: RunContext | None = None):
    return make_tensor_workers(cfg, transport, ctx.spec if ctx is not None else model_spec(cfg, graph))


def build_engine(cfg: TrainConfig, graph: Graph, transport=None, epochs: int | None = None,
                 init_params: dict | None = None, init_opt_state=None) -> Engine:
    from pipelines.transports.memory import MemoryTransport

    transport = transport or MemoryTransport()
    ctx = run_context(cfg, graph)
    versions: dict = {}
    ps = build_param_server(cfg, graph, transport, ctx=ctx, epochs=epochs,
                            on_version=lambda v, w: versions.__setitem__(v, w))
    if init_params is not None or init_opt_state is not None:
        # A warm start (continuous training) continues from earlier weights and optimizer state.
        from pipelines.engine import param_server

        state = param_server.init(ctx.params if init_params is None else init_params, ctx.tx)
        if init_opt_state is not None:
            state = dataclasses.replace(state, opt_state=init_opt_state)
        ps.state = state
    pool = build_tensor_workers(cfg, graph, transport, ctx=ctx)
    servers = [build_graph_server(cfg, graph, transport, p, ctx=ctx, epochs=epochs)
               for p in range(cfg.partitions)]
    return Engine(cfg, graph, ctx.plan, transport, ps, pool, servers, [], versions)


def _start(engine: Engine) -> None:
    engine.pool.start()
    for name, target in [("param-server", engine.ps.run)] + [
            (f"graph-server-{s.p}", s.run) for s in engine.servers]:
        th = threading.Thread(target=target, name=name, daemon=True)
        th.start()
        engine.threads.append(th)


def _shutdown(engine: Engine) -> None:
    for s in engine.servers:
        s.stop()
    engine.ps.stop()
    for th in engine.threads:
        th.join(timeout=10)
    engine.pool.stop()


def _raise_role_errors(engine: Engine) -> None:
    for role in [engine.ps, engine.pool, *engine.servers]:
        if role.error is not None:
            raise role.error


def train_engine(cfg: TrainConfig, graph: Graph, out: Path | None = None, show_progress: bool = False,
                 transport=None, stall_timeout: float = 300.0, evaluate: bool = True,
                 init_params: dict | None = None, init_opt_state=None) -> TrainResult:
    """Train with the separated, pipelined engine; same outputs as `pipelines.train.train` plus engine stats.

    evaluate=False skips the driver's per-epoch accuracy pass (benchmarks time the pipeline alone).
    init_params / init_opt_state (optional) warm-start from earlier weights and optimizer state."""
    from pipelines.engine.cost import CostMeter, load_prices

    prices = load_prices(cfg.prices)
    engine = build_engine(cfg, graph, transport, init_params=init_params, init_opt_state=init_opt_state)
    meter = CostMeter(cfg, prices, engine.pool)
    model = build_model(cfg, graph)
    x, a = model_inputs(cfg, graph)
    from ops.sparse import Adjacency
    import jax.numpy as jnp

    adj = Adjacency.from_scipy(a).to_device()
    xj = jnp.asarray(x)
    labels = jnp.asarray(graph.labels)
    masks = tuple(jnp.asarray(m) for m in (graph.train_mask, graph.val_mask, graph.test_mask))
    evaluator = Evaluator(model)
    metrics = engine.transport.consumer([(M.METRICS, 0)], group="driver")
    log = rundir.MetricsLog(out / "metrics.jsonl") if out is not None else None
    stopper = EarlyStopping(cfg.patience)
    history: list[dict] = []
    epoch_parts: dict[int, list] = {}
    done_parts: dict[int, Message] = {}
    best_params = None
    last_part_stats: dict[int, dict] = {}
    spread = 0
    t_start = time.perf_counter()
    t_epoch = t_start
    next_epoch = 0
    stop_at = cfg.epochs - 1
    bar = progress(cfg.epochs, show_progress, f"{graph.name} {cfg.model} P={cfg.partitions}x{cfg.intervals}")
    from pipelines.engine.spans import SpanLog

    spans = SpanLog()  # the timeline `dorylus report` draws: one clock origin for every role
    engine.ps.spans = spans
    for s in engine.servers:
        s.spans = spans
    _start(engine)
    last_progress = time.monotonic()
    try:
        while len(done_parts) < cfg.partitions or next_epoch <= stop_at:
            _raise_role_errors(engine)
            if time.monotonic() - last_progress > stall_timeout:
                raise EngineError(f"no progress for {stall_timeout:.0f}s (epoch {next_epoch})")
            for msg in metrics.poll(0.05):
                last_progress = time.monotonic()
                if msg.kind == "FAILED":
                    _raise_role_errors(engine)
                    raise EngineError(f"graph server {msg.partition} failed: {msg.meta['error']}")
                if msg.kind == "DONE":
                    done_parts[msg.partition] = msg
                    last_part_stats[msg.partition] = msg.meta
                    continue
                epoch_parts.setdefault(msg.epoch, []).append(msg)
                last_part_stats[msg.partition] = msg.meta
                eps = [e for m in last_part_stats.values() for e in m.get("interval_epochs", [])]
                if eps:
                    spread = max(spread, max(eps) - min(eps))
            # An epoch's row is complete once every partition reported it and its weight update is published.
            while (next_epoch <= stop_at and len(epoch_parts.get(next_epoch, [])) == cfg.partitions
                   and (next_epoch + 1) in engine.versions):
                parts = epoch_parts.pop(next_epoch)
                loss = sum(m.meta["loss_sum"] for m in parts) / max(sum(m.meta["count"] for m in parts), 1.0)
                params = engine.versions[next_epoch + 1]
                now = time.perf_counter()
                accs = evaluator(params, adj, xj, labels, masks) if evaluate else {
                    "train_acc": None, "val_acc": 0.0, "val_loss": 0.0, "test_acc": None}
                row = {"epoch": next_epoch, "loss": loss, **accs,
                       "epoch_s": now - t_epoch,
                       "max_staleness_observed": max(m.meta["max_staleness"] for m in parts),
                       "relaunches": sum(m.meta["relaunches"] for m in parts)}
                eps = [e for m in last_part_stats.values() for e in m.get("interval_epochs", [])]
                row["interval_epoch_spread"] = max(eps) - min(eps) if eps else 0
                t_epoch = now
                row.update(meter.epoch(row["epoch_s"]))
                history.append(row)
                if log:
                    log.write(row)
                if stopper.update(next_epoch, row):
                    best_params = params
                bar.update(1)
                eps = [e for m in last_part_stats.values() for e in m.get("interval_epochs", [])]
                bar.set_postfix(loss=f"{loss:.4f}", val=f"{row['val_acc']:.3f}",
                                slowest=min(eps) if eps else 0, fastest=max(eps) if eps else 0)
                if stopper.should_stop and stop_at > next_epoch:
                    stop_at = next_epoch
                    for p in range(cfg.partitions):
                        engine.transport.send(M.CONTROL, p, Message("STOP_AFTER", next_epoch, -1, -1, p, -1))
                next_epoch += 1
                # Versions the driver no longer needs (it evaluates each once) are dropped.
                for v in [v for v in engine.versions if v <= next_epoch - 1]:
                    if engine.versions[v] is not best_params:
                        del engine.versions[v]
        _raise_role_errors(engine)
    finally:
        bar.close()
        if log:
            log.close()
        _shutdown(engine)
        metrics.close()
    seconds = time.perf_counter() - t_start
    final = engine.ps.state.params
    best = history[stopper.best_epoch]
    busy = {}
    for m in last_part_stats.values():
        for k, v in m.get("busy_s", {}).items():
            busy[f"graph_server.{k}"] = busy.get(f"graph_server.{k}", 0.0) + v
    pool_stats = engine.pool.stats()
    busy["graph_server.tensor" if pool_stats.get("billing") == "server" else "tensor_workers"] = pool_stats["busy_s"]
    busy["param_server.WU"] = engine.ps.busy_s
    gs_busy = sum(v for k, v in busy.items() if k.startswith("graph_server."))
    epoch_times = [r["epoch_s"] for r in history[1:]] or [history[0]["epoch_s"]]
    summary = {
        "status": "complete",
        "dataset": graph.summary(),
        "model": cfg.model,
        "engine": "pipelined",
        "epochs": len(history),
        "best_epoch": stopper.best_epoch,
        "best_val_acc": best["val_acc"],
        "test_acc": best["test_acc"],
        "train_acc": best["train_acc"],
        "final_loss": history[-1]["loss"],
        "seconds": seconds,
        "epoch_s_median": float(np.median(epoch_times)),
        "seed": cfg.seed,
        "partitions": cfg.partitions,
        "intervals": cfg.intervals,
        "staleness": "none" if cfg.staleness is None else cfg.staleness,
        "staleness_mode": cfg.staleness_mode,
        "wu": cfg.wu,
        "tensor_workers": cfg.tensor_workers,
        "max_staleness_observed": max(int(m.get("max_staleness", 0)) for m in last_part_stats.values()),
        "max_interval_epoch_spread": spread,
        "relaunches": sum(int(m.get("relaunches", 0)) for m in last_part_stats.values()),
        "duplicates_discarded": sum(int(m.get("duplicates", 0)) for m in last_part_stats.values()),
        "busy_s": busy,
        "utilization": {
            "graph_servers": gs_busy / (seconds * cfg.partitions),
            "tensor_workers": pool_stats["busy_s"] / (seconds * max(pool_stats.get("workers", 1), 1)),
            "param_server": engine.ps.busy_s / seconds,
        },
        "tensor_tasks": pool_stats["tasks"],
        "injected_failures": pool_stats["injected_failures"],
        "injected_delays": pool_stats["injected_delays"],
        "partition_stats": engine.plan.stats,
        "transport": engine.transport.stats(),
    }
    summary["tensor_pool"] = {k: v for k, v in pool_stats.items() if k != "autotune"}
    if "autotune" in pool_stats:
        summary["autotune"] = pool_stats["autotune"]
    summary["cost"] = meter.summary(seconds, len(history), summary["transport"], busy)
    summary.update(time_s=seconds, cost_usd=summary["cost"]["cost_usd"],
                   cost_per_epoch_usd=summary["cost"]["cost_per_epoch_usd"], value=summary["cost"]["value"])
    summary["timeline"] = spans.stats()
    if out is not None:
        from pipelines.train import _tree_to_npz

        summary["timeline"]["file"] = "timeline.jsonl"
        spans.write(out / "timeline.jsonl")
        rundir.atomic_write_npz(out / "weights.npz", _tree_to_npz(best_params))
        rundir.atomic_write_json(out / "summary.json", summary)
    return TrainResult(final, best_params, history, summary, engine.ps.state.opt_state)
