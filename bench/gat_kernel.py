"""Bench: GAT's fused attention kernel (ops.attention) against AE then the weighted GA, stage by stage: seconds
per training step (forward, loss, backward) and XLA's peak temporary memory for it; one JSON line per kernel.

The memory is the compiled step's temp allocation (XLA's buffer assignment: what the step holds beyond its
inputs and outputs, the [E, heads] residuals among it), so it is exact and does not depend on the load.
Example: python bench/gat_kernel.py --nodes 169343 --edges 1166243 (ogbn-arxiv's size).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step(model, adj, x, labels, mask, fused: bool):
    import jax

    from ops import dense, models

    def logits(p, seeds):
        if fused:
            return models.forward(model, p, adj, x, seeds)
        state = {"h": x}
        for st in model.stages[:-1]:
            state = {**state, **models.run_stage(st, p, state, adj, seeds[st.index])}
        return models.logits_of(model.stages[-1], p, state["h"])

    def loss(p, seeds):
        s, n = dense.softmax_cross_entropy(logits(p, seeds), labels, mask)
        return s / n

    from ops import xla

    return xla.jit(jax.value_and_grad(loss))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=169_343)
    p.add_argument("--edges", type=int, default=1_166_243, help="undirected edges")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--classes", type=int, default=40)
    p.add_argument("--hidden", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ops.optim import dropout_seeds
    from pipelines.config import TrainConfig
    from pipelines.data.synthetic import planted_partition
    from pipelines.train import build_model, device_graph

    graph = planted_partition(num_nodes=args.nodes, num_classes=args.classes,
                              avg_degree=2.0 * args.edges / args.nodes, feature_dim=args.features, seed=args.seed)
    cfg = TrainConfig(model="gat", hidden=args.hidden, heads=args.heads, seed=args.seed).resolved()
    model = build_model(cfg, graph)
    g = device_graph(cfg, graph)
    params = model.init(jax.random.PRNGKey(args.seed))
    results = {}
    for name, fused in (("fused", True), ("staged", False)):
        step = _step(model, g.adj, g.x, g.labels, g.masks[0], fused)
        seeds = jnp.asarray(dropout_seeds(args.seed, 0, len(model.stages)))
        mem = step.lower(params, seeds).compile().memory_analysis()
        times, out = [], None
        for i in range(args.steps + 1):
            seeds = jnp.asarray(dropout_seeds(args.seed, i, len(model.stages)))
            t0 = time.perf_counter()
            out = jax.block_until_ready(step(params, seeds))
            times.append(time.perf_counter() - t0)
        results[name] = out
        print(json.dumps({"bench": "gat-kernel", "kernel": name, "nodes": graph.num_nodes,
                          "edges_directed": graph.num_edges, "heads": args.heads, "hidden": args.hidden,
                          "step_s_median": float(np.median(times[1:])), "jit_s": times[0],
                          "temp_mb": mem.temp_size_in_bytes / 2**20 if mem else None,
                          "loss": float(out[0]), "load_avg": os.getloadavg()[0]}), flush=True)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(results["fused"]),
                                                                jax.tree_util.tree_leaves(results["staged"])))
    print(json.dumps({"bench": "gat-kernel-agreement", "max_abs_diff": diff}), flush=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
