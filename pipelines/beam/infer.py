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
neighbour values (GA, and GAT's AE). No graph data goes through Beam: the elements are shard entries and block
ids, and the data lives in on-disk arrays (:mod:`pipelines.beam.blockstore`) under the output's staging folder:

  Columns  (per shard): the prepared shard's Parquet columns copied to raw arrays, with the row range of every
           block (shards are sorted by destination, so a block is one slice of each);
  Place    (per block): the block's feature rows written into the dense input state [N, F];
  Apply    (per block, per segment): the block's in-edges become an ``ops.sparse.Adjacency`` over the source
           rows they read, which are read from the previous segment's state by memory map (the SC of Dorylus),
           and ``ops.models.run_stage`` runs the segment's stages on it in one jitted call (padded to
           power-of-two shapes, so a few compilations serve every block): GAT's AE (attention softmax over each
           destination's in-edges), GA, then the row-local AV stages up to the next exchange. The block writes
           its own rows of the next state in place;
  Write    (per output shard): predictions from the last state's logits.

Each stage starts after the one before it has finished on every block (a side input is the barrier), since
it may read any block's rows. Memory is bounded by one block's work whatever the graph's size; the staging
folder holds about 12 bytes per edge (int32 ids) plus 4 bytes per vertex and state column, and is removed at
the end. Leading row-local stages (AV first: GCN av-first, GAT) run on the blocks before the first exchange;
the last segment ends with the LOSS stage's prologue (``ops.models.logits_of``), so the logits equal
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
from pipelines.beam import blockstore
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


# --- one block's work ----------------------------------------------------------------------------------------------
def _block_adjacency(block: int, lo: int, hi: int, dst: np.ndarray, src: np.ndarray, w: np.ndarray):
    """Block rows [lo, hi)'s in-edges as an ``ops.sparse.Adjacency`` over the sorted source ids they read, padded
    to power-of-two shapes (a few compilations serve every block); (adj, col_ids)."""
    import scipy.sparse as sp

    from ops.sparse import Adjacency

    n_rows = hi - lo
    col_ids = np.unique(src)
    r = dst - lo
    counts = np.bincount(r, minlength=n_rows)
    if counts.size > n_rows or counts.min(initial=1) == 0:   # every vertex has its self-loop
        raise RuntimeError(f"internal error: block {block}: in-edges outside the block or vertices without any "
                           f"(the self-loop at least)")
    # each destination's in-edges come from one shard, sorted by src: a stable sort by row keeps them sorted
    order = None if r.size < 2 or (np.diff(r) >= 0).all() else np.argsort(r, kind="stable")
    c = np.searchsorted(col_ids, src if order is None else src[order])
    a = sp.csr_matrix((w if order is None else w[order], c, np.concatenate([[0], np.cumsum(counts)])),
                      shape=(n_rows, col_ids.size), dtype=np.float32)
    adj = Adjacency.from_scipy(a, row_gids=np.arange(lo, hi), col_gids=col_ids, nnz_pad=_pow2(a.nnz),
                               rows_pad=_pow2(n_rows), cols_pad=_pow2(col_ids.size))
    return adj, col_ids


def _apply(fn, seg: Segment, jparams, block: int, lo: int, hi: int, rows_of, cols_of, edges) -> dict:
    """Run ``seg`` on block rows [lo, hi): ``rows_of(name)`` gives the block's own rows of a state tensor,
    ``cols_of(name, ids)`` the rows at sorted source ids, ``edges()`` the block's (dst, src, weight). Returns the
    written tensors (or the logits), unpadded."""
    rp = _pow2(hi - lo)
    if not seg.exchanged:                # row stages only: every tensor of the state at the block's rows
        state = {n: _pad_rows(v, rp) for n, v in rows_of(None).items()}
        out = fn(seg.stages, seg.final, jparams, state, _Rows(_pad_rows(np.arange(lo, hi), rp)))
    else:
        adj, col_ids = _block_adjacency(block, lo, hi, *edges())
        cp = _pow2(col_ids.size)
        state = {n: _pad_rows(cols_of(n, col_ids), cp) for n in seg.exchanged}
        state.update({n: _pad_rows(rows_of(n), rp) for n in seg.row_reads})
        out = fn(seg.stages, seg.final, jparams, state, adj)
    names = ("logits",) if seg.final is not None else seg.writes
    return {n: np.asarray(out[n])[: hi - lo] for n in names}


def state_shapes(plan: "Plan") -> list[dict]:
    """The row shape of every tensor of the state before segment 0 and after each segment, found by running the
    segments on a two-vertex graph of self-loops."""
    import jax.numpy as jnp

    jparams = {k: {n: jnp.asarray(v) for n, v in p.items()} for k, p in plan.params.items()}
    tensors = {"h": np.zeros((2, plan.feature_dim), np.float32)}
    shapes = [{"h": (plan.feature_dim,)}]
    edges = (np.arange(2), np.arange(2), np.ones(2, np.float32))
    for seg in plan.segments:
        tensors = _apply(_jitted(), seg, jparams, 0, 0, 2,
                         lambda n, t=tensors: t if n is None else t[n], lambda n, ids, t=tensors: t[n][ids],
                         lambda: edges)
        shapes.append({n: tuple(v.shape[1:]) for n, v in tensors.items()})
    return shapes


# --- the block stages ----------------------------------------------------------------------------------------------
def _check_done(done: int, n: int) -> None:
    """The stage before a barrier finished every vertex (a runner that loses elements fails here, not later)."""
    if done != n:
        raise RuntimeError(f"internal error: the previous stage finished {done} of {n} vertices; the runner lost "
                           f"elements")


class _Columns(beam.DoFn):
    """(shard index, manifest entry) -> the shard's raw columns under WORK (blockstore); yields their record."""

    def __init__(self, plan: "Plan", work: str):
        self.plan, self.work = plan, work

    def process(self, item):
        index, entry = item
        p = self.plan
        yield blockstore.write_shard_columns(p.shards_root, entry, self.work, index,
                                             blockstore.Blocks(p.num_vertices, p.block), p.feature_dim,
                                             unit_weights=p.model_name == "gat")


class _BlockFn(beam.DoFn):
    """Base of the per-block stages: the shard columns and the state files of WORK, opened once per worker."""

    def __init__(self, plan: "Plan", work: str):
        self.plan, self.work = plan, work
        self.blocks = blockstore.Blocks(plan.num_vertices, plan.block)

    def setup(self):
        self.state = blockstore.State(self.work, self.plan.num_vertices)
        self._cols = None

    @property
    def cols(self) -> blockstore.ShardColumns:
        if self._cols is None:     # opened at the first block: the columns exist once the barrier side input has run
            self._cols = blockstore.ShardColumns(self.work, len(self.plan.partitions), self.plan.model_name == "gat")
        return self._cols


class _Place(_BlockFn):
    """Block -> its input features (row-normalized when the run's config says so) written to state 0."""

    def process(self, block, after):
        from pipelines.data.graph import row_normalize

        if len(after) != len(self.plan.partitions):
            raise RuntimeError(f"internal error: {len(after)} of {len(self.plan.partitions)} shards copied; "
                               f"the runner lost elements")
        lo, hi = self.blocks.rows(block)
        x = self.cols.vertices(block, lo, hi, self.plan.feature_dim)
        if self.plan.feature_norm == "row":
            x = row_normalize(x)
        self.state.write_rows(0, "h", lo, x)
        yield hi - lo


class _Apply(_BlockFn):
    """Block -> segment k run on it (GA/AE over its in-edges with source rows read from state k, then its AV
    stages), its rows of state k + 1 written."""

    def __init__(self, plan: "Plan", work: str, k: int, names: tuple):
        super().__init__(plan, work)
        self.k, self.seg, self.names = k, plan.segments[k], names

    def setup(self):
        import jax.numpy as jnp

        super().setup()
        self.fn = _jitted()
        self.jparams = {s: {n: jnp.asarray(v) for n, v in p.items()} for s, p in self.plan.params.items()}

    def process(self, block, after):
        _check_done(after, self.plan.num_vertices)
        k, lo, hi = self.k, *self.blocks.rows(block)

        def rows_of(name):
            if name is None:
                return {n: self.state.read(k, n, slice(lo, hi)) for n in self.names}
            return self.state.read(k, name, slice(lo, hi))

        out = _apply(self.fn, self.seg, self.jparams, block, lo, hi, rows_of,
                     lambda name, ids: self.state.read(k, name, ids), lambda: self.cols.edges(block))
        for name, rows in out.items():
            self.state.write_rows(k + 1, name, lo, rows)
        yield hi - lo


class _WritePredictions(beam.DoFn):
    """Output shard s -> the predictions of blocks s, s + S, s + 2S, ... (from the last state's logits) as one
    Parquet file sorted by vertex."""

    def __init__(self, plan: "Plan", work: str, root: str, k: int):
        self.plan, self.work, self.root, self.k = plan, work, root, k

    def process(self, shard, after):
        p = self.plan
        _check_done(after, p.num_vertices)
        blocks, state = blockstore.Blocks(p.num_vertices, p.block), blockstore.State(self.work, p.num_vertices)
        ranges = [blocks.rows(b) for b in range(shard, blocks.count, p.output_shards)]
        ids = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
        logits = np.concatenate([state.read(self.k, "logits", slice(lo, hi)) for lo, hi in ranges])
        pred = np.argmax(logits, axis=-1).astype(np.int32)
        table = file_schemas.predictions_table(ids, pred, logits if p.embeddings else None)
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
    """PBegin -> Stat records of the prediction files written under ``root`` (see the module docstring).

    The elements are shard entries and block ids only; every stage reads and writes the arrays of ``root/_work``
    (:mod:`pipelines.beam.blockstore`), whose state files :func:`build` creates. Each stage waits for the one
    before it through a side input (a barrier), since it reads rows that any block of that stage wrote."""

    def __init__(self, plan: Plan, root: str):
        super().__init__()
        self.plan, self.root = plan, root

    def expand(self, pbegin):
        plan, work = self.plan, work_dir(self.root)
        n_blocks = blockstore.Blocks(plan.num_vertices, plan.block).count

        def barrier(pcoll, label):
            return beam.pvalue.AsSingleton(pcoll | f"Done[{label}]" >> beam.CombineGlobally(sum))

        columns = (
            pbegin
            | "Shards" >> beam.Create(list(enumerate(plan.partitions)))
            | "SpreadShards" >> beam.Reshuffle()
            | "Columns" >> beam.ParDo(_Columns(plan, work))
        )
        blocks = pbegin | "Blocks" >> beam.Create(list(range(n_blocks))) | "SpreadBlocks" >> beam.Reshuffle()
        done = blocks | "Place" >> beam.ParDo(_Place(plan, work), after=beam.pvalue.AsList(columns))
        names = ("h",)
        for k, seg in enumerate(plan.segments):
            label = "-".join(s.name for s in seg.stages) or "logits"
            done = blocks | f"Apply[{label}]" >> beam.ParDo(_Apply(plan, work, k, names), after=barrier(done, label))
            names = ("logits",) if seg.final is not None else seg.writes
        os.makedirs(os.path.join(self.root, "predictions"), exist_ok=True)
        return (
            pbegin
            | "OutputShards" >> beam.Create(list(range(min(plan.output_shards, n_blocks))))
            | "Write" >> beam.ParDo(_WritePredictions(plan, work, self.root, len(plan.segments)),
                                    after=barrier(done, "logits-all"))
        )


def work_dir(root: str) -> str:
    return os.path.join(root, "_work")


def build(p: beam.Pipeline, plan: Plan, root: str) -> None:
    """The infer pipeline on ``p``, its state files created under ``root/_work`` (empty, at full size)."""
    state = blockstore.State(work_dir(root), plan.num_vertices)
    for k, shapes in enumerate(state_shapes(plan)):
        state.create(k, shapes)
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
        shutil.rmtree(work_dir(str(tmp)), ignore_errors=True)
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
