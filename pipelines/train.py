"""The whole-graph trainer: one partition, one interval, the model's stages composed into one jitted step."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ops import dense, models
from ops.optim import dropout_seeds, make_optimizer
from ops.sparse import Adjacency
from pipelines import rundir
from pipelines.config import TrainConfig
from pipelines.data.features import normalize_features
from pipelines.data.graph import Graph, gcn_normalize


def build_model(cfg: TrainConfig, graph: Graph) -> models.Model:
    """The model a config names, sized for a graph."""
    if cfg.model == "gcn":
        hidden = (cfg.hidden,) * (cfg.layers - 1)
        return models.gcn(graph.feature_dim, hidden, graph.num_classes, dropout=cfg.dropout, order=cfg.order)
    return models.gat(graph.feature_dim, cfg.hidden, graph.num_classes, heads=cfg.heads, out_heads=cfg.out_heads,
                      layers=cfg.layers, dropout=cfg.dropout)


def model_inputs(cfg: TrainConfig, graph: Graph):
    """Features after the configured normalization ("auto": chosen from the features), and the normalized adjacency the model gathers over.

    GCN gathers over Â = D^-1/2 (A+I) D^-1/2; GAT over A+I with unit values (its weights are attention).
    """
    x = normalize_features(graph.features, cfg.feature_norm)
    a = gcn_normalize(graph.adj)
    if cfg.model == "gat":
        a = a.copy()
        a.data[:] = 1.0
    return x, a


@dataclasses.dataclass
class TrainResult:
    params: dict
    best_params: dict
    history: list[dict]
    summary: dict
    opt_state: object = None    # the optimizer state after the last step (warm starts continue from it)


def _tree_to_npz(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    return {f"{prefix}{k}/{n}": np.asarray(v) for k, p in params.items() for n, v in p.items()}


def npz_to_tree(arrays) -> dict:
    out: dict = {}
    for key in arrays.files if hasattr(arrays, "files") else arrays:
        stage, name = key.split("/", 1)
        out.setdefault(stage, {})[name] = jnp.asarray(arrays[key])
    return out


def make_train_step(model: models.Model, tx):
    """One jitted full-graph epoch: forward, masked loss, backward through every stage, optimizer update."""

    def step(params, opt_state, adj, x, labels, train_mask, seeds):
        def loss_fn(p):
            logits = models.forward(model, p, adj, x, seeds)
            s, n = dense.softmax_cross_entropy(logits, labels, train_mask)
            return s / jnp.maximum(n, 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


class Evaluator:
    """Jitted evaluation (no dropout): loss and correct counts for train/val/test masks in one pass."""

    def __init__(self, model: models.Model):
        def evaluate(params, adj, x, labels, masks):
            logits = models.forward(model, params, adj, x, None)
            out = []
            for m in masks:
                s, n = dense.softmax_cross_entropy(logits, labels, m)
                out.append((s, n, dense.correct_count(logits, labels, m)))
            return out

        self.fn = jax.jit(evaluate)

    def __call__(self, params, adj, x, labels, masks) -> dict:
        res = self.fn(params, adj, x, labels, masks)
        names = ("train", "val", "test")
        row = {}
        for name, (s, n, c) in zip(names, res):
            n = max(float(n), 1.0)
            row[f"{name}_loss"] = float(s) / n
            row[f"{name}_acc"] = float(c) / n
        return row


class EarlyStopping:
    """Tracks the best validation epoch (higher accuracy, then lower loss) and stops after `patience` epochs."""

    def __init__(self, patience: int):
        self.patience = patience
        self.best = None
        self.best_epoch = -1
        self.bad = 0

    def update(self, epoch: int, row: dict) -> bool:
        key = (row["val_acc"], -row["val_loss"])
        if self.best is None or key > self.best:
            self.best, self.best_epoch, self.bad = key, epoch, 0
            return True
        self.bad += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience


def progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="epoch", leave=False, dynamic_ncols=True)


def train(cfg: TrainConfig, graph: Graph, out: Path | None = None, show_progress: bool = False,
          init_params: dict | None = None, init_opt_state=None) -> TrainResult:
    """Full-graph training on one machine; writes metrics, weights and the summary into `out` if given.

    init_params / init_opt_state (optional) warm-start from earlier weights and optimizer state (continuous
    training continues each round from the previous one); by default both are initialized from cfg.seed."""
    model = build_model(cfg, graph)
    x, a = model_inputs(cfg, graph)
    adj = Adjacency.from_scipy(a).to_device()
    x = jnp.asarray(x)
    labels = jnp.asarray(graph.labels)
    masks = tuple(jnp.asarray(m) for m in (graph.train_mask, graph.val_mask, graph.test_mask))
    params = model.init(jax.random.PRNGKey(cfg.seed))
    if init_params is not None:
        params = jax.tree_util.tree_map(jnp.array, init_params)  # copies: the step donates its inputs
    tx = make_optimizer(cfg.lr, cfg.weight_decay, model.decay_mask(params))
    opt_state = tx.init(params) if init_opt_state is None else jax.tree_util.tree_map(jnp.array, init_opt_state)

    step = make_train_step(model, tx)
    evaluator = Evaluator(model)

    log = rundir.MetricsLog(out / "metrics.jsonl") if out is not None else None
    stopper = EarlyStopping(cfg.patience)
    history: list[dict] = []
    best_params = params
    t_start = time.perf_counter()
    jit_s = 0.0
    bar = progress(cfg.epochs, show_progress, f"{graph.name} {cfg.model}")
    try:
        for epoch in range(cfg.epochs):
            seeds = jnp.asarray(dropout_seeds(cfg.seed, epoch, len(model.stages)))
            t0 = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, adj, x, labels, masks[0], seeds)
            loss = float(loss)
            dt = time.perf_counter() - t0
            if epoch == 0:
                jit_s = dt  # the first step compiles; epoch_s below excludes it on later epochs
            row = {"epoch": epoch, "loss": loss, **evaluator(params, adj, x, labels, masks), "epoch_s": dt}
            history.append(row)
            if log:
                log.write(row)
            if stopper.update(epoch, row):
                best_params = jax.tree_util.tree_map(np.array, params)  # a copy: params are donated next step
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", val=f"{row['val_acc']:.3f}")
            if stopper.should_stop:
                break
    finally:
        bar.close()
        if log:
            log.close()
    seconds = time.perf_counter() - t_start
    best = history[stopper.best_epoch]
    epoch_times = [r["epoch_s"] for r in history[1:]] or [history[0]["epoch_s"]]
    summary = {
        "status": "complete",
        "dataset": graph.summary(),
        "model": cfg.model,
        "engine": "whole-graph",
        "epochs": len(history),
        "best_epoch": stopper.best_epoch,
        "best_val_acc": best["val_acc"],
        "test_acc": best["test_acc"],
        "train_acc": best["train_acc"],
        "final_loss": history[-1]["loss"],
        "seconds": seconds,
        "jit_s": jit_s,
        "epoch_s_median": float(np.median(epoch_times)),
        "seed": cfg.seed,
    }
    if out is not None:
        rundir.atomic_write_npz(out / "weights.npz", _tree_to_npz(best_params))
        rundir.atomic_write_json(out / "summary.json", summary)
    params = jax.tree_util.tree_map(np.asarray, params)
    opt_state = jax.tree_util.tree_map(np.asarray, opt_state)
    return TrainResult(params, best_params, history, summary, opt_state)
