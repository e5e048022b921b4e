"""What every trainer shares per epoch and at its end: the device copy of the graph, evaluation, early
stopping, the progress bar, the summary's common keys and the run directory's weights and summary.

The whole-graph trainer (`pipelines.train`) and the engine's epoch driver (`pipelines.engine.driver`, used by
the in-memory engine and the Kafka driver) both build on these, so an epoch's row, the best-epoch rule and the
summary mean the same in every run directory.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ops import dense, models, xla
from ops import params as P
from ops.host import host_empty
from ops.sparse import Adjacency
from ops.spec import ModelSpec
from pipelines import rundir
from pipelines.config import TrainConfig
from pipelines.data.features import normalize_features
from pipelines.data.graph import Graph, gcn_normalize, locality_order, permute_symmetric, release_free_memory

#: an epoch's accuracy columns when the driver skips evaluation (benchmarks time the pipeline alone)
NO_EVALUATION = {"train_acc": None, "val_acc": 0.0, "val_loss": 0.0, "test_acc": None}


@dataclasses.dataclass
class TrainResult:
    """params: the weights after the last epoch; best_params: those of the best validation epoch; history:
    one row per epoch (as in metrics.jsonl); summary: as in summary.json."""

    params: dict
    best_params: dict
    history: list[dict]
    summary: dict
    opt_state: object = None    # the optimizer state after the last step (warm starts continue from it)


def model_inputs(cfg: TrainConfig, graph: Graph):
    """Features after the configured normalization ("auto": chosen from the features), and the normalized
    adjacency the model gathers over.

    GCN gathers over Â = D^-1/2 (A+I) D^-1/2; GAT over A+I with unit values (its weights are attention);
    GraphSAGE over Â too, taking its mean (D^-1 A) and self-loops from Â's structure.
    """
    x = normalize_features(graph.features, cfg.feature_norm)
    a = gcn_normalize(graph.adj)
    if cfg.model == "gat":
        a = a.copy()
        a.data[:] = 1.0
    return x, a


class DeviceGraph(NamedTuple):
    """The whole graph on the device: adjacency, features (or their `models.constant_prefix`), labels and the
    (train, val, test) masks; x_train: what a training forward reads where it differs from x (the features when
    the first layer drops them before its GA, so Â·X is an evaluation-only prefix), else None."""

    adj: Adjacency
    x: jax.Array
    labels: jax.Array
    masks: tuple
    x_train: jax.Array | None = None

    @property
    def train_input(self):
        """The input of a training forward (`x_train`, else `x`)."""
        return self.x if self.x_train is None else self.x_train


def device_graph(cfg: TrainConfig, graph: Graph) -> DeviceGraph:
    """The model's inputs (`model_inputs`) and the graph's labels and masks as device arrays."""
    x, a = model_inputs(cfg, graph)
    labels, masks = graph.labels, (graph.train_mask, graph.val_mask, graph.test_mask)
    perm = locality_order(graph.adj)
    if perm is not None:
        # Vertices renumbered for the gather's locality; the row ids (global ids) keep the original numbering,
        # so dropout draws the same masks and only summation orders change.
        a = permute_symmetric(a, perm)
        x = np.take(x, perm, axis=0, out=host_empty(x.shape, x.dtype))
        labels, masks = labels[perm], tuple(m[perm] for m in masks)
    # GCN's and GraphSAGE's Â is symmetric with fixed values: its own transpose. GAT's values are attention.
    adj = Adjacency.from_scipy(a, row_gids=perm, col_gids=perm, symmetric=cfg.model != "gat").to_device()
    del a
    # Â·X once when the first layer aggregates the raw features (`models.constant_prefix`); X is then dropped
    # unless training drops it out before that GA.
    model = ModelSpec.for_graph(cfg, graph).build()
    x = xla.to_device(x)
    xd = models.constant_prefix(model, adj, x)
    xt = None if models.prefix_length(model, train=True) == models.prefix_length(model) else (
        models.constant_prefix(model, adj, x, train=True))
    del x
    release_free_memory()
    return DeviceGraph(adj, xd, jnp.asarray(labels), tuple(jnp.asarray(m) for m in masks), xt)


class Evaluator:
    """Evaluation (no dropout): loss and correct counts for train/val/test masks in one pass, jitted.

    staged=True runs the forward as jitted pieces (`models.forward_staged`), for a `ops.sparse.Partitioned`
    graph: one program over P blocks kept three times the temporaries and ran 2.6x slower (R-MAT 2^20, P=4:
    322 MB above its inputs and 1.76 s; staged 117 MB and 0.68 s)."""

    def __init__(self, model: models.Model, staged: bool = False):
        def scores(logits, labels, masks):
            out = []
            for m in masks:
                s, n = dense.softmax_cross_entropy(logits, labels, m)
                out.append((s, n, dense.correct_count(logits, labels, m)))
            return out

        if staged:
            scores_fn = xla.jit(scores)
            self.fn = lambda params, adj, x, labels, masks: scores_fn(
                models.forward_staged(model, params, adj, x), labels, masks)
        else:
            self.fn = xla.jit(lambda params, adj, x, labels, masks: scores(
                models.forward(model, params, adj, x, None), labels, masks))

    def __call__(self, params, adj, x, labels, masks) -> dict:
        res = self.fn(params, adj, x, labels, masks)
        names = ("train", "val", "test")
        row = {}
        for name, (s, n, c) in zip(names, res):
            n = max(float(n), 1.0)
            row[f"{name}_loss"] = float(s) / n
            row[f"{name}_acc"] = float(c) / n
        return row

    def on(self, g: DeviceGraph, params) -> dict:
        """The evaluation row of `params` on a device graph."""
        return self(params, g.adj, g.x, g.labels, g.masks)


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
    """A tqdm bar over epochs (disabled unless `enabled`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="epoch", leave=False, dynamic_ncols=True)


def summary_head(cfg: TrainConfig, graph: Graph, engine: str, history: list[dict], best_epoch: int,
                 seconds: float, start: int = 0, **extra) -> dict:
    """The summary keys every run has: what was trained, the best validation epoch's accuracies, the time.

    start: the first epoch this incarnation trained (a resumed run's median skips the epochs before it and its
    first, which compiles); extra: keys inserted after ``seconds`` (e.g. ``jit_s``)."""
    best = history[best_epoch]
    epoch_times = [r["epoch_s"] for r in history[start + 1:]] or [history[-1]["epoch_s"]]
    return {
        "status": "complete",
        "dataset": graph.summary(),
        "model": cfg.model,
        "engine": engine,
        "epochs": len(history),
        "best_epoch": best_epoch,
        "best_val_acc": best["val_acc"],
        "test_acc": best["test_acc"],
        "train_acc": best["train_acc"],
        "final_loss": history[-1]["loss"],
        "seconds": seconds,
        **extra,
        "epoch_s_median": float(np.median(epoch_times)),
        "seed": cfg.seed,
    }


def write_weights(out: Path, params: dict) -> None:
    """weights.npz (atomically): the parameters under their flat ``stage/param`` names."""
    rundir.atomic_write_npz(Path(out) / "weights.npz", P.flatten(params))


def write_result(out: Path | None, best_params: dict, summary: dict) -> None:
    """The end of a run directory: weights.npz of the best epoch, then summary.json (last, atomically)."""
    if out is None:
        return
    write_weights(out, best_params)
    rundir.atomic_write_json(Path(out) / "summary.json", summary)
