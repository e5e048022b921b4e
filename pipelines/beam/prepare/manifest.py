"""The driver's side of a prepare run: the merged stats -> errors (bad input, lost elements) and the manifest."""
from __future__ import annotations

import argparse
import datetime

from pipelines.beam.prepare.options import Config
from pipelines.beam.prepare.shards import EDGE_SCHEMA, vertex_schema
from pipelines.data.graph import DataError
from schemas import files as file_schemas
from schemas.files import PREPARED_FORMAT, PREPARED_FORMAT_VERSION, SPLIT_NAMES
from schemas.messages import SCHEMA_VERSION

ERROR_COUNTERS = (
    ("ids_out_of_range", "edge ids out of range"),
    ("features_vertex_out_of_range", "feature rows for vertices outside the graph"),
    ("nan_features", "feature rows with NaN/inf"),
    ("bad_feature_rows", "feature rows of the wrong width or null"),
    ("missing_features", "vertices without a feature row"),
    ("duplicate_features", "vertices with several feature rows"),
    ("labels_vertex_out_of_range", "label rows for vertices outside the graph"),
    ("bad_labels", "invalid labels"),
    ("missing_labels", "vertices without a label row"),
    ("duplicate_labels", "vertices with several label rows"),
    ("splits_vertex_out_of_range", "split rows for vertices outside the graph"),
    ("bad_splits", "invalid split codes"),
    ("duplicate_splits", "vertices with several split rows"),
    ("split_unlabelled", "vertices in a split without a label"),
    ("assignment_errors", "partition assignment problems"),
)


def check_flow(stats: dict) -> None:
    """Every element that left a stage arrived at the next one: RuntimeError if not. Counted pairs:
    routed:X / grouped:X (edge entries, feature/label/split rows into the partition groups) and
    deduped:entries / written:entries (unique entries into the edge shards)."""
    count = {k: int(v[0]) for k, v in stats.items() if k.split(":", 1)[0] in ("routed", "grouped", "deduped",
                                                                               "written")}
    pairs = [(f"routed:{x}", f"grouped:{x}") for x in ("entries", "features", "labels", "splits")]
    pairs.append(("deduped:entries", "written:entries"))
    lost = [f"{a}={count.get(a, 0)} but {b}={count.get(b, 0)}"
            for a, b in pairs if count.get(a, 0) != count.get(b, 0)]
    if lost:
        raise RuntimeError("internal error: the runner lost or duplicated elements between stages (" +
                           "; ".join(lost) + "); with the DirectRunner, --workers > 1 is known to drop elements "
                           "at scale in Beam 2.77: run with one worker or another runner")


def check_stats(stats: dict, max_bad_records: int) -> None:
    """Raise DataError naming every problem the pipeline found (with examples)."""
    check_flow(stats)
    problems = []
    for name, what in ERROR_COUNTERS:
        n, samples = stats.get(name, (0, []))
        if n:
            problems.append(f"{n} {what}, e.g. " + "; ".join(map(str, samples[:3])))
    n_bad, samples = stats.get("bad_records", (0, []))
    if n_bad > max_bad_records:
        problems.append(f"{n_bad} bad edge records exceed --max-bad-records={max_bad_records}: "
                        + "; ".join(map(str, samples[:5])))
    if problems:
        raise DataError("prepare failed: " + " | ".join(problems))


COUNTERS = ("input_records", "bad_records", "header_lines", "self_loops", "duplicate_edges")


def make_manifest(stats: dict, cfg: Config, args: argparse.Namespace, pipeline_args: list[str], name: str) -> dict:
    """The manifest of a finished run from its merged stats; RuntimeError when
    the shard records do not add up."""
    files = sorted(stats.get("list:files", (0, []))[1], key=lambda f: (f["kind"], f["partition"]))
    by_kind = {k: [f for f in files if f["kind"] == k] for k in ("edges", "vertices")}
    for kind, lst in by_kind.items():
        got = [f["partition"] for f in lst]
        if got != list(range(cfg.partitions)):
            raise RuntimeError(f"internal error: {kind} shards {got} written for {cfg.partitions} partitions")
    n = int(stats.get("max:num_nodes", (0,))[0])
    edge_rows = sum(f["rows"] for f in by_kind["edges"])
    vertex_rows = sum(f["rows"] for f in by_kind["vertices"])
    if vertex_rows != n:
        raise RuntimeError(f"internal error: {vertex_rows} vertex rows for {n} vertices")
    max_label = stats.get("max:label")
    counters = {c: int(stats.get(c, (0,))[0]) for c in COUNTERS}
    counters["valid_edges"] = (counters["input_records"] - counters["bad_records"] - counters["self_loops"])
    split = None
    if cfg.split or cfg.split_file is not None:
        split = {s: int(stats.get(f"split_{s}", (0,))[0]) for s in SPLIT_NAMES}
        if cfg.split:
            split.update(source="per-class", seed=cfg.seed, train_per_class=cfg.train_per_class,
                         val_per_class=cfg.val_per_class)
        else:
            split.update(source=cfg.split_file.path)
    partitions = []
    for e, v in zip(by_kind["edges"], by_kind["vertices"]):
        partitions.append({"partition": e["partition"], "vertices": v["path"], "edges": e["path"],
                           "num_vertices": v["rows"], "num_edges": e["rows"],
                           "vertices_sha256": v["sha256"], "edges_sha256": e["sha256"],
                           "vertices_bytes": v["bytes"], "edges_bytes": e["bytes"]})
    f = cfg.features.dim if cfg.features is not None else 0
    manifest = {
        "format": PREPARED_FORMAT,
        "format_version": PREPARED_FORMAT_VERSION,
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "num_vertices": n,
        "num_edges": edge_rows - n,            # directed, both directions, without the self-loops (= adj.nnz)
        "num_edge_rows": edge_rows,            # rows in the edge shards: num_edges + one self-loop per vertex
        "num_partitions": cfg.partitions,
        "feature_dim": f,
        "num_classes": int(max_label[0]) + 1 if max_label else 0,
        "directed": False,
        "partitioner": cfg.partitioner,
        "normalization": "gcn: edge rows hold A_hat[dst, src] = 1/sqrt(deg(src)) * 1/sqrt(deg(dst)) of "
                         "A_hat = D^-1/2 (A + I) D^-1/2; degree counts the self-loop",
        "partitions": partitions,              # num_edges of a partition = its edge-shard rows (self-loops too)
        "split": split,
        "counters": counters,
        "bad_record_samples": list(stats.get("bad_records", (0, []))[1]),
        "flags": dict(vars(args)),
        "pipeline_args": list(pipeline_args),
        "schemas": {"edges": EDGE_SCHEMA.to_string(show_schema_metadata=False),
                    "vertices": vertex_schema(f).to_string(show_schema_metadata=False)},
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return file_schemas.validate_manifest(manifest)
