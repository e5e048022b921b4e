"""Bench: an independent plain Kipf GCN (numpy/scipy, hand-written backward and Adam) to check the trainer against.

Nothing here imports ops/ or the trainer: Â, feature normalization, the forward pass, the loss, its gradient,
the L2 term and Adam are written out again from Kipf & Welling (ICLR 2017) and their TensorFlow code:
  H = ReLU(Â · drop(X) · W0 + b0), logits = Â · drop(H) · W1 + b1,
  loss = mean over train vertices of softmax cross-entropy + wd · Σ W0² / 2 (first layer weights only).
Example: python bench/reference_gcn.py --dataset amazon-computers --hidden 64 --seeds 3
(one JSON line per seed, with the trainer's test accuracy beside the reference's when --compare is given).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARAMS = ("w0", "b0", "w1", "b1")


def normalized_adjacency(adj: sp.spmatrix) -> sp.csr_matrix:
    """D^-1/2 (A + I) D^-1/2 in float64."""
    a = sp.csr_matrix(adj, dtype=np.float64) + sp.identity(adj.shape[0], format="csr")
    d = 1.0 / np.sqrt(np.asarray(a.sum(1)).ravel())
    return sp.csr_matrix(a.multiply(d[:, None]).multiply(d[None, :]))


def row_normalized(x: np.ndarray) -> np.ndarray:
    s = x.sum(1, keepdims=True)
    return x / np.where(s == 0, 1.0, s)


def glorot(rng: np.random.Generator, shape) -> np.ndarray:
    lim = np.sqrt(6.0 / (shape[0] + shape[1]))
    return rng.uniform(-lim, lim, shape)


def init(rng: np.random.Generator, f: int, hidden: int, classes: int) -> dict:
    return {"w0": glorot(rng, (f, hidden)), "b0": np.zeros(hidden), "w1": glorot(rng, (hidden, classes)),
            "b1": np.zeros(classes)}


def loss_and_grads(p: dict, a: sp.csr_matrix, x: np.ndarray, labels: np.ndarray, train: np.ndarray,
                   wd: float, keep0=None, keep1=None, rate: float = 0.0):
    """Loss (mean train cross-entropy + wd·ΣW0²/2) and its gradient for every parameter, by hand.

    keep0/keep1: boolean dropout keep-masks for the inputs of layer 0 and 1 (None: no dropout)."""
    scale = 1.0 / (1.0 - rate)
    x0 = x if keep0 is None else x * keep0 * scale
    ax0 = a @ x0
    pre = ax0 @ p["w0"] + p["b0"]
    h = np.maximum(pre, 0.0)
    h1 = h if keep1 is None else h * keep1 * scale
    ah1 = a @ h1
    logits = ah1 @ p["w1"] + p["b1"]
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    idx = np.flatnonzero(train)
    n = idx.size
    ce = -logp[idx, labels[idx]].sum() / n
    loss = ce + wd * np.sum(p["w0"] ** 2) / 2.0
    g_logits = np.zeros_like(logits)
    g_logits[idx] = np.exp(logp[idx])
    g_logits[idx, labels[idx]] -= 1.0
    g_logits /= n
    g = {"w1": ah1.T @ g_logits, "b1": g_logits.sum(0)}
    g_h1 = a.T @ (g_logits @ p["w1"].T)
    g_h = g_h1 if keep1 is None else g_h1 * keep1 * scale
    g_pre = g_h * (pre > 0)
    g["w0"] = ax0.T @ g_pre + wd * p["w0"]
    g["b0"] = g_pre.sum(0)
    return loss, g


class Adam:
    """Kingma & Ba's Adam with bias correction, eps outside the square root."""

    def __init__(self, lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
        self.lr, self.b1, self.b2, self.eps, self.t = lr, b1, b2, eps, 0
        self.m: dict = {}
        self.v: dict = {}

    def step(self, p: dict, g: dict) -> dict:
        self.t += 1
        out = {}
        for k in p:
            self.m[k] = self.b1 * self.m.get(k, 0.0) + (1 - self.b1) * g[k]
            self.v[k] = self.b2 * self.v.get(k, 0.0) + (1 - self.b2) * g[k] ** 2
            mh = self.m[k] / (1 - self.b1 ** self.t)
            vh = self.v[k] / (1 - self.b2 ** self.t)
            out[k] = p[k] - self.lr * mh / (np.sqrt(vh) + self.eps)
        return out


def predict(p: dict, a, x) -> np.ndarray:
    h = np.maximum(a @ x @ p["w0"] + p["b0"], 0.0)
    return (a @ h @ p["w1"] + p["b1"]).argmax(1)


def train(graph, *, hidden: int = 16, lr: float = 0.01, wd: float = 5e-4, rate: float = 0.5, epochs: int = 200,
          patience: int = 100, seed: int = 0, feature_norm: str = "row") -> dict:
    """Full-batch training; test accuracy at the best validation epoch (accuracy, then loss), as the trainer."""
    rng = np.random.default_rng(seed)
    a = normalized_adjacency(graph.adj)
    x = graph.features.astype(np.float64)
    x = row_normalized(x) if feature_norm == "row" else x
    y = graph.labels
    p = init(rng, x.shape[1], hidden, graph.num_classes)
    opt = Adam(lr)
    best, best_row, bad = None, None, 0
    for epoch in range(epochs):
        keep0 = rng.random(x.shape) >= rate
        keep1 = rng.random((x.shape[0], hidden)) >= rate
        _, g = loss_and_grads(p, a, x, y, graph.train_mask, wd, keep0, keep1, rate)
        p = opt.step(p, g)
        pred = predict(p, a, x)
        val_loss, _ = loss_and_grads(p, a, x, y, graph.val_mask, 0.0)
        row = {"epoch": epoch, "val_acc": float((pred == y)[graph.val_mask].mean()),
               "test_acc": float((pred == y)[graph.test_mask].mean())}
        key = (row["val_acc"], -val_loss)
        if best is None or key > best:
            best, best_row, bad = key, row, 0
        else:
            bad += 1
            if patience and bad >= patience:
                break
    return {"best_epoch": best_row["epoch"], "test_acc": best_row["test_acc"], "epochs": epoch + 1}


def trainer_params(model, params) -> dict:
    """The trainer's two-layer GCN parameters under the reference's names (weights by layer, each layer's bias
    wherever the trainer's stage order put it: b_out of its AV, or b_in of the next tensor stage)."""
    out = {}
    for st in model.stages:
        p = params.get(st.name, {})
        if st.kind == "AV":
            out[f"w{st.layer}"] = np.asarray(p["w"], np.float64)
            if "b_out" in p:
                out[f"b{st.layer}"] = np.asarray(p["b_out"], np.float64)
        if "b_in" in p:
            out[f"b{st.layer - 1 if st.kind == 'AV' else st.layer}"] = np.asarray(p["b_in"], np.float64)
    return out


def _trainer_run(graph, cfg, dropout: bool):
    """The trainer's model, inputs and initial weights for cfg, with dropout switched off if asked."""
    import jax

    from pipelines.train import build_model, model_inputs

    model = build_model(cfg, graph)
    if not dropout:
        model = model._replace(stages=tuple(dataclasses.replace(s, rate=0.0) for s in model.stages))
    x, a = model_inputs(cfg, graph)
    return model, x, a, model.init(jax.random.PRNGKey(cfg.seed))


def _keep_masks(model, seeds, n: int):
    """The trainer's dropout keep-masks for the inputs of each AV stage (counter-based, so recomputable)."""
    import jax.numpy as jnp

    from ops import dense

    return [np.asarray(dense.random_bits(jnp.uint32(seeds[st.index]), jnp.arange(n),
                                         jnp.arange(st.in_dim, dtype=jnp.uint32))) >= st.rate
            for st in model.stages if st.kind == "AV"]


def _reference_inputs(graph, cfg):
    from pipelines.data.features import resolve_feature_norm  # the trainer's choice for "auto", as it makes it

    x = graph.features.astype(np.float64)
    norm = resolve_feature_norm(graph.features, cfg.feature_norm)
    return normalized_adjacency(graph.adj), row_normalized(x) if norm == "row" else x


def compare_one_step(graph, cfg, dropout: bool = True) -> dict:
    """Loss and per-parameter gradients (with the L2 term) of one trainer step beside the reference's, from the
    same initial weights and the same dropout masks. The trainer's gradient is read off its own jitted step
    run with the trainer's weight decay followed by SGD(lr=1): params_before - params_after."""
    import jax
    import jax.numpy as jnp
    import optax

    from ops.optim import dropout_seeds, l2_decay
    from ops.sparse import Adjacency
    from pipelines.train import make_train_step

    model, x, a, params = _trainer_run(graph, cfg, dropout)
    p_ref = trainer_params(model, params)
    seeds = dropout_seeds(cfg.seed, 0, len(model.stages))
    mask = model.decay_mask(params)
    tx = optax.chain(l2_decay(cfg.weight_decay, mask), optax.sgd(1.0))
    before = jax.tree_util.tree_map(np.array, params)
    after, _, loss = make_train_step(model, tx)(
        params, tx.init(params), Adjacency.from_scipy(a).to_device(), jnp.asarray(x), jnp.asarray(graph.labels),
        jnp.asarray(graph.train_mask), jnp.asarray(seeds))
    g_tr = trainer_params(model, jax.tree_util.tree_map(lambda u, v: np.asarray(u) - np.asarray(v), before, after))
    a_ref, x_ref = _reference_inputs(graph, cfg)
    keeps = _keep_masks(model, seeds, x.shape[0]) if dropout else [None, None]
    loss_ref, g_ref = loss_and_grads(p_ref, a_ref, x_ref, graph.labels, graph.train_mask, cfg.weight_decay,
                                     *keeps, rate=cfg.dropout if dropout else 0.0)
    decayed = sorted(k for k, v in trainer_params(model, mask).items() if bool(v))
    l2 = cfg.weight_decay / 2 * sum(float(np.sum(p_ref[k] ** 2)) for k in decayed)
    row = {"loss_trainer": float(loss) + l2, "loss_reference": float(loss_ref), "decayed_trainer": decayed,
           "decayed_reference": ["w0"]}
    for k in PARAMS:
        row[k] = {"grad_norm_trainer": float(np.linalg.norm(g_tr[k])),
                  "grad_norm_reference": float(np.linalg.norm(g_ref[k])),
                  "max_abs_diff": float(np.abs(g_tr[k] - g_ref[k]).max())}
    return row


def compare_steps(graph, cfg, steps: int) -> list[dict]:
    """Weights after each of `steps` trainer epochs (its own optimizer, its dropout) beside the reference's
    Adam from the same start with the same masks: the largest absolute difference per parameter."""
    import jax
    import jax.numpy as jnp

    from ops.optim import dropout_seeds, make_optimizer
    from ops.sparse import Adjacency
    from pipelines.train import make_train_step

    model, x, a, params = _trainer_run(graph, cfg, True)
    p_ref = trainer_params(model, params)
    tx = make_optimizer(cfg.lr, cfg.weight_decay, model.decay_mask(params))
    step, state = make_train_step(model, tx), tx.init(params)
    adj, xj = Adjacency.from_scipy(a).to_device(), jnp.asarray(x)
    labels, train_mask = jnp.asarray(graph.labels), jnp.asarray(graph.train_mask)
    a_ref, x_ref = _reference_inputs(graph, cfg)
    opt, rows = Adam(cfg.lr), []
    for epoch in range(steps):
        seeds = dropout_seeds(cfg.seed, epoch, len(model.stages))
        params, state, loss = step(params, state, adj, xj, labels, train_mask, jnp.asarray(seeds))
        _, g = loss_and_grads(p_ref, a_ref, x_ref, graph.labels, graph.train_mask, cfg.weight_decay,
                              *_keep_masks(model, seeds, x.shape[0]), rate=cfg.dropout)
        p_ref = opt.step(p_ref, g)
        p_tr = trainer_params(model, jax.tree_util.tree_map(np.asarray, params))
        rows.append({"epoch": epoch, "loss_trainer": float(loss),
                     **{k: float(np.abs(p_tr[k] - p_ref[k]).max()) for k in PARAMS}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", default="cora")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--patience", type=int, default=100)
    ap.add_argument("--feature-norm", choices=["row", "none"], default="row")
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args(argv)

    from pipelines.data.registry import load_dataset

    for seed in range(args.seeds):
        graph = load_dataset(args.dataset, args.data_dir, seed=seed)
        r = train(graph, hidden=args.hidden, lr=args.lr, wd=args.weight_decay, rate=args.dropout,
                  epochs=args.epochs, patience=args.patience, seed=seed, feature_norm=args.feature_norm)
        print(json.dumps({"bench": "reference-gcn", "dataset": args.dataset, "seed": seed, "hidden": args.hidden,
                          "weight_decay": args.weight_decay, "feature_norm": args.feature_norm, **r}), flush=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
