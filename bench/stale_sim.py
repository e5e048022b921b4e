"""Bench: the engine's `smooth` staleness replayed on the whole graph, for ablating ghost-value estimators cheaply.

A 2-layer GCN in the GA-first order (GA·X, AV, AV, GA, LOSS) has one ghost tensor: the second AV's output Z. Under
`--staleness-mode smooth` epoch e reads Z of epoch e on edges inside a METIS part and an estimate of Z from epochs
<= e - S on cut edges, with fresh weights and fresh ghost gradients: logits = Â Z + Â_cut sg(G - Z), which is that
forward with the gradient of the fresh one. Dropout draws the engine's masks (keyed by seed, epoch, stage, vertex),
so the numbers are the engine's: 50,000-vertex planted graph, seed 0, P=4, 150 epochs: none 0.9089 and S=2 0.8975
(the engine: 0.909, 0.8975); 2,000-vertex graph, 60 epochs: 0.9013 / S=2 0.9053 raw, 0.8033 / S=1 0.702 / S=2 0.6993
row-normalized (the engine's, to the digit). One jitted step per epoch instead of the engine's tasks (two
150-epoch runs on the 50,000-vertex graph: 113 s of CPU with compiling). Estimators: ema<γ> (bias-corrected:
`smooth`), emau<γ> (from 0: `smooth-zero`), plain (e - S), fresh (epoch e, as for an input transform).
In the AV-first order (AV, GA, AV, GA, LOSS: more features than hidden units) there are two ghost tensors, the
first layer's output and the second's; `--est A,B` picks an estimator for each, and the engine's `smooth` is
`fresh,ema0.98` (the first layer is an input transform). Issue 13's ablation:
python bench/stale_sim.py --dataset "synthetic:planted?nodes=20000&classes=8&degree=12&features=32" --hidden 16
--epochs 120 --S 1 --warmup 20 --seeds 0 1 2 3 4 --est fresh,fresh ema0.98,ema0.98 fresh,ema0.98 ema0.98,fresh
Prints one JSON line per (seed, S, estimator). Example:
python bench/stale_sim.py --S 0 2 --seeds 0 1 2 --est emau0.98 ema0.98
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT = "synthetic:planted?nodes=50000&classes=10&degree=10&features=64"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dataset", default=DEFAULT)
    p.add_argument("--S", type=int, nargs="+", default=[0, 1, 2], help="staleness bounds (0: synchronous)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--est", nargs="+", default=["emau0.98"],
                   help="ema<γ>, emau<γ>, plain or fresh; AV-first: one per ghost tensor, first layer's first "
                        "(fresh,ema0.98 is the engine's smooth)")
    p.add_argument("--order", default="auto", choices=["auto", "ga-first", "av-first"])
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--norm", default="auto", choices=["auto", "row", "none"])
    p.add_argument("--warmup", type=int, nargs="+", default=[0],
                   help="synchronous epochs before the staleness bound applies (each value a run)")
    args = p.parse_args(argv)
    for est in args.est:
        if not all(re.fullmatch(r"(ema|emau)0?\.\d+|plain|fresh", e) for e in est.split(",")):
            p.error(f"unknown estimator {est!r} (ema<γ>, emau<γ>, plain or fresh; comma-separated per ghost tensor)")
    return args


class Estimator:
    """The ghost rows an epoch reads on cut edges, from the fresh Z of epochs <= e - S (`pipelines.engine.ghosts.GhostReader`)."""

    def __init__(self, name: str):
        self.kind = re.match(r"[a-z]+", name).group()
        self.gamma = float(name[len(self.kind):] or 0)
        self.s = self.w = None
        self.by_epoch: dict[int, object] = {}

    def add(self, e: int, z) -> None:
        g = self.gamma
        self.s, self.w = (z, 1.0) if self.s is None else (g * self.s + z, g * self.w + 1.0)
        self.by_epoch[e] = {"ema": lambda: self.s / self.w, "emau": lambda: (1.0 - g) * self.s,
                            "plain": lambda: z}[self.kind]()

    def read(self, e_ghost: int):
        return self.by_epoch[e_ghost]


def run(args, graph, seed: int, S: int, est: str, warmup: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import scipy.sparse as sp

    from ops import dense, models, sparse
    from ops.optim import dropout_seeds, make_optimizer
    from ops.spec import ModelSpec
    from pipelines.config import TrainConfig
    from pipelines.engine.partition import assign
    from pipelines.epochs import EarlyStopping, model_inputs
    from schemas.tasks import StageKind

    cfg = TrainConfig(model="gcn", hidden=args.hidden, epochs=args.epochs, seed=seed, feature_norm=args.norm,
                      partitions=args.partitions, order=args.order).resolved()
    x, a = model_inputs(cfg, graph)
    a = sp.csr_matrix(a)
    part = assign(a, args.partitions, "metis", seed)
    coo = a.tocoo()
    keep = part[coo.row] != part[coo.col]
    a_cut = sp.csr_matrix((coo.data[keep], (coo.row[keep], coo.col[keep])), shape=a.shape)
    n = a.shape[0]
    ids = np.arange(n)
    adj = sparse.Adjacency.from_scipy(a, row_gids=ids, col_gids=ids, symmetric=True).to_device()
    adj_cut = sparse.Adjacency.from_scipy(a_cut, row_gids=ids, col_gids=ids).to_device()
    model = ModelSpec.for_graph(cfg, graph).build()
    st = model.stages
    kinds = [str(s.kind) for s in st]
    if kinds not in (["GA", "AV", "AV", "GA", "LOSS"], ["AV", "GA", "AV", "GA", "LOSS"]):
        raise SystemExit(f"stale_sim replays a 2-layer GCN (GA, AV, AV, GA, LOSS or AV, GA, AV, GA, LOSS); "
                         f"this model is {kinds}")
    # the ghost tensors: the input of every GA but one over the input features (those never change)
    ghost_stages = [s.index for s in st if s.kind == StageKind.GA and s.index > 0]
    names = est.split(",") if "," in est else [est] * len(ghost_stages)
    if len(names) != len(ghost_stages):
        raise SystemExit(f"--est {est!r}: this order has {len(ghost_stages)} ghost tensors, one estimator each")
    data = dict(adj=adj, adj_cut=adj_cut, x=jnp.asarray(x), xh=jnp.asarray(a @ x), labels=jnp.asarray(graph.labels),
                masks=[jnp.asarray(m) for m in (graph.train_mask, graph.val_mask, graph.test_mask)])
    params = model.init(jax.random.PRNGKey(seed))
    tx = make_optimizer(cfg.lr, cfg.weight_decay, model.decay_mask(params))

    def forward(p, seeds, d, ghosts, fresh):
        """The logits and each ghost tensor's fresh value; GA reads `ghosts[k]` on cut edges where fresh[k] = 0."""
        h, zs = d["x"], []
        for s in st[:-1]:
            if s.kind == StageKind.GA and s.index == 0:
                # Â·X, the constant prefix, where nothing drops the features out (evaluation); else Â·dropout(X)
                h = d["xh"] if seeds is None or s.rate <= 0.0 else sparse.gather(
                    d["adj"], dense.dropout(d["x"], s.rate, seeds[s.index], d["adj"].col_gids))
            elif s.kind == StageKind.GA:
                k = len(zs)
                zs.append(h)
                h = sparse.gather(d["adj"], h) + (1.0 - fresh[k]) * sparse.gather(
                    d["adj_cut"], jax.lax.stop_gradient(ghosts[k] - h))
            else:
                h = dense.apply_vertex(p[s.name], h, act_in=s.act_in, act_out=s.act_out,
                                       rate=s.rate if seeds is not None else 0.0,
                                       seed=None if seeds is None else seeds[s.index],
                                       row_gids=d["adj"].row_gids)["z"]
        return models.logits_of(st[-1], p, h), zs

    @jax.jit
    def step(p, o, ghosts, fresh, seeds, d):
        def loss_fn(p):
            logits, zs = forward(p, seeds, d, ghosts, fresh)
            s_, n_ = dense.softmax_cross_entropy(logits, d["labels"], d["masks"][0])
            return s_ / jnp.maximum(n_, 1.0), zs
        (_, zs), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, zs

    @jax.jit
    def evaluate(p, d, zeros):
        logits, _ = forward(p, None, d, zeros, [1.0] * len(zeros))
        out = []
        for m in d["masks"]:
            s_, n_ = dense.softmax_cross_entropy(logits, d["labels"], m)
            out.append((s_ / n_, dense.correct_count(logits, d["labels"], m) / m.sum()))
        return out

    t0 = time.perf_counter()
    estimators, stopper, p, o = [Estimator(nm) for nm in names], EarlyStopping(0), params, tx.init(params)
    zeros = [jnp.zeros((n, st[k - 1].out_dim), jnp.float32) for k in ghost_stages]
    tests, vals = [], []
    for e in range(args.epochs):
        e_ghost = e if e < warmup else max(e - S, 0)
        read = [est_.kind == "fresh" or e_ghost == e for est_ in estimators]
        ghosts = [z0 if r else est_.read(e_ghost) for z0, r, est_ in zip(zeros, read, estimators)]
        p, o, zs = step(p, o, ghosts, [float(r) for r in read], jnp.asarray(dropout_seeds(seed, e, len(st))), data)
        for est_, z in zip(estimators, zs):
            if est_.kind != "fresh":
                est_.add(e, z)
                est_.by_epoch.pop(e - S - 1, None)
        (_, _), (vl, va), (_, ta) = evaluate(p, data, zeros)
        stopper.update(e, {"val_acc": float(va), "val_loss": float(vl)})
        tests.append(float(ta))
        vals.append(round(float(va), 4))
    return {"bench": "stale_sim", "dataset": args.dataset, "norm": args.norm, "order": "av-first" if kinds[0] == "AV" else "ga-first",
            "hidden": args.hidden, "partitions": args.partitions, "epochs": args.epochs, "S": S, "estimator": est,
            "warmup": warmup, "seed": seed, "test_acc": tests[stopper.best_epoch], "best_epoch": stopper.best_epoch,
            "last20_test_acc": round(float(np.mean(tests[-20:])), 4), "val_acc": vals,
            "seconds": round(time.perf_counter() - t0, 1), "load_average": os.getloadavg()[0]}


def main(argv=None) -> int:
    args = _parse(argv)
    from pipelines.data.registry import load_dataset

    graph = load_dataset(args.dataset, None, seed=0)
    for seed in args.seeds:
        for S in args.S:
            for est in (args.est if S else args.est[:1]):  # S=0 reads no estimate: one run
                for w in (args.warmup if S else args.warmup[:1]):
                    print(json.dumps(run(args, graph, seed, S, est, w)), flush=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
