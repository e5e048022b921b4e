"""The prepare pipeline: its transforms wired together (:func:`build`) and the driver, ``run(argv)``."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import apache_beam as beam

from pipelines.beam.combiners import Stat, StatsFn
from pipelines.beam.prepare.manifest import check_stats, make_manifest
from pipelines.beam.prepare.options import Config, build_parser, make_config
from pipelines.beam.prepare.partition import AssignPartitions, Symmetrize
from pipelines.beam.prepare.read_edges import ReadEdges
from pipelines.beam.prepare.shards import BuildPartitions, WriteEdgeShards
from pipelines.beam.prepare.spill import remove as remove_spill
from pipelines.beam.prepare.split import Split
from pipelines.beam.prepare.tables import ReadTable
from pipelines.beam.prepare.validate import Validate
from pipelines.beam.runners import RunnerUnavailable, engine_flags, pipeline_options
from pipelines.beam.writers import check_output, read_stats, staged_output, write_json, write_stats
from pipelines.data.graph import DataError
from schemas.files import MANIFEST_FILE

log = logging.getLogger("dorylus.prepare")


def build(p: beam.Pipeline, cfg: Config, root: str) -> None:
    """Add the prepare transforms to ``p``; shards and ``_stats.json`` are written under ``root``."""
    read = p | "ReadEdges" >> ReadEdges(cfg.edges)
    valid = read["chunks"] | "Validate" >> Validate(cfg.num_nodes, cfg.num_nodes_source)
    if cfg.num_nodes is not None:
        num_nodes = p | "NumNodes" >> beam.Create([cfg.num_nodes])
    else:
        num_nodes = (
            valid["max_id"]
            | "MaxId" >> beam.CombineGlobally(lambda ids: max(ids, default=-1))
            | "PlusOne" >> beam.Map(lambda m: m + 1)
        )
    parts = {"edges": valid["edges"], "num_nodes": num_nodes} | "AssignPartitions" >> AssignPartitions(
        cfg.partitioner, cfg.partitions, cfg.assignment, cfg.seed)
    assignment = parts["assignment"]
    sym = valid["edges"] | "Symmetrize" >> Symmetrize(assignment, root)
    entries = sym["entries"]

    stats = [read["stats"], valid["stats"], sym["stats"],
             num_nodes | "NumNodesStat" >> beam.Map(lambda n: Stat("max:num_nodes", int(n)))]
    if parts["stats"] is not None:
        stats.append(parts["stats"])
    inputs = {"edges": entries, "assignment": assignment, "num_nodes": num_nodes}
    feature_dim = 0
    if cfg.features is not None:
        feats = p | "ReadFeatures" >> ReadTable(cfg.features, "features", cfg.num_nodes, assignment,
                                                spill_root=root)
        inputs["features"] = feats["rows"]
        stats.append(feats["stats"])
        feature_dim = cfg.features.dim
    if cfg.labels is not None:
        labels = p | "ReadLabels" >> ReadTable(cfg.labels, "labels", cfg.num_nodes, assignment)
        inputs["labels"] = labels["rows"]
        stats.append(labels["stats"])
        if cfg.split:
            inputs["split"] = {"labels": labels["rows"], "num_nodes": num_nodes} | "Split" >> Split(
                cfg.seed, cfg.train_per_class, cfg.val_per_class)
    if cfg.split_file is not None:
        splits = p | "ReadSplits" >> ReadTable(cfg.split_file, "splits", cfg.num_nodes, assignment)
        inputs["splits"] = splits["rows"]
        stats.append(splits["stats"])
    built = inputs | "BuildPartitions" >> BuildPartitions(root, cfg.partitions, feature_dim)
    stats.append(built["stats"])
    files = {"entries": built["entries"], "degrees": built["degrees"], "num_nodes": num_nodes} | \
        "WriteEdgeShards" >> WriteEdgeShards(root)
    stats.append(files)
    (
        stats
        | "AllStats" >> beam.Flatten()
        | "MergeStats" >> beam.CombineGlobally(StatsFn())
        | "WriteStats" >> beam.Map(write_stats, root=root)
    )


def run(argv: list[str] | None = None) -> dict:
    """Run the prepare pipeline on ``argv`` (app flags, then Beam's); returns the manifest. Raises DataError on
    bad input (nothing is left in --out) and RunnerUnavailable when the runner cannot start."""
    args, pipeline_args = build_parser().parse_known_args(argv)
    cfg = make_config(args)
    out = Path(args.out).absolute()
    check_output(out, args.overwrite)
    pipeline_args = engine_flags(args.engine, args.workers, pipeline_args)
    options = pipeline_options(pipeline_args)
    with staged_output(out, args.overwrite) as tmp:
        with beam.Pipeline(options=options) as p:
            build(p, cfg, str(tmp))
        remove_spill(str(tmp))
        stats = read_stats(tmp)
        check_stats(stats, cfg.max_bad_records)
        manifest = make_manifest(stats, cfg, args, pipeline_args, out.name)
        write_json(tmp / MANIFEST_FILE, manifest)
    c = manifest["counters"]
    if c["bad_records"]:
        log.warning("skipped %d bad edge records, e.g. %s", c["bad_records"], manifest["bad_record_samples"][:3])
    log.info("prepared %s: %d vertices, %d edges, %d partitions (%d self-loops, %d duplicates dropped)", out,
             manifest["num_vertices"], manifest["num_edges"], manifest["num_partitions"], c["self_loops"],
             c["duplicate_edges"])
    return manifest


def summary_line(manifest: dict) -> dict:
    """The one-line JSON summary ``prepare`` prints: sizes and the output folder."""
    return {k: manifest[k] for k in ("num_vertices", "num_edges", "feature_dim", "num_classes", "num_partitions")} | \
        {"out": str(Path(manifest["flags"]["out"]))}


def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.prepare``: run, print the summary line; bad input is one line on stderr, exit 2."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        manifest = run(argv)
    except (DataError, RunnerUnavailable) as e:   # one line, exit 2: the convention of the `dorylus` CLI
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary_line(manifest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
