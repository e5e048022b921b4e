"""Bench: how much of a fixed per-task latency (a remote tensor worker's round trip) the pipeline hides; JSON lines.

One line per (staleness, latency): the engine's median epoch (after the first, which compiles) with every
tensor task delayed by `--task-latency-s L`, its ratio to the L = 0 epoch of the same staleness, the exposed
latency (epoch(L) - epoch(0), also in units of L), the tensor-task concurrency the pool reached and the load
average, on a planted graph (1,000,000 vertices, degree 10, 64 features by default: an epoch of about 1 s here,
where Dorylus's graphs take seconds), GCN, P x I intervals, N workers that sleep through the latency without
holding a core, at the default staleness mode and no synchronous warm-up (the timed epochs are the bound's).
Tensor tasks per interval and epoch are the serial tensor phases of one interval: with fresh weights the WU of
epoch e-1 is a barrier, so an epoch has three round trips in a row; what hides them is the other partitions'
work in the meantime, which grows with the graph while L does not (README, 'Latency').
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--degree", type=float, default=10.0)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--intervals", type=int, default=8)
    p.add_argument("--tensor-workers", type=int, default=16)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs per run (after one compiling epoch)")
    p.add_argument("--staleness", default="none,0,1,2")
    p.add_argument("--latency", default="0,0.01,0.025,0.05,0.1", help="seconds per tensor task")
    p.add_argument("--staleness-mode", default="smooth", choices=["smooth", "smooth-zero", "predict", "fresh", "stale"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        stal = [None if s.strip() == "none" else int(s) for s in args.staleness.split(",")]
        lats = [float(x) for x in args.latency.split(",")]
    except ValueError as e:
        p.error(f"--staleness / --latency: {e}")
    if any(x < 0 for x in lats) or any(s is not None and s < 0 for s in stal):
        p.error("latencies and staleness must be >= 0")

    from pipelines.config import TrainConfig
    from pipelines.data.registry import load_dataset
    from pipelines.engine.runner import train_engine

    spec = (f"synthetic:planted?nodes={args.nodes}&classes={args.classes}&degree={args.degree}"
            f"&features={args.features}")
    graph = load_dataset(spec, None, seed=args.seed)
    base = TrainConfig(model="gcn", hidden=args.hidden, seed=args.seed, epochs=args.epochs + 1, patience=0,
                       partitions=args.partitions, intervals=args.intervals,
                       tensor_workers=args.tensor_workers, staleness_mode=args.staleness_mode,
                       sync_warmup=0)  # the timed epochs are the bound's steady state, not the warm-up
    for s in stal:
        at_zero = None
        for lat in sorted(lats):
            cfg = dataclasses.replace(base, staleness=s, task_latency_s=lat).resolved()
            r = train_engine(cfg, graph, evaluate=False)
            times = [row["epoch_s"] for row in r.history[1:]]
            epoch = float(np.median(times))
            at_zero = epoch if lat == 0 or at_zero is None else at_zero
            sm = r.summary
            tasks = sm["tensor_tasks"] / max(len(r.history), 1) / (args.partitions * args.intervals)
            exposed = epoch - at_zero
            print(json.dumps({
                "bench": "latency", "graph": spec, "partitions": args.partitions, "intervals": args.intervals,
                "tensor_workers": args.tensor_workers, "staleness": "none" if s is None else s,
                "staleness_mode": args.staleness_mode, "latency_s": lat, "epochs": len(times),
                "epoch_s_median": round(epoch, 4), "epoch_s_min": round(min(times), 4),
                "ratio_to_latency_0": round(epoch / at_zero, 3), "exposed_latency_s": round(exposed, 4),
                "exposed_in_latencies": round(exposed / lat, 2) if lat else 0.0,
                "tensor_tasks_per_interval_epoch": round(tasks, 2),
                "tensor_concurrency_peak": sm.get("tensor_concurrency_peak"), "relaunches": sm["relaunches"],
                "max_staleness_observed": sm["max_staleness_observed"],
                "load_average": [round(x, 2) for x in os.getloadavg()]}), flush=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
