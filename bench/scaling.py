"""Bench: scaling over R-MAT sizes. Seconds per edge per epoch, and graph-server memory per edge.

    python bench/scaling.py                                  # 1M, 2M, 4M, 8M, 16M undirected edges
    python bench/scaling.py --edges 1M,2M --epochs 3 --engine 2

For each size, in a fresh subprocess (so peak RSS belongs to that size alone): an R-MAT graph with Graph500's
edge factor 16 (2^k vertices, 16 x 2^k distinct undirected edges, so vertices and edges grow together), feature
dimension F; a 2-layer GCN trained with the whole-graph trainer's jitted step for --epochs epochs after one
compiling epoch. Optionally (--engine P) the pipelined engine with P partitions, hash partitioner.

One JSON line per (size, trainer):
  seconds per epoch (median, min), `s_per_edge` = fastest epoch's seconds / undirected edges (on a shared
    machine the fastest epoch is the one least disturbed by other processes; `s_per_edge_median` beside it),
  `cpu_s_per_edge` = the fastest epoch's process CPU seconds (all threads) / edges: the work per edge, which
    other processes on a busy machine do not inflate the way they inflate wall time,
  `graph_bytes_per_directed_edge`: the trainer's adjacency (CSR values, int32 indices and indptr, vertex ids;
    features apart) per directed edge, goal <= 12 for GCN (`graph_goal_ok`); `array_bytes`: it + the features;
  `peak_rss_delta_bytes`: the process's peak RSS minus its RSS before the graph was built (includes the
    generator's and the kernels' transient buffers), `peak_rss_per_directed_edge` its share per directed edge.
A final `scaling-summary` line: the spread of seconds (and CPU seconds) per edge, max / min over sizes; goal
<= 1.3. `--order auto` is the trainer's own vertex order (hub order on skewed graphs such as R-MAT, see
pipelines.data.graph.locality_order); `--order ids` keeps the generator's random ids; `auto,ids` runs both.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GOAL_SPREAD = 1.3
GOAL_BYTES_PER_EDGE = 64
GOAL_GRAPH_BYTES_PER_DIRECTED_EDGE = 12


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2 ** 10, "M": 2 ** 20}.get(s[-1:], 1)
    return int(float(s[:-1]) * mult) if mult != 1 else int(s)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _nbytes(obj) -> int:
    import jax
    import numpy as np

    return int(sum(np.asarray(a).nbytes if not hasattr(a, "nbytes") else a.nbytes
                   for a in jax.tree_util.tree_leaves(obj)))


def one(args) -> list[dict]:
    """One size, in this process: the whole-graph trainer (and the engine); returns the rows."""
    import jax.numpy as jnp
    import numpy as np

    jnp.zeros(1).block_until_ready()  # the runtime's own memory is part of the baseline
    from pipelines.config import TrainConfig
    from pipelines.data.synthetic import rmat
    from pipelines.engine.bench import whole_graph_epochs

    m = args.one
    scale = max(int(round(np.log2(m / args.edge_factor))), 1)
    base_rss = rss_bytes()
    t0 = time.perf_counter()
    graph = rmat(scale, num_edges=m, feature_dim=args.features, num_classes=args.classes, seed=args.seed)
    gen_s = time.perf_counter() - t0
    if args.order == "ids":
        import pipelines.epochs

        pipelines.epochs.locality_order = lambda adj: None
    cfg = TrainConfig(model="gcn", hidden=args.hidden, layers=2, seed=args.seed, dropout=0.5,
                      epochs=args.epochs).resolved()
    w = whole_graph_epochs(graph, cfg, args.epochs)  # its device arrays are freed when it returns
    times, cpu, array_bytes = w["times"], w["cpu"], w["array_bytes"]
    n, edges, F = graph.num_nodes, graph.num_edges // 2, args.features
    goal = GOAL_BYTES_PER_EDGE * edges + 4 * F * n
    peak = peak_rss_bytes() - base_rss
    med = float(np.median(times))
    common = {"bench": "scaling", "edges": edges, "nodes": n, "nnz": w["nnz"], "features": F,
              "hidden": args.hidden, "rmat_scale": scale, "order": args.order}
    # Seconds per edge from the fastest epoch: on a shared machine the median measures the neighbours too.
    rows = [{**common, "trainer": "whole-graph", "epochs": args.epochs, "epoch_s_median": med,
             "epoch_s_min": float(min(times)), "s_per_edge": float(min(times)) / edges,
             "s_per_edge_median": med / edges, "cpu_s_min": float(min(cpu)),
             "cpu_s_per_edge": float(min(cpu)) / edges, "jit_s": w["jit_s"], "generate_s": gen_s,
             "adjacency_build_s": w["adjacency_build_s"], "graph_bytes": w["graph_bytes"],
             "graph_bytes_per_directed_edge": w["graph_bytes"] / graph.num_edges,
             "graph_goal_ok": w["graph_bytes"] <= GOAL_GRAPH_BYTES_PER_DIRECTED_EDGE * graph.num_edges,
             "array_bytes": array_bytes, "array_bytes_per_edge": array_bytes / edges,
             "memory_goal_bytes": goal, "memory_goal_ok": array_bytes <= goal,
             "peak_rss_delta_bytes": peak, "peak_rss_delta_per_edge": peak / edges,
             "peak_rss_per_directed_edge": peak / graph.num_edges,
             "final_loss": w["final_loss"], "cores": os.cpu_count()}]
    print(json.dumps(rows[0]), flush=True)
    if args.engine:
        rows.append(engine_row(args, graph, cfg, common))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_row(args, graph, cfg, common: dict) -> dict:
    """The pipelined engine on the same graph: seconds per epoch, and the graph servers' resident arrays."""
    import dataclasses

    import numpy as np

    from pipelines.engine.runner import train_engine

    c = dataclasses.replace(cfg, partitions=args.engine, intervals=args.intervals, staleness=0,
                            tensor_workers=args.tensor_workers, epochs=args.epochs + 1, patience=0,
                            partitioner="hash").resolved()
    t0 = time.perf_counter()
    r = train_engine(c, graph, evaluate=False)
    wall = time.perf_counter() - t0
    times = [row["epoch_s"] for row in r.history]
    med = float(np.median(times[1:]))
    edges, F = common["edges"], common["features"]
    # Graph-server arrays, from the plan the engine built (`run_context`): the blocks it holds (each partition's
    # whole block, and each interval's where the model needs them: CSR + transpose, indptrs, ids) and the
    # partition's feature columns (owned + ghosts).
    from pipelines.engine.runner import run_context

    ctx = run_context(c, graph)
    worst = None
    for pp in ctx.plan.partitions:
        held = [b for b in [pp.block] + [iv.block for iv in pp.intervals] if b is not None]
        blocks = sum(_nbytes(b) for b in held)
        cols = int(pp.colspace.size) * ctx.x.shape[1] * 4
        nnz = (int(pp.block.indptr[-1]) if pp.block is not None else  # includes padding entries
               sum(int(iv.block.indptr[-1]) for iv in pp.intervals))
        gs = {"bytes": blocks + cols, "edges": nnz / 2, "vertices": int(pp.colspace.size)}
        gs["goal"] = GOAL_BYTES_PER_EDGE * gs["edges"] + 4 * F * gs["vertices"]
        if worst is None or gs["bytes"] / gs["goal"] > worst["bytes"] / worst["goal"]:
            worst = gs
    ps = r.summary.get("partition_stats", {})
    return {**common, "trainer": "engine", "partitions": args.engine, "intervals": args.intervals,
            "staleness": 0, "epochs": args.epochs, "first_epoch_s": times[0], "epoch_s_median": med,
            "epoch_s_min": float(min(times[1:])), "s_per_edge": float(min(times[1:])) / edges,
            "s_per_edge_median": med / edges, "wall_s": wall, "utilization": r.summary["utilization"],
            "edge_cut_fraction": ps.get("edge_cut_fraction"), "final_loss": r.history[-1]["loss"],
            "peak_rss_bytes": peak_rss_bytes(), "graph_server_array_bytes": worst["bytes"],
            "graph_server_bytes_per_edge": worst["bytes"] / worst["edges"],
            "graph_server_memory_goal_bytes": worst["goal"], "memory_goal_ok": worst["bytes"] <= worst["goal"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--edges", default="1M,2M,4M,8M,16M", help="undirected edge counts (K = 2^10, M = 2^20)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--edge-factor", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", default="auto", help="vertex order: auto (the trainer's: hub order on skewed "
                                                   "graphs) or ids (Graph500's random ids); comma-separated: both")
    p.add_argument("--engine", type=int, default=0, help="also run the engine with this many partitions")
    p.add_argument("--engine-max-edges", default="4M", help="the engine runs only up to this size")
    p.add_argument("--intervals", type=int, default=4)
    p.add_argument("--tensor-workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per size")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        one(args)
        return 0
    sizes = [parse_size(s) for s in args.edges.split(",") if s.strip()]
    eng_max = parse_size(args.engine_max_edges)
    rows = []
    for m, order in [(m, o) for o in args.order.split(",") for m in sizes]:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(m), "--order", order,
               "--epochs", str(args.epochs),
               "--features", str(args.features), "--hidden", str(args.hidden), "--classes", str(args.classes),
               "--edge-factor", str(args.edge_factor), "--seed", str(args.seed),
               "--engine", str(args.engine if m <= eng_max else 0), "--intervals", str(args.intervals),
               "--tensor-workers", str(args.tensor_workers)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            row = {"bench": "scaling", "edges_requested": m, "error": f"timeout after {args.timeout:.0f}s"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
        got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not got:
            got.append({"bench": "scaling", "edges_requested": m, "error": f"exit {proc.returncode}",
                        "stderr_tail": proc.stderr[-800:]})
        for row in got:
            print(json.dumps(row), flush=True)
        rows += got
    summary = {"bench": "scaling-summary", "goal_spread": GOAL_SPREAD}
    for order in args.order.split(","):
        pre = "" if order == "auto" else f"{order}."
        for trainer in ("whole-graph", "engine"):
            got = [r for r in rows if r.get("trainer") == trainer and r.get("order") == order]
            for key in ("s_per_edge", "cpu_s_per_edge"):
                spe = [r[key] for r in got if key in r]
                if len(spe) >= 2:
                    summary[f"{pre}{trainer}.{key}_spread"] = max(spe) / min(spe)
                    summary[f"{pre}{trainer}.{key}_spread_ok"] = max(spe) / min(spe) <= GOAL_SPREAD
    mem = [r for r in rows if r.get("trainer") == "whole-graph" and "array_bytes" in r]
    if mem:
        summary["memory_goal_ok"] = all(r["memory_goal_ok"] for r in mem)
        summary["array_bytes_per_edge_max"] = max(r["array_bytes_per_edge"] for r in mem)
        summary["peak_rss_delta_per_edge_max"] = max(r["peak_rss_delta_per_edge"] for r in mem)
        summary["graph_bytes_per_directed_edge_max"] = max(r["graph_bytes_per_directed_edge"] for r in mem)
        summary["graph_goal_ok"] = all(r["graph_goal_ok"] for r in mem)
    print(json.dumps(summary), flush=True)
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
