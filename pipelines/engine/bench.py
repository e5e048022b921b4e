"""Engine benchmark helper: seconds per pipelined epoch and per-stage utilization, for bench/epoch.py."""
from __future__ import annotations

import dataclasses

import numpy as np

from pipelines.config import TrainConfig
from pipelines.data.graph import Graph


def engine_epochs(graph: Graph, cfg: TrainConfig, *, partitions: int, intervals: int, staleness: int | None,
                  tensor_workers: int, epochs: int) -> dict:
    """Run the engine for `epochs` epochs without evaluation; the first epoch (compilation) is reported apart."""
    from pipelines.engine.runner import train_engine

    c = dataclasses.replace(cfg, partitions=partitions, intervals=intervals, staleness=staleness,
                            tensor_workers=tensor_workers, epochs=epochs + 1, patience=0).resolved()
    r = train_engine(c, graph, evaluate=False)
    times = [row["epoch_s"] for row in r.history]
    s = r.summary
    return {
        "bench": "epoch", "engine": "pipelined", "partitions": partitions, "intervals": intervals,
        "staleness": "none" if staleness is None else staleness, "tensor_workers": tensor_workers,
        "epochs": epochs, "first_epoch_s": times[0], "epoch_s_min": float(min(times[1:])),
        "epoch_s_median": float(np.median(times[1:])), "utilization": s["utilization"], "busy_s": s["busy_s"],
        "max_staleness_observed": s["max_staleness_observed"], "final_loss": r.history[-1]["loss"],
        "partition_stats": s["partition_stats"],
    }
