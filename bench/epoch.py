"""Bench: seconds per full-graph GCN epoch on a synthetic graph (ogbn-arxiv's size by default); one JSON line."""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _whole_row(graph, cfg, args, gen_s: float) -> dict:
    """The whole-graph trainer's row: `args.epochs` timed epochs after a compiling one."""
    import numpy as np

    from pipelines.engine.bench import whole_graph_epochs

    w = whole_graph_epochs(graph, cfg, args.epochs)
    times = w["times"]
    return {
        "bench": "epoch", "engine": "whole-graph", "nodes": graph.num_nodes, "edges_directed": graph.num_edges,
        "features": args.features, "hidden": args.hidden, "classes": args.classes, "layers": args.layers,
        "order": args.order, "stages": w["stages"], "epochs": args.epochs,
        "epoch_s_min": min(times), "epoch_s_median": float(np.median(times)), "jit_s": w["jit_s"],
        "generate_s": gen_s, "final_loss": w["final_loss"], "peak_rss_mb": peak_rss_mb(),
        "graph_bytes_per_directed_edge": w["graph_bytes"] / graph.num_edges, "cores": os.cpu_count(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=169_343)
    p.add_argument("--edges", type=int, default=1_166_243, help="undirected edges")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--order", default="auto", choices=["auto", "ga-first", "av-first"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partitions", type=int, default=0, help="also run the pipelined engine with P partitions")
    p.add_argument("--intervals", type=int, default=8)
    p.add_argument("--staleness", default="0,1", help="comma-separated staleness values for the engine runs")
    p.add_argument("--tensor-workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="with --partitions: rounds of (whole-graph, each staleness) run one after another; each "
                        "engine row's ratio is to its own round's whole-graph epoch, and a last row per staleness "
                        "gives the median ratio over rounds (single runs here vary by 10-20%%)")
    p.add_argument("--residual-cache-mb", type=int, default=1024,
                   help="the engine pool's cache of AV forwards' residuals (0: every backward recomputes)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")

    import numpy as np

    from pipelines.config import TrainConfig
    from pipelines.data.synthetic import planted_partition

    t0 = time.perf_counter()
    graph = planted_partition(num_nodes=args.nodes, num_classes=args.classes,
                              avg_degree=2.0 * args.edges / args.nodes, feature_dim=args.features, seed=args.seed)
    gen_s = time.perf_counter() - t0
    cfg = TrainConfig(model="gcn", hidden=args.hidden, layers=args.layers, order=args.order, seed=args.seed,
                      dropout=0.5, epochs=args.epochs,
                      residual_cache_mb=args.residual_cache_mb).resolved()
    staleness = args.staleness.split(",")
    ratios: dict[str, list] = {s: [] for s in staleness}
    for r in range(args.rounds if args.partitions else 1):
        single = _whole_row(graph, cfg, args, gen_s)
        single["round"] = r
        print(json.dumps(single), flush=True)
        if not args.partitions:
            break
        from pipelines.engine.bench import engine_epochs

        for s in staleness[r % len(staleness):] + staleness[: r % len(staleness)]:  # no setting always last
            row = engine_epochs(graph, cfg, partitions=args.partitions, intervals=args.intervals,
                                staleness=None if s == "none" else int(s), tensor_workers=args.tensor_workers,
                                epochs=args.epochs)
            row["ratio_to_whole_graph"] = row["epoch_s_median"] / single["epoch_s_median"]
            row["round"] = r
            row["peak_rss_mb"] = peak_rss_mb()
            ratios[s].append(row["ratio_to_whole_graph"])
            print(json.dumps(row), flush=True)
    if args.partitions and args.rounds > 1:
        for s in staleness:
            print(json.dumps({"bench": "epoch", "engine": "pipelined", "summary": "median over rounds",
                              "partitions": args.partitions, "intervals": args.intervals,
                              "staleness": "none" if s == "none" else int(s), "rounds": args.rounds,
                              "ratio_to_whole_graph": float(np.median(ratios[s])),
                              "ratios": [round(x, 3) for x in ratios[s]]}), flush=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
