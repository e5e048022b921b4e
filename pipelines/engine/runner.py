"""Runs the separated engine in one process: graph servers, a tensor-worker pool and the parameter server as
threads talking only through a transport. This module is the wiring (the run context every role derives from,
the role builders, the tensor-worker factory, threads); the epochs are `pipelines.engine.driver.EpochDriver`'s,
which the Kafka driver (`pipelines.launch`) shares."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import jax

from ops import models, xla
from ops.optim import make_optimizer
from ops.sparse import Partitioned
from ops.spec import ModelSpec
from pipelines import rundir
from pipelines.config import TrainConfig
from pipelines.data.graph import Graph
from pipelines.engine import param_server
from pipelines.engine.aws_lambda import AwsLambdaPool
from pipelines.engine.cost import CostMeter, load_prices
from pipelines.engine.driver import EpochDriver, RoleStats, add_cost, engine_summary
from pipelines.engine.graph_server import GraphServer
from pipelines.engine.messages import EngineError
from pipelines.engine.param_server import ParameterServer
from pipelines.engine.partition import build_plan, layout_for
from pipelines.engine.pools import InlinePool, QueuedPool, autotuned_pool
from pipelines.engine.spans import SpanLog
from pipelines.engine.tensor_worker import TensorWorker
from pipelines.epochs import DeviceGraph, Evaluator, TrainResult, model_inputs, write_result
from pipelines.transports.memory import MemoryTransport
from pipelines.transports.wire import with_wire_dtype
from schemas.tasks import Channel, Lifecycle


@dataclasses.dataclass
class Engine:
    """The roles of one run, wired to one transport."""

    cfg: TrainConfig
    graph: Graph
    plan: object
    transport: object
    ps: ParameterServer
    pool: TensorWorker
    servers: list
    threads: list
    versions: dict
    x: object = None   # the normalized features the graph servers read their rows from (`RunContext.x`)


@dataclasses.dataclass
class RunContext:
    """What every role derives from (config, graph) alone. Deterministic: the partition plan, the initial weights
    and the optimizer are functions of the config and its seed, so separate processes build the same ones."""

    model: object
    spec: ModelSpec
    x: object      # the normalized features the graph servers copy their rows from (the adjacency is in `plan`)
    plan: object
    params: dict
    tx: object
    param_stages: list
    n_train: int


def run_context(cfg: TrainConfig, graph: Graph, bucket: float | None = None) -> RunContext:
    """The deterministic pieces every role of a run builds from (cfg, graph); bucket: `build_plan`'s."""
    spec = ModelSpec.for_graph(cfg, graph)
    model = spec.build()
    x, a = model_inputs(cfg, graph)
    plan = build_plan(a, cfg.partitions, cfg.intervals, cfg.partitioner, cfg.seed, bucket=bucket,
                      **layout_for(model.stages))
    params = model.init(jax.random.PRNGKey(cfg.seed))
    tx = make_optimizer(cfg.lr, cfg.weight_decay, model.decay_mask(params))
    param_stages = [s.name for s in model.stages if s.has_params]
    del a  # the plan holds its blocks: the normalized adjacency is not kept beside them
    return RunContext(model, spec, x, plan, params, tx, param_stages, int(graph.train_mask.sum()))


def build_param_server(cfg: TrainConfig, graph: Graph, transport, *, ctx: RunContext | None = None,
                       epochs: int | None = None, on_version=None) -> ParameterServer:
    """The parameter server of a run. ctx: the run context (default: built from cfg and graph); epochs: how many
    it serves (default cfg.epochs); on_version(v, weights): called with every published weight version."""
    ctx = ctx or run_context(cfg, graph)
    return ParameterServer(transport, ctx.params, ctx.tx, partitions=cfg.partitions, intervals=cfg.intervals,
                           param_stages=ctx.param_stages, mode=cfg.wu, staleness=cfg.staleness,
                           epochs=cfg.epochs if epochs is None else epochs, on_version=on_version)


def build_graph_server(cfg: TrainConfig, graph: Graph, transport, partition: int, *,
                       ctx: RunContext | None = None, epochs: int | None = None,
                       start_epoch: int = 0) -> GraphServer:
    """The graph server of `partition`. ctx / epochs as in `build_param_server`; start_epoch: where a resumed
    run starts (it counts as epoch 0 for staleness)."""
    ctx = ctx or run_context(cfg, graph)
    pp = ctx.plan.partitions[partition]
    return GraphServer(
        transport, pp, ctx.model, ctx.spec.to_json(), features=ctx.x, labels=graph.labels[pp.owned],
        train_mask=graph.train_mask[pp.owned], num_partitions=cfg.partitions, staleness=cfg.staleness,
        epochs=cfg.epochs if epochs is None else epochs, seed=cfg.seed, loss_scale=1.0 / max(ctx.n_train, 1),
        straggler_k=cfg.straggler_k, straggler_min_s=cfg.straggler_min_s, start_epoch=start_epoch,
        staleness_mode=cfg.staleness_mode, sync_warmup=cfg.sync_warmup)


def make_tensor_workers(cfg: TrainConfig, transport, model_spec: dict) -> TensorWorker:
    """The tensor-worker backend a config asks for: cfg.mode cpu-only (an inline pool per graph server), else
    cfg.tensor_workers "aws" (AWS Lambda), "auto" (an autotuned local pool) or N (a local pool of N threads,
    `QueuedPool`);
    model_spec: the `ops.spec.ModelSpec` JSON the workers rebuild the model from."""
    faults = dict(fail_rate=cfg.fail_rate, delay_rate=cfg.delay_rate, delay_s=cfg.delay_s, seed=cfg.seed,
                  task_latency_s=cfg.task_latency_s, residual_cache_mb=cfg.residual_cache_mb)
    mode = getattr(cfg, "mode", "serverless")
    tw = cfg.tensor_workers
    if mode == "cpu-only":
        return InlinePool(transport, model_spec, cfg.partitions, **faults)
    if tw == "aws":
        return AwsLambdaPool.from_config(cfg, transport, model_spec)
    if tw == "auto":
        return autotuned_pool(cfg, transport, model_spec, **faults)
    return QueuedPool(transport, model_spec, int(tw), **faults)  # fixed size: the most urgent task first


def build_tensor_workers(cfg: TrainConfig, graph: Graph, transport, *,
                         ctx: RunContext | None = None) -> TensorWorker:
    """The tensor-worker pool cfg names (local, autotuned, inline or AWS Lambda), wired to `transport`."""
    spec = ctx.spec if ctx is not None else ModelSpec.for_graph(cfg, graph)
    return make_tensor_workers(cfg, transport, spec.to_json())


def build_engine(cfg: TrainConfig, graph: Graph, transport=None, epochs: int | None = None,
                 init_params: dict | None = None, init_opt_state=None, bucket: float | None = None) -> Engine:
    """Every role of an in-process run on one transport (default: a new MemoryTransport), not yet started.

    epochs: how many the roles run (default cfg.epochs); init_params / init_opt_state: a warm start; bucket:
    the plan's shape buckets (`build_plan`)."""
    transport = with_wire_dtype(transport or MemoryTransport(), cfg.wire_dtype)
    ctx = run_context(cfg, graph, bucket=bucket)
    versions: dict = {}
    ps = build_param_server(cfg, graph, transport, ctx=ctx, epochs=epochs,
                            on_version=lambda v, w: versions.__setitem__(v, w))
    if init_params is not None or init_opt_state is not None:
        # A warm start (continuous training) continues from earlier weights and optimizer state.
        state = param_server.init(ctx.params if init_params is None else init_params, ctx.tx)
        if init_opt_state is not None:
            # as device arrays, as the optimizer's init makes them: the parameter server updates eagerly, and
            # host-array leaves (a checkpoint's, a stream's) compiled its scalar ops once more
            state = dataclasses.replace(state, opt_state=jax.tree_util.tree_map(jax.numpy.asarray, init_opt_state))
        ps.state = state
    pool = build_tensor_workers(cfg, graph, transport, ctx=ctx)
    servers = [build_graph_server(cfg, graph, transport, p, ctx=ctx, epochs=epochs)
               for p in range(cfg.partitions)]
    return Engine(cfg, graph, ctx.plan, transport, ps, pool, servers, [], versions, ctx.x)


def plan_evaluator(engine: Engine):
    """The driver's evaluation (params -> row) over the graph servers' whole-partition blocks
    (`ops.sparse.Partitioned`), or None when a gather of the model runs per interval (GAT) or the plan has no
    whole blocks. The same values as `pipelines.epochs.device_graph`'s up to summation order, without the
    second copy of Â (its own normalization, vertex order and device arrays): at R-MAT 2^20 and P=4 that copy
    and its permuted features were 0.26 GB of a 2.4 GB peak. Staged (`Evaluator(staged=True)`)."""
    model = ModelSpec.for_graph(engine.cfg, engine.graph).build()
    if models.needs_interval_blocks(model.stages) or any(s.whole_dev is None for s in engine.servers):
        return None
    graph = engine.graph
    adj = Partitioned.from_blocks([s.whole_dev for s in engine.servers], graph.num_nodes)
    masks = tuple(jax.numpy.asarray(m) for m in (graph.train_mask, graph.val_mask, graph.test_mask))
    dg = DeviceGraph(adj, models.constant_prefix(model, adj, xla.to_device(engine.x)),
                     jax.numpy.asarray(graph.labels), masks)
    evaluator = Evaluator(model, staged=True)
    return lambda params: evaluator.on(dg, params)


def _start(engine: Engine) -> None:
    engine.pool.start()
    for name, target in [("param-server", engine.ps.run)] + [
            (f"graph-server-{s.partition}", s.run) for s in engine.servers]:
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
                 transport=None, stall_timeout: float = 300.0, evaluate=True,
                 init_params: dict | None = None, init_opt_state=None, bucket: float | None = None) -> TrainResult:
    """Train with the separated, pipelined engine; same outputs as `pipelines.train.train` plus engine stats.

    cfg / graph: the run's settings and graph; out: the run directory (metrics.jsonl, timeline.jsonl,
    weights.npz, summary.json; None writes nothing); show_progress: a tqdm bar; transport: the channels
    (default: a fresh MemoryTransport); stall_timeout: seconds without any report before the run fails;
    evaluate=True evaluates every epoch over the graph servers' blocks (`plan_evaluator`; GAT: the driver's own
    device graph), evaluate=False skips the pass (benchmarks time the pipeline alone), a callable
    (params -> evaluation row) replaces it (continuous training evaluates on its own bucketed device graph);
    init_params / init_opt_state (optional) warm-start from earlier weights and optimizer state; bucket: the
    plan's shape buckets (`build_plan`)."""
    prices = load_prices(cfg.prices)
    engine = build_engine(cfg, graph, transport, init_params=init_params, init_opt_state=init_opt_state,
                          bucket=bucket)
    meter = CostMeter(cfg, prices, engine.pool)
    metrics = engine.transport.consumer([(Channel.METRICS, 0)], group="driver")
    log = rundir.MetricsLog(out / "metrics.jsonl") if out is not None else None
    if evaluate is True:
        evaluate = plan_evaluator(engine) or True
    driver = EpochDriver(cfg, graph, engine.transport, log=log, evaluate=evaluate, show_progress=show_progress,
                         desc=f"{graph.name} {cfg.model} P={cfg.partitions}x{cfg.intervals}")
    driver.row_extras = lambda row: {"interval_epoch_spread": driver.current_spread(),
                                     **meter.epoch(row["epoch_s"])}
    t_start = time.perf_counter()
    spans = SpanLog()  # the timeline `dorylus report` draws: one clock origin for every role
    engine.ps.spans = spans
    for s in engine.servers:
        s.spans = spans
    _start(engine)
    try:
        _drive(engine, driver, metrics, stall_timeout)
    finally:
        driver.close()
        if log:
            log.close()
        _shutdown(engine)
        metrics.close()
    seconds = time.perf_counter() - t_start
    summary = _summary(engine, driver, meter, seconds)
    summary["timeline"] = spans.stats()
    if out is not None:
        summary["timeline"]["file"] = "timeline.jsonl"
        spans.write(out / "timeline.jsonl")
    write_result(out, driver.best_params, summary)
    return TrainResult(engine.ps.state.params, driver.best_params, driver.history, summary,
                       engine.ps.state.opt_state)


def _drive(engine: Engine, driver: EpochDriver, metrics, stall_timeout: float) -> None:
    """The driver's loop: read the graph servers' reports until every epoch is complete and every one is DONE."""
    last_progress = time.monotonic()
    while not driver.finished:
        _raise_role_errors(engine)
        if time.monotonic() - last_progress > stall_timeout:
            raise EngineError(f"no progress for {stall_timeout:.0f}s (epoch {driver.next_epoch})")
        for msg in metrics.poll(0.05):
            last_progress = time.monotonic()
            if msg.kind == Lifecycle.FAILED:
                _raise_role_errors(engine)
                raise EngineError(f"graph server {msg.partition} failed: {msg.meta['error']}")
            if not driver.observe(msg):
                raise EngineError(f"driver got an unexpected {msg.kind} metrics message")
        driver.complete(engine.versions)
    _raise_role_errors(engine)


def role_stats(engine: Engine, driver: EpochDriver) -> RoleStats:
    """The in-process roles' statistics, read from their objects."""
    pool = engine.pool.stats()
    return RoleStats(graph_servers=driver.reports, interval_epoch_spread=driver.spread, pool=pool,
                     workers=pool.get("workers", 1),
                     tensor_lane="graph_server.tensor" if pool.get("billing") == "server" else "tensor_workers",
                     param_server_busy_s=engine.ps.busy_s, transport=engine.transport.stats())


def _summary(engine: Engine, driver: EpochDriver, meter, seconds: float) -> dict:
    cfg = engine.cfg
    stats = role_stats(engine, driver)
    summary = engine_summary(cfg, engine.graph, driver, stats, meter, seconds)
    summary["partition_stats"] = engine.plan.stats
    summary["transport"] = stats.transport
    summary["tensor_pool"] = {k: v for k, v in stats.pool.items() if k != "autotune"}
    if "autotune" in stats.pool:
        summary["autotune"] = stats.pool["autotune"]
    add_cost(summary, meter, seconds, len(driver.history), stats.transport, summary["busy_s"])
    return summary
