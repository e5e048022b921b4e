"""The prepare pipeline's own flags (argparse; Beam's flags go to PipelineOptions) and their checks -> Config."""
from __future__ import annotations

import argparse
from typing import NamedTuple

from apache_beam.io.filesystems import FileSystems

from pipelines.beam.prepare.partition import PARTITIONERS
from pipelines.beam.prepare.tables import TableInfo, inspect_features, inspect_labels
from pipelines.beam.prepare.validate import ID_LIMIT
from pipelines.beam.runners import CommandParser, add_engine_arguments
from pipelines.data.graph import DataError


class Config(NamedTuple):
    """The checked flags of a run: what the pipeline is built from."""

    edges: str
    out: str
    features: TableInfo | None
    labels: TableInfo | None
    num_nodes: int | None          # static N (flag or file rows); None = max id + 1
    num_nodes_source: str
    partitions: int
    partitioner: str
    assignment: str | None
    max_bad_records: int
    split: bool
    seed: int
    train_per_class: int
    val_per_class: int
    split_file: TableInfo | None = None


def build_parser() -> argparse.ArgumentParser:
    """The app flags of ``python -m pipelines.prepare`` (every other flag goes to Beam's PipelineOptions)."""
    ap = CommandParser(
        prog="python -m pipelines.prepare",
        description="Validate, symmetrize, GCN-normalize, partition and shard a graph (Apache Beam). "
                    "Flags not listed here go to Beam's PipelineOptions (e.g. --runner=FlinkRunner).")
    ap.add_argument("--edges", required=True, metavar="GLOB", help="edge files: CSV/TSV/whitespace text or Parquet")
    ap.add_argument("--features", metavar="PATH", help="node features: .npy [N, F] or Parquet")
    ap.add_argument("--labels", metavar="PATH", help="node labels: .npy [N] or Parquet (-1 = unlabelled)")
    ap.add_argument("--num-nodes", type=int, metavar="N", help="vertex count (default: feature/label rows, "
                                                               "else max edge id + 1)")
    ap.add_argument("--partitions", type=int, default=1, metavar="P")
    ap.add_argument("--partitioner", choices=PARTITIONERS, default="hash",
                    help="hash: v %% P; metis: pymetis (whole graph in one worker); file: --assignment")
    ap.add_argument("--assignment", metavar="FILE", help="METIS partition file: line i = partition of vertex i")
    ap.add_argument("--max-bad-records", type=int, default=0, metavar="N",
                    help="fail when more edge lines than this are malformed (default 0)")
    ap.add_argument("--split", action="store_true",
                    help="seeded per-class split of the labelled vertices (needs --labels)")
    ap.add_argument("--split-file", metavar="PATH",
                    help="a given split: .npy int [N] (or Parquet 'split' column) of codes -1 none, 0 train, "
                         "1 val, 2 test")
    ap.add_argument("--train-per-class", type=int, default=20)
    ap.add_argument("--val-per-class", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="seed of the split and of METIS (default 0)")
    ap.add_argument("--out", required=True, metavar="DIR")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    add_engine_arguments(ap)
    return ap


def make_config(args: argparse.Namespace) -> Config:
    """Check the flags and the feature/label files' shapes before any pipeline runs (cheap, clear errors)."""
    if args.partitions < 1:
        raise DataError(f"--partitions must be >= 1, got {args.partitions}")
    if args.partitioner == "file" and not args.assignment:
        raise DataError("--partitioner file needs --assignment FILE")
    if args.assignment and args.partitioner != "file":
        raise DataError("--assignment is only used with --partitioner file")
    if args.assignment and not FileSystems.exists(args.assignment):
        raise DataError(f"assignment file {args.assignment} does not exist")
    if args.max_bad_records < 0:
        raise DataError("--max-bad-records must be >= 0")
    if args.split and not args.labels:
        raise DataError("--split needs --labels")
    if args.split and args.split_file:
        raise DataError("--split and --split-file exclude each other")
    if args.split_file and not args.labels:
        raise DataError("--split-file needs --labels")
    if args.num_nodes is not None and not 0 <= args.num_nodes <= ID_LIMIT:
        raise DataError(f"--num-nodes must lie in [0, {ID_LIMIT}]")
    if args.workers is not None and args.workers < 1:
        raise DataError(f"--workers must be >= 1, got {args.workers}")
    try:
        matched = FileSystems.match([args.edges])[0].metadata_list
    except Exception as e:  # BeamIOError for a missing non-glob path on some file systems
        raise DataError(f"--edges {args.edges!r}: {e}") from None
    if not matched:
        raise DataError(f"--edges {args.edges!r} matches no file")
    feats = inspect_features(args.features) if args.features else None
    labels = inspect_labels(args.labels) if args.labels else None
    splits = inspect_labels(args.split_file, "split", "split") if args.split_file else None
    n, source = args.num_nodes, "--num-nodes"
    for info, what in ((feats, "--features"), (labels, "--labels"), (splits, "--split-file")):
        if info is None:
            continue
        if n is None:
            n, source = info.rows, f"from the {info.rows} rows of {what} {info.path}"
        elif info.rows != n and not (what == "--split-file" and info.id_column):
            raise DataError(f"{what} {info.path} has {info.rows} rows but the graph has {n} vertices ({source})")
    if feats is not None and feats.kind == "npy" and feats.dim == 0:
        feats = None   # [N, 0]: no features
    return Config(args.edges, args.out, feats, labels, n, source, args.partitions, args.partitioner,
                  args.assignment, args.max_bad_records, args.split, args.seed, args.train_per_class,
                  args.val_per_class, splits)
