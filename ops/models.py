"""GCN, GAT and GraphSAGE as lists of stages (GA, AV, AE, LOSS) that a trainer composes whole or an engine runs per interval."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ops import attention, dense, sparse, xla
from schemas.tasks import StageKind, Step


@dataclasses.dataclass(frozen=True)
class Stage:
    """One task kind of one layer, in execution order.

    kind: a `schemas.tasks.StageKind`: AV (tensor worker, row-local), AE (tensor worker, edge-local over a
      block's rows), GA (graph server, needs ghost columns), LOSS (tensor worker, row-local; fused with a directly
      preceding AV into Dorylus's fused last-layer task).
    reads_cols: vertex tensors this stage reads at column positions, i.e. the ones that need ghosts (SC).
    rate: dropout on the stage's input: an AV's rows, an AE's attention, or an unweighted GA's source rows
      (Kipf's Â·dropout(H)·W in a GA-first layer, keyed by each column's global id so every partition holding a
      ghost row draws its owner's mask).
    """

    kind: StageKind
    layer: int
    index: int
    name: str
    in_dim: int = 0
    out_dim: int = 0
    heads: int = 0
    act_in: str | None = None
    act_out: str | None = None
    b_in: bool = False
    b_out: bool = False
    rate: float = 0.0
    weighted: bool = False
    concat_heads: bool = False
    negative_slope: float = 0.2
    aggregator: str = "sum"     # GA: "sum" (Â-weighted), "mean-concat" or "mean-add" (GraphSAGE, see sparse.py)

    @property
    def reads_cols(self) -> tuple[str, ...]:
        if self.kind == StageKind.GA:
            return ("h",)
        if self.kind == StageKind.AE:
            return ("s_src",)
        return ()

    @property
    def has_params(self) -> bool:
        return self.kind in (StageKind.AV, StageKind.LOSS) and (self.kind == StageKind.AV or self.b_in)


class Model(NamedTuple):
    """A model: its stages, a parameter initializer and which weights take weight decay."""

    name: str
    stages: tuple[Stage, ...]
    init: Callable[[jax.Array], dict]
    decay_mask: Callable[[dict], dict]
    num_classes: int


def _glorot(key, shape):
    fan_in, fan_out = shape[0], shape[-1]
    lim = jnp.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, shape, jnp.float32, -lim, lim)


def _init(stages: tuple[Stage, ...]) -> Callable[[jax.Array], dict]:
    def init(key: jax.Array) -> dict:
        params = {}
        for st in stages:
            if not st.has_params:
                continue
            key, k1, k2, k3 = jax.random.split(key, 4)
            p = {}
            if st.kind == StageKind.AV:
                width = st.out_dim * max(st.heads, 1)
                p["w"] = _glorot(k1, (st.in_dim, width))
                if st.heads:
                    p["a_src"] = _glorot(k2, (st.heads, st.out_dim))
                    p["a_dst"] = _glorot(k3, (st.heads, st.out_dim))
                if st.b_out:
                    p["b_out"] = jnp.zeros((width,), jnp.float32)
            if st.b_in:
                p["b_in"] = jnp.zeros((st.in_dim,), jnp.float32)
            params[st.name] = p
        return params

    return init


def _layers(in_dim: int, hidden: int | tuple[int, ...], num_classes: int, order: str, model: str) -> list:
    """(layer, d_in, d_out, σ) of each layer of a stacked model (σ = relu, None on the last layer)."""
    if order not in ("auto", "ga-first", "av-first"):
        raise ValueError(f"unknown {model} stage order {order!r} (auto, ga-first, av-first)")
    hs = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    dims = (in_dim, *hs, num_classes)
    last = len(dims) - 2
    return [(layer, dims[layer], dims[layer + 1], None if layer == last else "relu") for layer in range(last + 1)]


def gcn(in_dim: int, hidden: int | tuple[int, ...], num_classes: int, *, dropout: float = 0.5,
        order: str = "auto", decay_all: bool = False) -> Model:
    """Graph convolutional network (Kipf & Welling, ICLR 2017): H' = σ(Â H W + b).

    Each layer is GA→AV (Dorylus's order: aggregate, then transform) or AV→GA (transform first, then aggregate,
    with the bias and σ applied by the next tensor stage); `order="auto"` aggregates on the narrower side,
    which is the same function with fewer sparse FLOPs. Weight decay on the first layer only, as in Kipf's code.
    """
    layers = _layers(in_dim, hidden, num_classes, order, "GCN")
    stages: list[Stage] = []
    pending_bias, pending_act = False, None
    last = len(layers) - 1
    for layer, d_in, d_out, act in layers:
        # A GA-first layer aggregates finished rows: after an AV-first layer (bias and σ pending) Â would sum the
        # raw ÂHW and σ would come after the second aggregation, so that layer goes AV-first.
        ga_first = order == "ga-first" or (order == "auto" and not pending_bias and d_in <= d_out)
        av = dict(kind=StageKind.AV, layer=layer, in_dim=d_in, out_dim=d_out, act_in=pending_act, b_in=pending_bias)
        if ga_first:
            # dropout before the aggregation, Â·dropout(H)·W as in Kipf's code: each vertex's noise is averaged
            # over its neighbours (after it, dropout(ÂH)·W, hidden 16 on a 20k planted graph reached 0.46, not 0.87)
            stages.append(Stage(kind=StageKind.GA, layer=layer, index=len(stages), name=f"ga{layer}", rate=dropout))
            stages.append(Stage(index=len(stages), name=f"av{layer}", act_out=act, b_out=True, **av))
            pending_bias, pending_act = False, None
        else:
            stages.append(Stage(index=len(stages), name=f"av{layer}", rate=dropout, **av))
            stages.append(Stage(kind=StageKind.GA, layer=layer, index=len(stages), name=f"ga{layer}"))
            pending_bias, pending_act = True, act
    stages.append(Stage(kind=StageKind.LOSS, layer=last, index=len(stages), name="loss", in_dim=num_classes,
                        b_in=pending_bias))
    stages_t = tuple(stages)
    first = stages_t[0].name if stages_t[0].kind == StageKind.AV else stages_t[1].name

    def decay_mask(params):
        return {k: {n: (n == "w" and (decay_all or k == first)) for n in v} for k, v in params.items()}

    return Model("gcn", stages_t, _init(stages_t), decay_mask, num_classes)


def gat(in_dim: int, hidden: int, num_classes: int, *, heads: int = 8, out_heads: int = 1, layers: int = 2,
        dropout: float = 0.6, negative_slope: float = 0.2) -> Model:
    """Graph attention network (Veličković et al., ICLR 2018), multi-head, ELU between layers.

    Per layer: AV (z = dropout(h)·W per head, with attention scores), AE (α = softmax of LeakyReLU scores over
    each vertex's in-neighbours, with dropout), GA weighted by α. Hidden layers concatenate heads; the output
    layer averages them. Each layer's bias and ELU are applied by the next tensor stage.
    """
    stages: list[Stage] = []
    d_in = in_dim
    for layer in range(layers):
        is_last = layer == layers - 1
        h = out_heads if is_last else heads
        d_out = num_classes if is_last else hidden
        stages.append(Stage(kind=StageKind.AV, layer=layer, index=len(stages), name=f"av{layer}", in_dim=d_in,
                            out_dim=d_out, heads=h, act_in=None if layer == 0 else "elu", b_in=layer > 0,
                            rate=dropout))
        stages.append(Stage(kind=StageKind.AE, layer=layer, index=len(stages), name=f"ae{layer}", heads=h, rate=dropout,
                            negative_slope=negative_slope))
        stages.append(Stage(kind=StageKind.GA, layer=layer, index=len(stages), name=f"ga{layer}", heads=h,
                            weighted=True,
                            concat_heads=not is_last))
        d_in = d_out * h
    stages.append(Stage(kind=StageKind.LOSS, layer=layers - 1, index=len(stages), name="loss", in_dim=num_classes,
                        heads=out_heads, b_in=True))
    stages_t = tuple(stages)

    def decay_mask(params):
        return {k: {n: n in ("w", "a_src", "a_dst") for n in v} for k, v in params.items()}

    return Model("gat", stages_t, _init(stages_t), decay_mask, num_classes)


def sage(in_dim: int, hidden: int | tuple[int, ...], num_classes: int, *, dropout: float = 0.5,
         order: str = "auto") -> Model:
    """GraphSAGE with the mean aggregator (Hamilton et al., NeurIPS 2017), full-graph:
    h' = σ(h W_self + mean_{u ∈ N(v)} h_u W_neigh + b).

    Each layer is GA→AV (GA "mean-concat" gives [h, mean(h_N)], AV multiplies by [W_self; W_neigh]) or AV→GA
    (AV gives [h W_self, h W_neigh], GA "mean-add" adds the self half to the neighbours' mean of the other, and
    the next tensor stage applies the bias and σ); `order="auto"` aggregates on the narrower side. The mean
    (D^-1 A) comes from the block's structure, so GA runs over the same Â (with self-loops) as GCN's.
    Weight decay on every weight matrix, as PyG's example.
    """
    layers = _layers(in_dim, hidden, num_classes, order, "GraphSAGE")
    stages: list[Stage] = []
    pending_bias, pending_act = False, None
    last = len(layers) - 1
    for layer, d_in, d_out, act in layers:
        # A GA-first layer reads finished rows: after an AV-first layer (bias and σ pending) it must go AV-first.
        ga_first = not pending_bias and (order == "ga-first" or (order == "auto" and d_in <= d_out))
        if ga_first:
            # dropout before the aggregation (PyG's example drops x before each SAGEConv), as in `gcn`
            stages.append(Stage(kind="GA", layer=layer, index=len(stages), name=f"ga{layer}",
                                aggregator="mean-concat", rate=dropout))
            stages.append(Stage(kind="AV", layer=layer, index=len(stages), name=f"av{layer}", in_dim=2 * d_in,
                                out_dim=d_out, act_out=act, b_out=True))
        else:
            stages.append(Stage(kind="AV", layer=layer, index=len(stages), name=f"av{layer}", in_dim=d_in,
                                out_dim=2 * d_out, act_in=pending_act, b_in=pending_bias, rate=dropout))
            stages.append(Stage(kind="GA", layer=layer, index=len(stages), name=f"ga{layer}",
                                aggregator="mean-add"))
        pending_bias, pending_act = (False, None) if ga_first else (True, act)
    stages.append(Stage(kind="LOSS", layer=last, index=len(stages), name="loss", in_dim=num_classes,
                        b_in=pending_bias))
    stages_t = tuple(stages)

    def decay_mask(params):
        return {k: {n: n == "w" for n in v} for k, v in params.items()}

    return Model("sage", stages_t, _init(stages_t), decay_mask, num_classes)


def logits_of(stage: Stage, params: dict, h: jax.Array) -> jax.Array:
    """The LOSS stage's prologue: last bias and head mean, giving logits [R, classes]."""
    if h.ndim == 3:
        h = jnp.mean(h, axis=1)
    if stage.b_in:
        h = h + params[stage.name]["b_in"]
    return h


def run_stage(stage: Stage, params: dict, state: dict, adj: sparse.Adjacency, seed) -> dict:
    """Apply one non-loss stage to a block's state; returns the tensors the stage writes.

    state holds "h" (and "s_src"/"s_dst"/"alpha" for GAT). For GA and AE the column-indexed tensors cover the
    block's columns (owned and ghost vertices); everything else covers its rows. `seed` (uint32) keys dropout;
    None disables it (evaluation). adj may be a `sparse.Partitioned` whole graph: an unweighted GA then runs
    block by block (the engine's evaluation over its graph servers' blocks).
    """
    if stage.kind == StageKind.AV:
        rate = stage.rate if seed is not None else 0.0
        out = dense.apply_vertex(params[stage.name], state["h"], act_in=stage.act_in, act_out=stage.act_out,
                                 rate=rate, seed=seed, row_gids=adj.row_gids, heads=stage.heads)
        return {"h": out.pop("z"), **out}
    if stage.kind == StageKind.AE:
        rate = stage.rate if seed is not None else 0.0
        alpha = dense.apply_edge(state["s_src"], state["s_dst"], adj, negative_slope=stage.negative_slope,
                                 rate=rate, seed=seed)
        return {"alpha": alpha}
    if stage.kind == StageKind.GA:
        h = state["h"]
        if isinstance(adj, sparse.Partitioned):
            if stage.weighted:
                raise ValueError("a weighted GA reads per-edge values of one block: it cannot run partitioned")
            return {"h": adj.gather_each(lambda b, hc: run_stage(stage, params, {"h": hc}, b, seed)["h"], h)}
        if seed is not None and stage.rate > 0.0:
            h = dense.dropout(h, stage.rate, seed, adj.col_gids)
        if stage.weighted:
            out = sparse.gather_weighted(adj, state["alpha"], h)
            return {"h": out.reshape(out.shape[0], -1) if stage.concat_heads else out}
        if stage.aggregator != "sum":
            return {"h": sparse.gather_mean(adj, h, stage.aggregator)}
        return {"h": sparse.gather(adj, h)}
    raise ValueError(f"run_stage does not run {stage.kind} stages")


@jax.tree_util.register_pytree_node_class
class Aggregated:
    """Vertex rows after a model's leading constant stages (`constant_prefix`): `h` is what stage `done` reads.

    `done` is static pytree metadata, so a jitted forward compiles once per prefix length.
    """

    def __init__(self, h: jax.Array, done: int):
        self.h = h
        self.done = int(done)

    def tree_flatten(self):
        return (self.h,), self.done

    @classmethod
    def tree_unflatten(cls, done, children):
        return cls(children[0], done)

    @property
    def nbytes(self) -> int:
        return int(self.h.nbytes)


def constant_prefix(model: Model, adj: sparse.Adjacency, x: jax.Array, train: bool = False
                    ) -> jax.Array | Aggregated:
    """The features with the model's leading constant stages applied once, for every later epoch to reuse.

    A GA over the raw features (GCN's and GraphSAGE's first layer when it aggregates first) has no weights and
    no gradient; without dropout (evaluation) its output is the same every epoch: Â·X is computed here once
    (Kipf's precomputation of ÂX) instead of every forward. train=True: the prefix a training forward may
    skip, which ends at a GA that drops its inputs (`Stage.rate`). Returns x itself when no stage qualifies.
    """
    h = x
    done = prefix_length(model, train)
    for st in model.stages[:done]:
        h = _constant_stage(st, adj, h)
    return x if done == 0 else Aggregated(h, done)


def prefix_length(model: Model, train: bool = False) -> int:
    """How many leading stages `constant_prefix` covers (for training or for evaluation)."""
    done = 0
    for st in model.stages:
        if st.kind != StageKind.GA or st.weighted or (train and st.rate > 0.0):
            break
        done += 1
    return done


@xla.jit(static_argnums=0)
def _constant_stage(stage: Stage, adj: sparse.Adjacency, h: jax.Array) -> jax.Array:
    return run_stage(stage, {}, {"h": h}, adj, None)["h"]


def forward(model: Model, params: dict, adj: sparse.Adjacency, x: jax.Array | Aggregated, seeds=None) -> jax.Array:
    """Whole-graph forward pass: compose every stage over one block holding all vertices; returns logits.

    x: the input features, or their `constant_prefix` (the stages it covers are skipped).
    seeds: uint32 array with one dropout seed per stage, or None for evaluation.
    """
    stages = model.stages
    i = 0
    if isinstance(x, Aggregated):
        x, i = x.h, x.done
    state = {"h": x}
    while i < len(stages):
        st = stages[i]
        if st.kind == StageKind.LOSS:
            return logits_of(st, params, state["h"])
        seed = None if seeds is None else seeds[st.index]
        if st.kind == StageKind.AE and stages[i + 1].kind == StageKind.GA and stages[i + 1].weighted:
            state = {**state, **_attend(st, stages[i + 1], state, adj, seed)}
            i += 2
            continue
        if st.kind == StageKind.AV:
            j = i + 1
            while stages[j].kind == StageKind.AV:   # a run of AV stages: row-local, one blocked chain
                j += 1
            state = {**state, **_av_chain(model, stages[i:j], params, state["h"], adj.row_gids, seeds)}
            i = j
            continue
        state = {**state, **run_stage(st, params, state, adj, seed)}
        i += 1
    raise ValueError("model has no LOSS stage")


def forward_staged(model: Model, params: dict, adj, x: jax.Array | Aggregated) -> jax.Array:
    """`forward` without dropout as a sequence of jitted pieces (each run of AV stages, each GA, per block of a
    `sparse.Partitioned` graph, the LOSS prologue) instead of one program: between pieces only the current
    vertex rows are alive. For models of AV, unweighted GA and LOSS stages (GCN, GraphSAGE); returns logits."""
    stages = model.stages
    i = 0
    if isinstance(x, Aggregated):
        x, i = x.h, x.done
    h = x
    while i < len(stages):
        st = stages[i]
        if st.kind == StageKind.LOSS:
            return _logits_jit(st, params, h)
        if st.kind == StageKind.AV:
            j = i + 1
            while stages[j].kind == StageKind.AV:
                j += 1
            h = _av_chain_jit(model, stages[i:j], params, h, adj.row_gids)
            i = j
            continue
        if st.kind != StageKind.GA or st.weighted:
            raise ValueError(f"a staged forward runs AV, unweighted GA and LOSS stages, not {st.kind} {st.name}")
        if isinstance(adj, sparse.Partitioned):
            out = None
            for b, c, r in zip(adj.blocks, adj.col_ids, adj.row_ids):
                o = _block_stage(st, b, h, c)
                out = jnp.zeros((adj.num_rows, *o.shape[1:]), o.dtype) if out is None else out
                out = _set_rows(out, r, o)
            h = out
        else:
            h = _constant_stage(st, adj, h)
        i += 1
    raise ValueError("model has no LOSS stage")


@xla.jit(static_argnums=0)
def _logits_jit(stage: Stage, params: dict, h: jax.Array) -> jax.Array:
    return logits_of(stage, params, h)


@xla.jit(static_argnums=(0, 1))
def _av_chain_jit(model: Model, chain: tuple[Stage, ...], params: dict, h: jax.Array, row_gids) -> jax.Array:
    return _av_chain(model, chain, params, h, row_gids, None)["h"]


@xla.jit(static_argnums=0)
def _block_stage(stage: Stage, block: sparse.Adjacency, h: jax.Array, cols: jax.Array) -> jax.Array:
    return run_stage(stage, {}, {"h": jnp.take(h, cols, axis=0)}, block, None)["h"]


@functools.partial(xla.jit, donate_argnums=0)
def _set_rows(out: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    return out.at[rows].set(values, mode="drop")


def _av_chain(model: Model, chain: tuple[Stage, ...], params: dict, h: jax.Array, row_gids,
              seeds) -> dict:
    """Consecutive AV stages over all rows, block by block (`dense.row_blocked`): the same values as running
    them one by one, without N-row intermediates kept for the backward. The input needs no gradient when it
    is the features or a constant prefix of them."""
    first = chain[0]
    need_dx = any(requires_grad(model)[p] for p in producers(model)[first.index].values())

    def fn(p, xb, gids, sd):
        state = {"h": xb}
        for st in chain:
            rate = st.rate if sd is not None else 0.0
            out = dense.apply_vertex(p[st.name], state["h"], act_in=st.act_in, act_out=st.act_out, rate=rate,
                                     seed=None if sd is None else sd[st.index], row_gids=gids, heads=st.heads)
            state = {"h": out.pop("z"), **out}
        return state

    sub = {st.name: params[st.name] for st in chain}
    return dense.row_blocked(fn, sub, h, row_gids, seeds, need_dx=need_dx)


def _attend(ae: Stage, ga: Stage, state: dict, adj: sparse.Adjacency, seed) -> dict:
    """AE and the weighted GA that reads its α, fused (`ops.attention`): the same values as running the two
    stages, without keeping per-edge tensors for the backward. The engine runs them as separate tasks."""
    out = attention.attend_and_gather(adj, state["s_src"], state["s_dst"], state["h"],
                                      negative_slope=ae.negative_slope, rate=ae.rate, seed=seed)
    return {"h": out.reshape(out.shape[0], -1) if ga.concat_heads else out}


def from_spec(spec: dict) -> Model:
    """Rebuild a model from its JSON-able spec (what a stateless tensor worker receives with a task)."""
    spec = dict(spec)
    kind = spec.pop("name")
    if kind == "gcn":
        spec["hidden"] = tuple(spec["hidden"])
        return _cached_gcn(**spec)
    if kind == "gat":
        return _cached_gat(**spec)
    if kind == "sage":
        spec["hidden"] = tuple(spec["hidden"])
        return _cached_sage(**spec)
    raise ValueError(f"unknown model {kind!r} in task spec")


def _freeze(fn):
    return functools.lru_cache(maxsize=16)(fn)


_cached_gcn = _freeze(gcn)
_cached_gat = _freeze(gat)
_cached_sage = _freeze(sage)


def writes(stage: Stage) -> tuple[str, ...]:
    """Named tensors a stage produces: vertex rows for AV/GA, per-edge values for AE."""
    if stage.kind == StageKind.AV:
        return ("h", "s_src", "s_dst") if stage.heads else ("h",)
    if stage.kind == StageKind.AE:
        return ("alpha",)
    if stage.kind == StageKind.GA:
        return ("h",)
    return ()


def static_over_features(stage: Stage, producer: int) -> bool:
    """Whether a stage's output is the same every epoch: an unweighted GA without dropout over the input
    features (producer -1), which the engine computes once."""
    return producer == -1 and stage.kind == StageKind.GA and not stage.weighted and stage.rate <= 0.0


def runs_whole(stage: Stage) -> bool:
    """Whether the engine runs this stage over a partition's whole block once per epoch rather than per interval:
    an unweighted GA (GCN's Â, GraphSAGE's mean), which needs no per-interval tensor (GAT's α is per interval)."""
    return stage.kind == StageKind.GA and not stage.weighted


def needs_interval_blocks(stages) -> bool:
    """Whether the engine needs each interval's own gather block: a GA that runs per interval (GAT's weighted
    one) or an AE, which reads its block's edges. GCN and GraphSAGE need only the partitions' whole blocks."""
    return any(st.kind == StageKind.AE or (st.kind == StageKind.GA and not runs_whole(st)) for st in stages)


def reads(stage: Stage) -> dict[str, str]:
    """Named tensors a stage consumes and where: "rows" (its block's rows), "cols" (columns: ghosts too) or
    "edges" (per-edge values of the same block)."""
    if stage.kind in (StageKind.AV, StageKind.LOSS):
        return {"h": "rows"}
    if stage.kind == StageKind.AE:
        return {"s_src": "cols", "s_dst": "rows"}
    if stage.kind == StageKind.GA:
        return {"h": "cols", "alpha": "edges"} if stage.weighted else {"h": "cols"}
    return {}


def producers(model: Model) -> dict[int, dict[str, int]]:
    """For every stage, which earlier stage produced each tensor it reads (-1: the input features)."""
    last: dict[str, int] = {"h": -1}
    out = {}
    for st in model.stages:
        out[st.index] = {name: last[name] for name in reads(st)}
        for name in writes(st):
            last[name] = st.index
    return out


def requires_grad(model: Model) -> dict[int, bool]:
    """For every stage, whether the gradient of its outputs is needed: it has parameters, or an input it reads
    needs one. A GA over the input features needs no backward at all, and its consumer no input gradient."""
    prod = producers(model)
    need: dict[int, bool] = {-1: False}
    for st in model.stages:
        need[st.index] = st.has_params or any(need[p] for p in prod[st.index].values())
    return need


def tensor_groups(model: Model) -> list[tuple[int, ...]]:
    """The stages in execution order, grouped into tasks: runs of consecutive AV stages whose intermediate
    outputs only the next AV reads (row-local, no ghosts) become one tensor task; every other stage is its own.
    Fusing changes nothing computed, only how many tasks (and bytes) carry it."""
    prod = producers(model)
    readers: dict[tuple[int, str], list[int]] = {}
    for st in model.stages:
        for name, p in prod[st.index].items():
            readers.setdefault((p, name), []).append(st.index)
    groups: list[list[int]] = []
    for st in model.stages:
        prev = groups[-1][-1] if groups else None
        if (prev is not None and st.kind == StageKind.AV and model.stages[prev].kind == StageKind.AV
                and all(prod[st.index][n] == prev for n in reads(st))
                and all(readers.get((prev, n), []) == [st.index] for n in writes(model.stages[prev]))):
            groups[-1].append(st.index)
        else:
            groups.append([st.index])
    return [tuple(g) for g in groups]


def epoch_schedule(model: Model) -> list[tuple[Step, int]]:
    """One epoch of an interval as a graph server walks it, (Step, first stage of a task group): the forward
    groups, the fused last layer (LAST, when the stage before the loss is an AV) or the loss alone (LOSS), then
    the backward groups that have parameters or an input whose gradient someone needs (a GA over the input
    features has none)."""
    st = model.stages
    last = len(st) - 1
    need, prod = requires_grad(model), producers(model)
    body = [g for g in tensor_groups(model) if g[0] != last]
    fused = st[last - 1].kind == StageKind.AV
    steps = [((Step.LAST if fused and g is body[-1] else Step.FORWARD), g[0]) for g in body]
    if not fused:
        steps.append((Step.LOSS, last))
    for g in reversed(body[:-1] if fused else body):
        if any(st[k].has_params for k in g) or any(p != -1 and need[p] for p in prod[g[0]].values()):
            steps.append((Step.BACKWARD, g[0]))
    return steps


def column_reads(model: Model) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], list[int]]]:
    """Which (producer stage, tensor) pairs are read at columns (ghosts too, so SC sends them), by the last stage
    reading them so, and which at rows, by every stage reading them so."""
    prod = producers(model)
    cols, rows = {}, {}
    for st in model.stages:
        for name, where in reads(st).items():
            key = (prod[st.index][name], name)
            if where == "cols":
                cols[key] = st.index
            else:
                rows.setdefault(key, []).append(st.index)
    return cols, rows


def row_widths(model: Model, in_dim: int) -> dict[tuple[int, str], int]:
    """Floats per vertex row of every row tensor (producer stage, name) of a row-local model (GCN, SAGE), from
    the stage shapes alone; -1 is the input features. GAT's per-edge tensors have no row width: None."""
    if any(st.kind == StageKind.AE for st in model.stages):
        return None
    prod = producers(model)
    w: dict[tuple[int, str], int] = {(-1, "h"): in_dim}
    for st in model.stages:
        if st.kind == StageKind.AV:
            w[(st.index, "h")] = st.out_dim * max(st.heads, 1)
        elif st.kind == StageKind.GA:
            src = w[(prod[st.index]["h"], "h")]
            w[(st.index, "h")] = {"sum": src, "mean-concat": 2 * src, "mean-add": src // 2}[st.aggregator]
    return w
