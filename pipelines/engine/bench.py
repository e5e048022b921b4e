"""Benchmark helpers: timed epochs of the whole-graph trainer and of the pipelined engine, for bench/."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from pipelines.config import TrainConfig
from pipelines.data.graph import Graph


def whole_graph_epochs(graph: Graph, cfg: TrainConfig, epochs: int) -> dict:
    """The whole-graph trainer's jitted step: one compiling epoch (`jit_s`), then `epochs` timed epochs, each
    with wall (`times`) and process CPU seconds (`cpu`); `graph_bytes` = the device adjacency, `array_bytes` = it
    + the features, `adjacency_build_s` = normalizing the features and building the device graph."""
    import jax
    import jax.numpy as jnp

    from ops.optim import dropout_seeds, make_optimizer
    from pipelines.data.graph import release_free_memory
    from pipelines.epochs import device_graph
    from pipelines.train import build_model, make_train_step

    model = build_model(cfg, graph)
    t0 = time.perf_counter()
    g = device_graph(cfg, graph)
    build_s = time.perf_counter() - t0
    adj, xj, labels, mask = g.adj, g.train_input, g.labels, g.masks[0]
    nnz = adj.nnz
    graph_bytes = adj.nbytes
    array_bytes = graph_bytes + int(xj.nbytes)
    del g
    params = model.init(jax.random.PRNGKey(cfg.seed))
    tx = make_optimizer(cfg.lr, cfg.weight_decay, model.decay_mask(params))
    opt_state = tx.init(params)
    step = make_train_step(model, tx)
    seeds = [jnp.asarray(dropout_seeds(cfg.seed, e, len(model.stages))) for e in range(epochs + 1)]
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, adj, xj, labels, mask, seeds[0])
    loss.block_until_ready()
    jit_s = time.perf_counter() - t0
    release_free_memory()   # as the trainer does after its compiling epoch
    times, cpu = [], []
    for e in range(1, epochs + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        params, opt_state, loss = step(params, opt_state, adj, xj, labels, mask, seeds[e])
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"times": times, "cpu": cpu, "jit_s": jit_s, "final_loss": float(loss), "array_bytes": array_bytes,
            "graph_bytes": graph_bytes, "adjacency_build_s": build_s, "nnz": nnz,
            "stages": "-".join(s.kind for s in model.stages)}


def engine_epochs(graph: Graph, cfg: TrainConfig, *, partitions: int, intervals: int, staleness: int | None,
                  tensor_workers: int, epochs: int) -> dict:
    """Run the engine for `epochs` epochs without evaluation; the first epoch (compilation) is reported apart.
    No synchronous warm-up: the timed epochs are the steady state of the staleness bound."""
    from pipelines.engine.runner import train_engine

    c = dataclasses.replace(cfg, partitions=partitions, intervals=intervals, staleness=staleness,
                            tensor_workers=tensor_workers, epochs=epochs + 1, patience=0, sync_warmup=0).resolved()
    r = train_engine(c, graph, evaluate=False)
    times = [row["epoch_s"] for row in r.history]
    s = r.summary
    return {
        "bench": "epoch", "engine": "pipelined", "partitions": partitions, "intervals": intervals,
        "staleness": "none" if staleness is None else staleness, "tensor_workers": tensor_workers,
        "epochs": epochs, "first_epoch_s": times[0], "epoch_s_min": float(min(times[1:])),
        "epoch_s_median": float(np.median(times[1:])),
        "cpu_s_median": float(np.median([row["cpu_s"] for row in r.history[1:]])),
        "utilization": s["utilization"], "busy_s": s["busy_s"],
        "max_staleness_observed": s["max_staleness_observed"], "final_loss": r.history[-1]["loss"],
        "partition_stats": s["partition_stats"],
        "residual_cache": s.get("tensor_pool", {}).get("residual_cache"),
    }
