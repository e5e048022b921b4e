"""Tensor tasks as pure jitted functions: a stage's forward, its VJP, and the fused last layer (AV + loss + ∇AV).

A task may run a chain of consecutive row-local AV stages (`ops.models.tensor_groups`, named by
``meta["stages"]`` with one dropout seed each in ``meta["seeds"]``): one task, one round trip, and only the
chain's input and output cross the wire. Row-local tasks may arrive unpadded (``meta["rows"]`` is the static
row count they are padded back to here, so every kernel compiles once).

These are what a tensor worker runs, in the local pool or on AWS Lambda: each takes the stage, its stashed
parameters and the task's arrays, and returns arrays. Backward tasks recompute the stage's forward from the
inputs the graph server kept (as Dorylus's Lambdas do) and return parameter and input gradients; an AV_BWD on a
worker that kept its forward's residuals (`Saved`: the local pools do) skips that forward's matrix products.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ops import dense, models, xla
from ops.models import Stage
from schemas.tasks import StageKind, TaskKind


class Rows(NamedTuple):
    """What a row-local stage needs of its block: the global ids of its rows (dropout keys)."""

    row_gids: jax.Array


def _stage_call(stage: Stage):
    def f(p, inputs, adj, seed):
        return models.run_stage(stage, {stage.name: p}, inputs, adj, seed)

    return f


def _vjp_wrt(f, wrt_inputs: tuple[str, ...]):
    """jit(g(params, inputs, a, b, out_grads) -> (param_grads, input_grads)) for f(params, inputs, a, b): the VJP
    with respect to the params and the inputs named in wrt_inputs only (the others are held constant)."""

    def g(p, inputs, a, b, out_grads):
        const = {k: v for k, v in inputs.items() if k not in wrt_inputs}
        var = {k: v for k, v in inputs.items() if k in wrt_inputs}

        def h(p, var):
            out = f(p, {**const, **var}, a, b)
            return {k: out[k] for k in out_grads}

        _, pullback = jax.vjp(h, p, var)
        return pullback(out_grads)

    return xla.jit(g)


@functools.lru_cache(maxsize=None)
def forward_fn(stage: Stage, train: bool = True):
    """jit(f(params, inputs, block, seed) -> outputs) for one stage (AV, AE or GA)."""
    f = _stage_call(stage)
    if not train:
        return xla.jit(lambda p, inputs, adj: f(p, inputs, adj, None))
    return xla.jit(f)


@functools.lru_cache(maxsize=None)
def backward_fn(stage: Stage, wrt_inputs: tuple[str, ...]):
    """jit(g(params, inputs, block, seed, out_grads) -> (param_grads, input_grads)) for one stage.

    wrt_inputs names the inputs whose gradient is needed; the others (features, say) are held constant, so no
    work is spent on gradients nobody reads (∇GA of the first layer over the input features, for one).
    """
    return _vjp_wrt(_stage_call(stage), wrt_inputs)


@functools.lru_cache(maxsize=None)
def gather_transpose_fn(aggregator: str = "sum", rate: float = 0.0):
    """jit(∇GA(block, g, seed)) for an unweighted GA stage (Aᵀ·g for GCN's "sum"), through the stage's input
    dropout (`Stage.rate`, the same counter-based masks as the forward's). GA is linear in its input, so the
    graph server keeps no forward inputs for it."""
    from ops.sparse import gather_mean_transpose, gather_transpose

    base = gather_transpose if aggregator == "sum" else functools.partial(gather_mean_transpose,
                                                                          aggregator=aggregator)
    return xla.jit(lambda adj, g, seed: dense.dropout(base(adj, g), rate, seed, adj.col_gids))


@functools.lru_cache(maxsize=None)
def loss_fn(loss_stage: Stage, av_stage: Stage | None):
    """jit of the last tensor task: [AV +] loss + gradients, Dorylus's fused last layer when av_stage is given.

    l(params, h, rows, labels, mask, seed, scale) -> (loss_sum, count, correct, param_grads, dh)
    where loss_sum is the masked cross-entropy sum over the block's rows and the gradients are of
    scale · loss_sum (scale = 1 / number of training vertices in the whole graph, so block gradients add up).
    """

    def objective(p, h, rows, labels, mask, seed, scale):
        if av_stage is not None:
            h = models.run_stage(av_stage, p, {"h": h}, rows, seed)["h"]
        logits = models.logits_of(loss_stage, p, h)
        s, n = dense.softmax_cross_entropy(logits, labels, mask)
        return s * scale, (s, n, dense.correct_count(logits, labels, mask))

    def l(p, h, rows, labels, mask, seed, scale):
        (_, (s, n, c)), (gp, gh) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
            p, h, rows, labels, mask, seed, scale)
        return s, n, c, gp, gh

    return xla.jit(l)


def _chain_call(stages: tuple[Stage, ...]):
    def f(p, inputs, rows, seeds):
        state = inputs
        for k, st in enumerate(stages):
            state = models.run_stage(st, p, state, rows, None if seeds is None else seeds[k])
        return state

    return f


@functools.lru_cache(maxsize=None)
def chain_forward_fn(stages: tuple[Stage, ...]):
    """jit(f(params by stage name, inputs, rows, seeds) -> the last stage's outputs) for fused AV stages."""
    return xla.jit(_chain_call(stages))


#: What a saving forward keeps for its backward: the outputs of its matrix products. The elementwise work between
#: them (activations, dropout masks from their counter-based keys) is recomputed in the backward, which costs a
#: fraction of a product; keeping everything would write ~2.6x the bytes (the masks and every activation) and at an
#: interval's shape was measured no faster than recomputing the whole forward.
SAVE_POLICY = jax.checkpoint_policies.dots_saveable


@functools.lru_cache(maxsize=None)
def chain_saving_fn(stages: tuple[Stage, ...], wrt_inputs: tuple[str, ...]):
    """jit(f(params by stage name, inputs, rows, seeds) -> (outputs, pullback)) for one or more fused AV stages.

    `pullback` is a `jax.tree_util.Partial` (its leaves are the saved residuals, `SAVE_POLICY`) that
    `pullback_fn` turns into (param_grads by stage, input_grads for `wrt_inputs`). Every AV task's forward and
    backward go through this one pair of programs: a backward that kept its forward's pullback and one that runs
    the forward again get the same bits, so results do not depend on which one a worker could do."""
    call = _chain_call(stages)

    def f(p, inputs, rows, seeds):
        const = {k: v for k, v in inputs.items() if k not in wrt_inputs}
        var = {k: v for k, v in inputs.items() if k in wrt_inputs}
        saved = jax.checkpoint(lambda p, var: call(p, {**const, **var}, rows, seeds), policy=SAVE_POLICY)
        return jax.vjp(saved, p, var)

    return xla.jit(f)


@functools.lru_cache(maxsize=None)
def pullback_fn():
    """jit(g(pullback, out_grads) -> (param_grads, input_grads)): the backward of a `chain_saving_fn` forward;
    out_grads must name every output (zeros for those no later stage reads)."""
    return xla.jit(lambda pullback, out_grads: pullback(out_grads))


def pullback_bytes(pullback) -> int:
    """Bytes of the residuals a pullback holds."""
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(pullback))


@functools.lru_cache(maxsize=None)
def loss_chain_fn(loss_stage: Stage, av_stages: tuple[Stage, ...]):
    """`loss_fn` with a chain of fused AV stages before the loss (one dropout seed per stage)."""
    chain = _chain_call(av_stages)

    def objective(p, h, rows, labels, mask, seeds, scale):
        h = chain(p, {"h": h}, rows, seeds)["h"]
        logits = models.logits_of(loss_stage, p, h)
        s, n = dense.softmax_cross_entropy(logits, labels, mask)
        return s * scale, (s, n, dense.correct_count(logits, labels, mask))

    def l(p, h, rows, labels, mask, seeds, scale):
        (_, (s, n, c)), (gp, gh) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
            p, h, rows, labels, mask, seeds, scale)
        return s, n, c, gp, gh

    return xla.jit(l)


def task_stages(model: models.Model, stage_index: int, meta: dict) -> tuple[int, ...]:
    """The stages a task runs: ``meta["stages"]`` (consecutive AV stages starting at the task's stage) or its
    stage alone."""
    chain = meta.get("stages")
    if chain is None:
        return (stage_index,)
    chain = tuple(int(k) for k in chain)
    n = len(model.stages)
    if (not chain or chain[0] != stage_index or list(chain) != list(range(chain[0], chain[0] + len(chain)))
            or not all(0 <= k < n and model.stages[k].kind == StageKind.AV for k in chain)):
        raise ValueError(f"meta.stages {list(chain)} is not a run of consecutive AV stages from stage {stage_index}")
    return chain


def _seeds(meta: dict, chain: tuple[int, ...]):
    if meta.get("seed") is None:
        return None
    seeds = meta.get("seeds", [meta["seed"]])
    if len(seeds) != len(chain):
        raise ValueError(f"meta.seeds has {len(seeds)} seeds for {len(chain)} stages")
    # numpy scalars and arrays, not jnp's: jit takes them as they are, where jnp's constructors run eager ops
    # (a dispatch each, holding the GIL) on every task
    return np.asarray(seeds, np.uint32)


ROW_LOCAL_KINDS = (TaskKind.AV, TaskKind.AV_BWD, TaskKind.LAST, TaskKind.LOSS)


def pad_rows(arrays: dict, rows: int) -> tuple[dict, int]:
    """Row-local task arrays sent unpadded (n rows) -> padded to `rows`: zeros, row ids -1 (as the graph
    server's own padding), so the kernels see the static shape they compiled for. Returns (arrays, n)."""
    n = int(arrays["row_gids"].shape[0])
    if n > rows:
        raise ValueError(f"the task has {n} rows, more than meta.rows = {rows}")
    if n == rows:
        return arrays, n
    out = {}
    for k, v in arrays.items():
        v = np.asarray(v)
        pad = np.empty((rows, *v.shape[1:]), v.dtype)  # one pass over the rows: copy, then fill the tail
        pad[:n] = v
        pad[n:] = -1 if k == "row_gids" else 0
        out[k] = pad
    return out, n


def zeros_like_outputs(outputs: dict) -> dict:
    return {k: jnp.zeros_like(v) for k, v in outputs.items()}


def block_from_arrays(arrays: dict, rows: int, cols: int):
    """An Adjacency for edge-local tasks (AE) from a task's arrays; the transpose is not needed there."""
    from ops.sparse import Adjacency

    nnz = arrays["data"].shape[0]
    z = jnp.zeros((nnz,), jnp.int32)
    return Adjacency(arrays["data"], arrays["indices"], arrays["indptr"], arrays["row_ids"], z,
                     jnp.zeros((cols + 1,), jnp.int32), z, arrays["row_gids"], arrays["col_gids"], (rows, cols))


BLOCK_ARRAYS = ("data", "indices", "indptr", "row_ids", "row_gids", "col_gids")


class Saved(NamedTuple):
    """An AV forward's pullback (`chain_saving_fn`) and the shapes and dtypes of the outputs it pulls back."""

    pullback: object
    outputs: dict

    @property
    def nbytes(self) -> int:
        return pullback_bytes(self.pullback)


def run_tensor_task(model: models.Model, kind: str, stage_index: int, params: dict, arrays: dict,
                    meta: dict, keep=None, saved: Saved | None = None) -> tuple[dict, dict, dict]:
    """Run one tensor task; returns (result arrays for the graph server, parameter gradients by stage name,
    scalar statistics). kinds: AV, AE (forward), LAST (fused AV + loss + backward), LOSS, AV_BWD, AE_BWD.

    A worker that can hold state between tasks passes `keep` (called with an AV forward's `Saved`) and hands
    an AV_BWD the `saved` its forward kept: the backward then skips the forward's matrix products. Without
    `saved` the backward runs the forward's program again; both give the same bits."""
    st = model.stages[stage_index]
    if meta.get("rows") is not None and kind in ROW_LOCAL_KINDS and st.kind != StageKind.AE:
        if saved is not None:  # a kept forward: the backward reads its output gradients alone
            arrays = {k: v for k, v in arrays.items() if k.startswith("g_") or k == "row_gids"}
        arrays, n = pad_rows(arrays, int(meta["rows"]))
        out, grads, scalars = run_tensor_task(model, kind, stage_index, params, arrays,
                                              {k: v for k, v in meta.items() if k != "rows"}, keep, saved)
        # sliced on the host: a device slice compiles once per distinct row count, and a growing graph (or
        # intervals of unequal sizes) has many
        return {k: np.asarray(v)[:n] for k, v in out.items()}, grads, scalars
    chain = task_stages(model, stage_index, meta)
    if st.kind == StageKind.AV and kind in (TaskKind.AV, TaskKind.AV_BWD):
        return _run_av(model, kind, chain, params, arrays, meta, keep, saved)
    if len(chain) > 1:
        return _run_chain(model, kind, chain, params, arrays, meta)
    seed = None if meta.get("seed") is None else np.uint32(meta["seed"])
    if kind in (TaskKind.LAST, TaskKind.LOSS):
        loss_stage = model.stages[-1]
        av = st if kind == TaskKind.LAST else None
        names = [s.name for s in (av, loss_stage) if s is not None and s.has_params]
        p = {n: params[n] for n in names}
        s, n, c, gp, gh = loss_fn(loss_stage, av)(p, arrays["h"], Rows(arrays["row_gids"]), arrays["labels"],
                                                  arrays["mask"], seed, np.float32(meta["scale"]))
        return {"dh": gh}, gp, {"loss_sum": float(s), "count": float(n), "correct": float(c)}
    p = params.get(st.name, {})
    if st.kind == StageKind.AE:
        adj = block_from_arrays(arrays, arrays["s_dst"].shape[0], arrays["s_src"].shape[0])
        inputs = {"s_src": arrays["s_src"], "s_dst": arrays["s_dst"]}
    else:
        raise ValueError(f"stage {st.index} is {st.kind}, not a tensor stage")
    if kind in (TaskKind.AV, TaskKind.AE):
        return dict(forward_fn(st)(p, inputs, adj, seed)), {}, {}
    if kind in (TaskKind.AV_BWD, TaskKind.AE_BWD):
        out_grads = {k[2:]: v for k, v in arrays.items() if k.startswith("g_")}
        wrt = tuple(meta.get("wrt", ()))
        gp, gin = backward_fn(st, wrt)(p, inputs, adj, seed, out_grads)
        return {f"d_{k}": v for k, v in gin.items()}, ({st.name: gp} if st.has_params else {}), {}
    raise ValueError(f"unknown tensor task kind {kind!r}")


def _run_chain(model: models.Model, kind: str, chain: tuple[int, ...], params: dict, arrays: dict,
               meta: dict) -> tuple[dict, dict, dict]:
    """A task over fused AV stages (AV, AV_BWD, or LAST when the chain ends right before the loss)."""
    stages = tuple(model.stages[k] for k in chain)
    seeds = _seeds(meta, chain)
    rows = Rows(arrays["row_gids"])
    names = [st.name for st in stages if st.has_params]
    if kind == TaskKind.LAST:
        loss_stage = model.stages[-1]
        if chain[-1] != len(model.stages) - 2:
            raise ValueError(f"LAST task over stages {list(chain)}: the chain must end right before the loss")
        p = {nm: params[nm] for nm in names + ([loss_stage.name] if loss_stage.has_params else [])}
        s, n, c, gp, gh = loss_chain_fn(loss_stage, stages)(p, arrays["h"], rows, arrays["labels"], arrays["mask"],
                                                             seeds, np.float32(meta["scale"]))
        return {"dh": gh}, gp, {"loss_sum": float(s), "count": float(n), "correct": float(c)}
    raise ValueError(f"{kind} task cannot run fused stages {list(chain)}")


def _run_av(model: models.Model, kind: str, chain: tuple[int, ...], params: dict, arrays: dict, meta: dict,
            keep, saved: Saved | None) -> tuple[dict, dict, dict]:
    """An AV forward or AV_BWD over one AV stage or a chain of them, through `chain_saving_fn`."""
    stages = tuple(model.stages[k] for k in chain)
    wrt = tuple(meta.get("wrt", ()))
    if saved is None:
        p = {st.name: params[st.name] for st in stages if st.has_params}
        out, pullback = chain_saving_fn(stages, wrt)(p, {"h": arrays["h"]}, Rows(arrays["row_gids"]),
                                                     _seeds(meta, chain))
        saved = Saved(pullback, {k: (v.shape, v.dtype) for k, v in out.items()})
        if kind == TaskKind.AV:
            if keep is not None:
                keep(saved)
            return dict(out), {}, {}
    if kind != TaskKind.AV_BWD:
        raise ValueError(f"{kind} task was handed a saved forward")
    out_grads = {k[2:]: v for k, v in arrays.items() if k.startswith("g_")}
    if set(out_grads) - set(saved.outputs):
        raise ValueError(f"AV_BWD names gradients of {sorted(set(out_grads) - set(saved.outputs))}, which the "
                         f"stage does not write")
    # every output needs a cotangent: zeros for those no later stage reads
    out_grads = {k: out_grads[k] if k in out_grads else np.zeros(shape, dtype)
                 for k, (shape, dtype) in saved.outputs.items()}
    gp, gin = pullback_fn()(saved.pullback, out_grads)
    return {f"d_{k}": v for k, v in gin.items()}, dict(gp), {}
