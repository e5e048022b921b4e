"""The whole-graph trainer: one partition, one interval, the model's stages composed into one jitted step."""
from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ops import dense, models, xla
from ops.optim import dropout_seeds, make_optimizer
from ops.spec import ModelSpec
from pipelines import rundir
from pipelines.config import TrainConfig
from pipelines.data.graph import Graph, release_free_memory
from pipelines.epochs import (EarlyStopping, Evaluator, TrainResult, device_graph, model_inputs,  # noqa: F401
                              progress, summary_head, write_result)


def build_model(cfg: TrainConfig, graph: Graph) -> models.Model:
    """The model a config names, sized for a graph (`ops.spec.ModelSpec.for_graph(cfg, graph).build()`)."""
    return ModelSpec.for_graph(cfg, graph).build()


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

    return xla.jit(step, donate_argnums=(0, 1))


def train(cfg: TrainConfig, graph: Graph, out: Path | None = None, show_progress: bool = False,
          init_params: dict | None = None, init_opt_state=None) -> TrainResult:
    """Full-graph training on one machine; writes metrics, weights and the summary into `out` if given.

    init_params / init_opt_state (optional) warm-start from earlier weights and optimizer state (continuous
    training continues each round from the previous one); by default both are initialized from cfg.seed."""
    model = build_model(cfg, graph)
    g = device_graph(cfg, graph)
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
            params, opt_state, loss = step(params, opt_state, g.adj, g.train_input, g.labels, g.masks[0], seeds)
            loss = float(loss)
            dt = time.perf_counter() - t0
            if epoch == 0:
                jit_s = dt  # the first step compiles; epoch_s below excludes it on later epochs
                release_free_memory()   # the compiler's freed heap, before later peaks stand on it
            row = {"epoch": epoch, "loss": loss, **evaluator.on(g, params), "epoch_s": dt}
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
    summary = summary_head(cfg, graph, "whole-graph", history, stopper.best_epoch, seconds, jit_s=jit_s)
    write_result(out, best_params, summary)
    params = jax.tree_util.tree_map(np.asarray, params)
    opt_state = jax.tree_util.tree_map(np.asarray, opt_state)
    return TrainResult(params, best_params, history, summary, opt_state)
