"""Bench worker: full-graph training epochs of one model in one framework (dorylus, dgl or pyg) on a graph file
written by bench/peers.py; prints one JSON line (epoch seconds, peak RSS). Runs under the framework's own
Python: for dgl and pyg it imports only numpy, torch and that library.

The models are the same everywhere: GCN, 2 layers, Â = D^-1/2 (A+I) D^-1/2, dropout 0.5 on each layer's input,
Adam lr 0.01; GAT, 2 layers, H heads x F hidden with ELU, one output head, dropout 0.6 on features and
attention; cross-entropy over the train mask, a full backward and an optimizer step per epoch.
"""
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


def _dorylus(z, args):
    import jax
    import jax.numpy as jnp

    from ops.optim import dropout_seeds, make_optimizer
    from pipelines.config import TrainConfig
    from pipelines.data.graph import make_graph
    from pipelines.train import build_model, device_graph, make_train_step

    n = int(z["labels"].size)
    graph = make_graph("peers", z["src"], z["dst"], z["features"], z["labels"], z["train"], ~z["train"],
                       ~z["train"], num_classes=int(z["labels"].max()) + 1)
    extra = {"hidden": args.hidden} if args.model == "gcn" else {"hidden": args.hidden, "heads": args.heads}
    cfg = TrainConfig(model=args.model, feature_norm="none", **extra).resolved()
    model = build_model(cfg, graph)
    g = device_graph(cfg, graph)
    del graph
    params = model.init(jax.random.PRNGKey(0))
    tx = make_optimizer(cfg.lr, 0.0, model.decay_mask(params))
    opt_state = tx.init(params)
    step = make_train_step(model, tx)

    def epoch(e):
        nonlocal params, opt_state
        seeds = jnp.asarray(dropout_seeds(0, e, len(model.stages)))
        params, opt_state, loss = step(params, opt_state, g.adj, g.train_input, g.labels, g.masks[0], seeds)
        return float(loss)

    return epoch, {"version": jax.__version__, "nodes": n}


def _torch_models(args, in_dim, classes):
    import torch

    if args.framework == "dgl":
        from dgl.nn import GATConv, GraphConv

        if args.model == "gcn":
            layers = [GraphConv(in_dim, args.hidden, norm="both"), GraphConv(args.hidden, classes, norm="both")]
        else:
            layers = [GATConv(in_dim, args.hidden, args.heads, feat_drop=0.6, attn_drop=0.6),
                      GATConv(args.hidden * args.heads, classes, 1, feat_drop=0.6, attn_drop=0.6)]
    else:
        from torch_geometric.nn import GATConv, GCNConv

        if args.model == "gcn":
            layers = [GCNConv(in_dim, args.hidden, cached=True), GCNConv(args.hidden, classes, cached=True)]
        else:
            layers = [GATConv(in_dim, args.hidden, args.heads, dropout=0.6),
                      GATConv(args.hidden * args.heads, classes, 1, dropout=0.6)]
    return torch.nn.ModuleList(layers)


def _torch(z, args):
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    src, dst = np.concatenate([z["src"], z["dst"]]), np.concatenate([z["dst"], z["src"]])  # both directions
    x = torch.from_numpy(z["features"])
    y = torch.from_numpy(z["labels"].astype(np.int64))
    train = torch.from_numpy(z["train"])
    n = int(y.numel())
    if args.framework == "dgl":
        import dgl

        g = dgl.add_self_loop(dgl.graph((torch.from_numpy(src), torch.from_numpy(dst)), num_nodes=n))
        g.create_formats_()  # every sparse format built once, before the timed epochs
        version = dgl.__version__
    else:
        import torch_geometric
        from torch_geometric.utils import add_self_loops

        g = torch.from_numpy(np.stack([src, dst]).astype(np.int64))
        if args.model == "gcn":
            g = add_self_loops(g, num_nodes=n)[0]  # GCNConv adds them too; cached=True normalizes once
        version = torch_geometric.__version__
    layers = _torch_models(args, x.shape[1], int(y.max()) + 1)
    opt = torch.optim.Adam(layers.parameters(), lr=0.01)
    drop = 0.5 if args.model == "gcn" else 0.6

    def forward():
        h = x
        for i, layer in enumerate(layers):
            if args.model == "gcn":
                h = layer(g, F.dropout(h, drop)) if args.framework == "dgl" else layer(F.dropout(h, drop), g)
                h = F.relu(h) if i == 0 else h
            else:
                h = layer(g, h) if args.framework == "dgl" else layer(F.dropout(h, drop), g)
                h = h.reshape(h.shape[0], -1) if i == 0 else h.reshape(h.shape[0], -1, h.shape[-1]).mean(1)
                h = F.elu(h) if i == 0 else h
        return h

    def epoch(e):
        opt.zero_grad()
        loss = F.cross_entropy(forward()[train], y[train])
        loss.backward()
        opt.step()
        return float(loss)

    return epoch, {"version": version, "torch": torch.__version__, "nodes": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--framework", required=True, choices=["dorylus", "dgl", "pyg"])
    p.add_argument("--model", required=True, choices=["gcn", "gat"])
    p.add_argument("--graph", required=True, help="the .npz bench/peers.py wrote")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    args = p.parse_args(argv)
    import numpy as np

    with np.load(args.graph) as f:
        z = {k: f[k] for k in f.files}
    epoch, info = (_dorylus if args.framework == "dorylus" else _torch)(z, args)
    del z
    t0 = time.perf_counter()
    loss = epoch(0)  # compiles (dorylus) or warms up allocators (torch)
    first_s = time.perf_counter() - t0
    times = []
    for e in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        loss = epoch(e)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"bench": "peer-epochs", "framework": args.framework, "model": args.model, **info,
                      "epochs": args.epochs, "epoch_s_median": float(np.median(times)), "epoch_s_min": min(times),
                      "first_epoch_s": first_s, "final_loss": loss, "peak_rss_mb": peak_rss_mb(),
                      "load_avg": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
