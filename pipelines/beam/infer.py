"""Full-graph inference with trained weights (an Apache Beam pipeline): predictions and embeddings as Parquet.

    python -m pipelines.infer --run runs/cora-gcn-... --prepared runs/cora-prepared --out runs/cora-predictions
    python -m pipelines.infer --run runs/cora-gcn-... --dataset cora --out ...        # a dataset spec instead
    python -m pipelines.infer --run runs/cora-gcn-... --out ...                       # the run's own data
    dorylus infer ... [--engine direct|flink] [--workers N] [any Beam flag]

The run directory holds ``weights.npz`` and ``config.toml`` (what ``dorylus train`` writes); the model is rebuilt
from the config and checked against the weights and the data's feature width.

How it computes
---------------
Vertices are processed in *blocks* of ``--block-size`` consecutive ids (block = v // B): a block is the batch of
every tensor stage. The model's stage list (ops/models.py) is cut into segments at the stages that read
neighbour values (GA, and GAT's AE). Per segment:

  Scatter  (CoGroupByKey of each block's vertex state with its routes): the rows of every source block that a
           destination block's in-edges read (computed once from the edge shards) are sent to that block — the
           SC task of Dorylus;
  Gather   (CoGroupByKey of a block's messages, in-edges and own state): the block's Â rows become an
           ``ops.sparse.Adjacency`` over the columns it received, and ``ops.models.run_stage`` runs the
           segment's stages on it in one jitted call (padded to power-of-two shapes, so a few compilations serve
           every block): GAT's AE (attention softmax over each destination's in-edges), GA, then the
           row-local AV stages up to the next exchange (batched JAX on the block).

Leading row-local stages (AV first: GCN av-first, GAT) run on the blocks before the first exchange; the last
segment ends with the LOSS stage's prologue (``ops.models.logits_of``), so the logits equal
``ops.models.forward`` on the whole graph without dropout.

Outputs (``--out DIR``, written atomically like prepare: a temporary directory renamed at the end)
DIR/predictions/part-XXXXX.parquet   :func:`schemas.files.predictions_schema`: vertex int64, prediction int32
                                     (argmax) and embedding fixed_size_list<float32>[C] = the logits (unless
                                     ``--no-embeddings``); sorted by vertex; vertices spread over
                                     ``--output-shards`` files by block.
DIR/infer.json                       what was run on what: files with rows and sha256, sizes, flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import shutil
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import apache_beam as beam

from ops import params as P
from ops.spec import ModelSpec
from pipelines.beam.combiners import Stat, StatsFn
from pipelines.beam.runners import CommandParser, RunnerUnavailable, add_engine_arguments, engine_flags, \
    pipeline_options
from pipelines.beam.writers import check_output, read_stats, shard_name, staged_output, write_json, write_stats, \
    write_table
from pipelines.config import ConfigError
from pipelines.data.features import resolve_feature_norm
from pipelines.data.graph import DataError
from pipelines.data.prepared import feature_norm_of, verify_shards
from schemas import files as file_schemas
from schemas.tasks import StageKind

log = logging.getLogger("dorylus.infer")

FORMAT = "dorylus-predictions"
FORMAT_VERSION = 1
DEFAULT_BLOCK = 4096


# --- the model and its segments ------------------------------------------------------------------------------------
class Segment(NamedTuple):
    """Stages run together on one block: column stages (GA/AE, after an exchange) then row-local AV stages.

    exchanged: tensors the column stages read at columns (sent by the Scatter); row_reads: tensors they read at
    the block's own rows; writes: the row tensors the block holds afterwards; final: the LOSS stage when the
    segment ends the model (its output is then the logits)."""

    stages: tuple
    exchanged: tuple
    row_reads: tuple
    writes: tuple
    final: object = None


def segments(model) -> list[Segment]:
    """Cut a model's stages at the stages that read columns; the first segment may have no column stages."""
    from ops import models

    body = [s for s in model.stages if s.kind != StageKind.LOSS]
    loss = next(s for s in model.stages if s.kind == StageKind.LOSS)
    groups: list[list] = [[]]
    for st in body:
        col = st.kind in (StageKind.GA, StageKind.AE)
        if col and groups[-1] and groups[-1][-1].kind == StageKind.AV:
            groups.append([])
        groups[-1].append(st)
    out = []
    for i, g in enumerate(groups):
        exchanged, row_reads, writes = [], [], []
        for st in g:
            for name, where in models.reads(st).items():
                if where == "cols" and name not in exchanged:
                    exchanged.append(name)
                if where == "rows" and st.kind != StageKind.AV and name not in row_reads:
                    row_reads.append(name)
            for name in models.writes(st):
                if name != "alpha" and name not in writes:
                    writes.append(name)
        out.append(Segment(tuple(g), tuple(exchanged), tuple(row_reads), tuple(writes),
                           loss if i == len(groups) - 1 else None))
    return out


def _run_segment(seg_stages, final, params, state, adj):
    from ops import models

    for st in seg_stages:
        state = {**state, **models.run_stage(st, params, state, adj, None)}
    if final is not None:
        state = {**state, "logits": models.logits_of(final, params, state["h"])}
    return state


_JIT = {}


def _jitted():
    from ops import xla

    if "fn" not in _JIT:
        _JIT["fn"] = xla.jit(_run_segment, static_argnums=(0, 1))
    return _JIT["fn"]


def _pow2(n: int, floor: int = 8) -> int:
    return max(floor, 1 << max(int(n) - 1, 0).bit_length())


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    if x.shape[0] == rows:
        return x
    out = np.zeros((rows,) + x.shape[1:], x.dtype)
    out[: x.shape[0]] = x
    return out


class _Rows(NamedTuple):
    """What a row-local stage needs of an adjacency: the rows' global ids (dropout keys; unused without dropout)."""

    row_gids: object


# --- block records -------------------------------------------------------------------------------------------------
class VertexState(NamedTuple):
    ids: np.ndarray           # int64, sorted: the block's vertices
    tensors: dict             # name -> float32 [R, ...] row tensors ("h"; "s_src"/"s_dst" for GAT)


class EdgeBlock(NamedTuple):
    dst: np.ndarray           # int64, sorted by (dst, src): the in-edges of the block's vertices
    src: np.ndarray
    weight: np.ndarray        # float32 Â[dst, src] (GCN) or 1 (GAT: A + I)


class GhostRows(NamedTuple):
    """SC in the Beam pipeline: rows of one block that another block reads."""

    ids: np.ndarray           # source vertex ids
    tensors: dict             # name -> rows of those vertices


def _by_block(blocks: np.ndarray, *arrays):
    order = np.argsort(blocks, kind="stable")
    b = blocks[order]
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]]) if b.size else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], b.size]
    for s, e in zip(starts, ends):
        yield int(b[s]), tuple(a[order[s:e]] for a in arrays)


class _ReadVertices(beam.DoFn):
    """A vertex shard -> (block, (ids, features)) pieces."""

    def __init__(self, root: str, block: int, feature_dim: int):
        self.root, self.block, self.feature_dim = root, block, feature_dim

    def process(self, entry):
        cols = ["vertex", "features"] if self.feature_dim else ["vertex"]
        t = pq.read_table(os.path.join(self.root, entry["vertices"]), columns=cols)
        if t.num_rows != entry["num_vertices"]:
            raise DataError(f"{entry['vertices']}: {t.num_rows} rows, the manifest says {entry['num_vertices']}")
        ids = t.column("vertex").to_numpy()
        if self.feature_dim:
            x = t.column("features").combine_chunks().flatten().to_numpy().astype(np.float32, copy=False)
            x = x.reshape(-1, self.feature_dim)
        else:
            x = np.zeros((ids.size, 0), np.float32)
        yield from _by_block(ids // self.block, ids, x)


class _ReadEdges(beam.DoFn):
    """An edge shard -> (block of dst, (dst, src, weight)) pieces, one record batch at a time."""

    def __init__(self, root: str, block: int, unit_weights: bool):
        self.root, self.block, self.unit = root, block, unit_weights

    def process(self, entry):
        pf = pq.ParquetFile(os.path.join(self.root, entry["edges"]))
        if pf.metadata.num_rows != entry["num_edges"]:
            raise DataError(f"{entry['edges']}: {pf.metadata.num_rows} rows, the manifest says {entry['num_edges']}")
        for batch in pf.iter_batches(batch_size=1 << 20, columns=["src", "dst", "weight"]):
            src = batch.column(0).to_numpy()
            dst = batch.column(1).to_numpy()
            w = (np.ones(src.size, np.float32) if self.unit
                 else batch.column(2).to_numpy().astype(np.float32, copy=False))
            yield from _by_block(dst // self.block, dst, src, w)


def _vertex_state(kv, feature_norm: str):
    from pipelines.data.graph import row_normalize

    block, pieces = kv
    pieces = list(pieces)
    ids = np.concatenate([p[0] for p in pieces])
    x = np.concatenate([p[1] for p in pieces])
    order = np.argsort(ids, kind="stable")
    ids, x = ids[order], x[order]
    if feature_norm == "row":
        x = row_normalize(x)
    return block, VertexState(ids, {"h": np.ascontiguousarray(x, np.float32)})


def _edge_block(kv):
    block, pieces = kv
    pieces = list(pieces)
    dst, src, w = (np.concatenate([p[i] for p in pieces]) for i in range(3))
    order = np.lexsort((src, dst))
    return block, EdgeBlock(dst[order], src[order], w[order])


def _routes(kv, block_size: int):
    """(dst block, in-edges) -> (src block, (dst block, the src ids of that block it reads))."""
    block, e = kv
    src = np.unique(e.src)
    for src_block, (ids,) in _by_block(src // block_size, src):
        yield src_block, (block, ids)


def _scatter(kv, names: tuple):
    """SC: a block's rows that other blocks read -> (dst block, GhostRows)."""
    _, g = kv
    states = list(g["state"])
    if not states:
        return
    st = states[0]
    for dst_block, ids in g["routes"]:
        rows = np.searchsorted(st.ids, ids)
        if (rows >= st.ids.size).any() or not np.array_equal(st.ids[np.minimum(rows, st.ids.size - 1)], ids):
            raise DataError(f"edges read vertices {ids[:5]}... that no vertex shard holds")
        yield dst_block, GhostRows(ids, {n: st.tensors[n][rows] for n in names})


class _Apply(beam.DoFn):
    """Run a segment on one block: build its adjacency from the messages (column stages), then the row stages."""

    def __init__(self, segment: Segment, params: dict):
        self.seg, self.params = segment, params

    def setup(self):
        import jax.numpy as jnp

        self.fn = _jitted()
        self.jparams = {k: {n: jnp.asarray(v) for n, v in p.items()} for k, p in self.params.items()}

    def _finish(self, block, ids, out):
        r = ids.size
        tensors = {n: np.asarray(out[n])[:r] for n in self.seg.writes}
        if self.seg.final is not None:
            tensors = {"logits": np.asarray(out["logits"])[:r]}
        return block, VertexState(ids, tensors)

    def process(self, kv):
        block, g = kv
        if not self.seg.exchanged:           # row stages only
            st = g
            rp = _pow2(st.ids.size)
            state = {n: _pad_rows(v, rp) for n, v in st.tensors.items()}
            out = self.fn(self.seg.stages, self.seg.final, self.jparams, state, _Rows(_pad_rows(st.ids, rp)))
            yield self._finish(block, st.ids, out)
            return
        from ops.sparse import Adjacency
        import scipy.sparse as sp

        states = list(g["self"])
        if not states:
            return
        st = states[0]
        edges = list(g["edges"])
        msgs = list(g["msgs"])
        ids = st.ids
        col_ids = np.concatenate([m.ids for m in msgs]) if msgs else np.zeros(0, np.int64)
        order = np.argsort(col_ids, kind="stable")
        col_ids = col_ids[order]
        e = edges[0] if edges else EdgeBlock(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
        r = np.searchsorted(ids, e.dst)
        c = np.searchsorted(col_ids, e.src)
        n_rows, n_cols = ids.size, col_ids.size
        _check_found(r, ids, e.dst, f"block {block}: in-edges of vertices the block does not hold")
        _check_found(c, col_ids, e.src, f"block {block}: in-edges read vertices whose rows never arrived")
        if np.bincount(r, minlength=n_rows).min(initial=1) == 0:   # every vertex has its self-loop
            raise RuntimeError(f"internal error: block {block}: vertices without in-edges (the self-loop at "
                               f"least); the runner lost elements")
        a = sp.csr_matrix((e.weight, (r, c)), shape=(n_rows, n_cols), dtype=np.float32)
        rp, cp, npad = _pow2(n_rows), _pow2(n_cols), _pow2(a.nnz)
        adj = Adjacency.from_scipy(a, row_gids=ids, col_gids=col_ids, nnz_pad=npad, rows_pad=rp, cols_pad=cp)
        state = {}
        for n in self.seg.exchanged:
            state[n] = _pad_rows(np.concatenate([m.tensors[n] for m in msgs])[order], cp)
        for n in self.seg.row_reads:
            state[n] = _pad_rows(st.tensors[n], rp)
        out = self.fn(self.seg.stages, self.seg.final, self.jparams, state, adj)
        yield self._finish(block, ids, out)


def _check_found(pos: np.ndarray, table: np.ndarray, ids: np.ndarray, what: str) -> None:
    ok = pos < table.size
    ok[ok] = table[pos[ok]] == ids[ok]
    if not ok.all():
        raise RuntimeError(f"internal error: {what} ({int((~ok).sum())} entries, e.g. vertex "
                           f"{ids[~ok][0]}); the runner lost elements")


def _predict(kv, shards: int, embeddings: bool):
    block, st = kv
    logits = st.tensors["logits"].astype(np.float32)
    pred = np.argmax(logits, axis=-1).astype(np.int32)
    yield block % shards, (st.ids, pred, logits if embeddings else None)


class _WritePredictions(beam.DoFn):
    def __init__(self, root: str):
        self.root = root

    def process(self, kv):
        shard, pieces = kv
        pieces = list(pieces)
        ids = np.concatenate([p[0] for p in pieces])
        order = np.argsort(ids, kind="stable")
        pred = np.concatenate([p[1] for p in pieces])[order]
        emb = None if pieces[0][2] is None else np.concatenate([p[2] for p in pieces])[order]
        table = file_schemas.predictions_table(ids[order], pred, emb)
        name = shard_name(shard)
        meta = write_table(table, os.path.join(self.root, "predictions", name))
        yield Stat("list:files", 1, {"shard": shard, "path": f"predictions/{name}", **meta})
        yield Stat("vertices", int(ids.size))


# --- the pipeline --------------------------------------------------------------------------------------------------
class Plan(NamedTuple):
    """What the driver resolved before the pipeline runs."""

    shards_root: str            # where the vertex/edge shards are (a prepared DIR, or a temporary one)
    partitions: list            # manifest partition entries
    num_vertices: int
    feature_dim: int
    num_classes: int
    model_name: str
    feature_norm: str
    segments: list
    params: dict                # stage -> name -> numpy array
    block: int
    output_shards: int
    embeddings: bool


class Infer(beam.PTransform):
    """PBegin -> Stat records of the prediction files written under ``root`` (see the module docstring)."""

    def __init__(self, plan: Plan, root: str):
        super().__init__()
        self.plan, self.root = plan, root

    def expand(self, pbegin):
        plan = self.plan
        entries = pbegin | "Shards" >> beam.Create(plan.partitions) | "Spread" >> beam.Reshuffle()
        state = (
            entries
            | "ReadVertices" >> beam.ParDo(_ReadVertices(plan.shards_root, plan.block, plan.feature_dim))
            | "VerticesByBlock" >> beam.GroupByKey()
            | "VertexBlocks" >> beam.Map(_vertex_state, feature_norm=plan.feature_norm)
        )
        edges = (
            entries
            | "ReadEdges" >> beam.ParDo(_ReadEdges(plan.shards_root, plan.block, plan.model_name == "gat"))
            | "EdgesByBlock" >> beam.GroupByKey()
            | "EdgeBlocks" >> beam.Map(_edge_block)
        )
        routes = edges | "Routes" >> beam.FlatMap(_routes, block_size=plan.block)
        for i, seg in enumerate(plan.segments):
            label = "-".join(s.name for s in seg.stages) or "logits"
            if not seg.exchanged:
                state = state | f"Apply[{label}]" >> beam.ParDo(_Apply(seg, plan.params))
                continue
            msgs = (
                {"state": state, "routes": routes}
                | f"Scatter[{label}]" >> beam.CoGroupByKey()
                | f"Send[{label}]" >> beam.FlatMap(_scatter, names=seg.exchanged)
            )
            state = (
                {"msgs": msgs, "edges": edges, "self": state}
                | f"Gather[{label}]" >> beam.CoGroupByKey()
                | f"Apply[{label}]" >> beam.ParDo(_Apply(seg, plan.params))
            )
        os.makedirs(os.path.join(self.root, "predictions"), exist_ok=True)
        return (
            state
            | "Predict" >> beam.FlatMap(_predict, shards=plan.output_shards, embeddings=plan.embeddings)
            | "ByOutputShard" >> beam.GroupByKey()
            | "Write" >> beam.ParDo(_WritePredictions(self.root))
        )


def build(p: beam.Pipeline, plan: Plan, root: str) -> None:
    (
        p
        | "Infer" >> Infer(plan, root)
        | "MergeStats" >> beam.CombineGlobally(StatsFn())
        | "WriteStats" >> beam.Map(write_stats, root=root)
    )


# --- driver --------------------------------------------------------------------------------------------------------
def load_run(run_dir: str | os.PathLike):
    """(TrainConfig, params as numpy) of a run directory."""
    from pipelines.config import build_config, load_toml

    run = Path(run_dir)
    for name in ("config.toml", "weights.npz"):
        if not (run / name).is_file():
            raise DataError(f"--run {run}: no {name} (not a finished `dorylus train` run directory)")
    cfg = build_config(load_toml(run / "config.toml"), {})
    try:
        with np.load(run / "weights.npz", allow_pickle=False) as z:
            params = P.from_npz(z)
    except P.ParamNameError as e:
        raise DataError(f"--run {run}: weights.npz: {e}") from None
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise DataError(f"--run {run}: weights.npz is not a readable weights file ({e})") from None
    return cfg, params


def build_checked_model(cfg, params: dict, feature_dim: int):
    """The model of cfg for ``feature_dim`` inputs, its class count read from the weights; DataError on a mismatch."""
    import jax

    last = params.get(f"av{cfg.layers - 1}", {}).get("w")
    if last is None:
        raise DataError(f"the weights have no stage av{cfg.layers - 1} (stages: {sorted(params)}); "
                        f"they do not belong to a {cfg.layers}-layer {cfg.model}")
    num_classes = int(last.shape[1]) // ModelSpec.output_width_per_class(cfg, params)
    model = ModelSpec.from_config(cfg, feature_dim, num_classes).build()
    want = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    problems = []
    for stage in sorted(set(want) | set(params)):
        for name in sorted(set(want.get(stage, {})) | set(params.get(stage, {}))):
            w, g = want.get(stage, {}).get(name), params.get(stage, {}).get(name)
            if w is None or g is None or tuple(w.shape) != tuple(g.shape):
                problems.append(f"{stage}/{name}: model {None if w is None else tuple(w.shape)}, "
                                f"weights {None if g is None else tuple(g.shape)}")
    if problems:
        raise DataError(f"the weights do not fit a {cfg.model} with {feature_dim} input features "
                        f"(the data's width): " + "; ".join(problems[:4]))
    return model, num_classes


def _dataset_shards(graph, root: Path) -> list:
    """A loaded graph as one vertex shard and one edge shard (Â of the graph) in root: the pipeline's input."""
    from pipelines.data.graph import gcn_normalize

    (root / "vertices").mkdir(parents=True)
    (root / "edges").mkdir()
    a = gcn_normalize(graph.adj).tocoo()
    order = np.lexsort((a.col, a.row))
    n, f = graph.num_nodes, graph.feature_dim
    cols = {"vertex": pa.array(np.arange(n, dtype=np.int64))}
    if f:
        cols["features"] = pa.FixedSizeListArray.from_arrays(pa.array(graph.features.reshape(-1), pa.float32()), f)
    pq.write_table(pa.table(cols), root / "vertices" / shard_name(0))
    pq.write_table(pa.table({"src": a.col[order].astype(np.int64), "dst": a.row[order].astype(np.int64),
                             "weight": a.data[order].astype(np.float32)}), root / "edges" / shard_name(0))
    return [{"partition": 0, "vertices": f"vertices/{shard_name(0)}", "edges": f"edges/{shard_name(0)}",
             "num_vertices": n, "num_edges": int(a.nnz)}]


def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="python -m pipelines.infer",
        description="Full-graph inference with a trained run's weights (Apache Beam): predictions and embeddings "
                    "as Parquet. Flags not listed here go to Beam's PipelineOptions.")
    ap.add_argument("--run", required=True, metavar="RUNDIR", help="a `dorylus train` run: weights.npz + config.toml")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prepared", metavar="DIR", help="a prepared graph (dorylus prepare --out DIR)")
    src.add_argument("--dataset", metavar="SPEC", help="a dataset spec (as dorylus train --dataset)")
    ap.add_argument("--data-dir", help="dataset directory for --dataset")
    ap.add_argument("--out", required=True, metavar="DIR")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK, metavar="B",
                    help=f"vertices per block, the batch of every tensor stage (default {DEFAULT_BLOCK})")
    ap.add_argument("--output-shards", type=int, metavar="S",
                    help="prediction files (default: the prepared graph's partitions, else 1)")
    ap.add_argument("--no-embeddings", action="store_true", help="write vertex and prediction only")
    add_engine_arguments(ap)
    return ap


def _plan_input(prepared, dataset, data_dir, cfg, tmp: Path) -> tuple[str, list, int, int, dict, str]:
    """(shards root, partition entries, N, F, input record, feature normalization) of a prepared graph, or of a
    dataset written as one vertex shard and one edge shard under ``tmp/_input`` ("auto" normalization resolved
    from the features: the whole matrix of a dataset, shard by shard for a prepared graph)."""
    if prepared is not None:
        manifest = verify_shards(prepared)
        root = str(Path(prepared).absolute())
        return (root, manifest["partitions"], manifest["num_vertices"], manifest["feature_dim"], {"prepared": root},
                feature_norm_of(root, cfg.feature_norm, manifest))
    from pipelines.data.registry import load_dataset

    graph = load_dataset(dataset, data_dir or cfg.data_dir, seed=cfg.seed)
    norm = resolve_feature_norm(graph.features, cfg.feature_norm)
    entries = _dataset_shards(graph, tmp / "_input")
    return (str(tmp / "_input"), entries, graph.num_nodes, graph.feature_dim,
            {"dataset": dataset or "(default planted graph)"}, norm)


def run(argv: list[str] | None = None) -> dict:
    """Run inference on ``argv`` (app flags, then Beam's); returns the infer.json record. Raises DataError on bad
    input (nothing is left in --out)."""
    args, pipeline_args = build_parser().parse_known_args(argv)
    if args.block_size < 1:
        raise DataError(f"--block-size must be >= 1, got {args.block_size}")
    if args.output_shards is not None and args.output_shards < 1:
        raise DataError(f"--output-shards must be >= 1, got {args.output_shards}")
    out = Path(args.out).absolute()
    check_output(out, args.overwrite)
    cfg, params = load_run(args.run)
    prepared, dataset = args.prepared, args.dataset
    if prepared is None and dataset is None:
        prepared, dataset = cfg.prepared, cfg.dataset
    pipeline_args = engine_flags(args.engine, args.workers, pipeline_args)
    options = pipeline_options(pipeline_args)
    with staged_output(out, args.overwrite) as tmp:
        root, entries, n, f, source, feature_norm = _plan_input(prepared, dataset, args.data_dir, cfg, tmp)
        model, num_classes = build_checked_model(cfg, params, f)
        plan = Plan(root, list(entries), n, f, num_classes, cfg.model, feature_norm, segments(model), params,
                    args.block_size, args.output_shards or max(1, len(entries)) if prepared else
                    (args.output_shards or 1), not args.no_embeddings)
        with beam.Pipeline(options=options) as p:
            build(p, plan, str(tmp))
        stats = read_stats(tmp)
        shutil.rmtree(tmp / "_input", ignore_errors=True)
        files = sorted(stats.get("list:files", (0, []))[1], key=lambda x: x["shard"])
        done = int(stats.get("vertices", (0,))[0])
        if done != n:
            raise RuntimeError(f"internal error: predictions for {done} of {n} vertices")
        record = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "schema_version": file_schemas.SCHEMA_VERSION,
            "run": str(Path(args.run).absolute()), "model": cfg.model, "input": source,
            "num_vertices": n, "num_classes": num_classes, "feature_dim": f,
            "embedding": None if args.no_embeddings else "logits", "block_size": args.block_size,
            "stages": [[s.name for s in seg.stages] for seg in plan.segments],
            "files": [{k: x[k] for k in ("path", "rows", "bytes", "sha256")} for x in files],
            "flags": dict(vars(args)), "pipeline_args": list(pipeline_args),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        write_json(tmp / "infer.json", record)
    log.info("predicted %d vertices (%d classes) -> %s", n, num_classes, out)
    return record


def load_predictions(root: str | os.PathLike) -> pa.Table:
    """All prediction files of an infer output directory as one table sorted by vertex (validated)."""
    path = Path(root) / "infer.json"
    if not path.is_file():
        raise DataError(f"{root}: no infer.json (not an infer output, or an unfinished run)")
    record = json.loads(path.read_text())
    tables = []
    for entry in record["files"]:
        t = pq.read_table(Path(root) / entry["path"])
        if t.num_rows != entry["rows"]:
            raise DataError(f"{entry['path']}: {t.num_rows} rows, infer.json says {entry['rows']}")
        tables.append(file_schemas.validate_predictions(t))
    return pa.concat_tables(tables).sort_by("vertex")


def summary_line(record: dict, out: str) -> dict:
    return {k: record[k] for k in ("model", "num_vertices", "num_classes")} | {
        "files": len(record["files"]), "out": str(out)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args, _ = build_parser().parse_known_args(argv)
        record = run(argv)
    except (DataError, ConfigError, RunnerUnavailable) as e:
        print(f"infer: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary_line(record, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
