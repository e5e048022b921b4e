"""Read a prepared graph (the output of the Beam prepare pipeline, pipelines/beam/prepare/) back, without Beam.

    adj, x, y, train, val, test, manifest = load_prepared("runs/g-prepared")
    graph = load_graph("runs/g-prepared")             # the project's Graph record (pipelines/data/graph.py)
    a_hat = normalized_adjacency("runs/g-prepared")   # Â from the stored weights, as gcn_normalize returns it
    edges, vertices = read_partition("runs/g-prepared", 3)   # one graph server's shards (pyarrow Tables)

Every file named by the manifest is checked against its recorded row count and (unless ``verify=False``) its
sha256; a shard that is missing, changed or truncated raises :class:`ShardError`.
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.sparse as sp

from pipelines.data.features import FeatureStats, norm_from_stats
from pipelines.data.graph import DataError, clean_adjacency, make_graph
from pipelines.data.registry import sha256_file
from schemas.files import (MANIFEST_FILE, PREPARED_FORMAT, PREPARED_FORMAT_VERSIONS, SPLIT_CODES, SPLIT_NAMES,
                           validate_manifest)
from schemas.messages import SchemaError


class ShardError(DataError):
    """A prepared directory is incomplete, inconsistent or was modified after it was written."""


class Prepared(NamedTuple):
    adj: sp.csr_matrix            # symmetric binary N x N, no self-loops (the Graph.adj convention)
    features: np.ndarray          # float32 [N, F] (F may be 0)
    labels: np.ndarray            # int32 [N], -1 = unlabelled
    train_mask: np.ndarray        # bool [N]
    val_mask: np.ndarray
    test_mask: np.ndarray
    manifest: dict


def read_manifest(root: str | os.PathLike) -> dict:
    """The validated manifest of a prepared directory; ShardError when it is missing or of another format."""
    path = os.path.join(root, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise ShardError(f"{root}: no {MANIFEST_FILE} (not a prepared graph, or an unfinished/failed prepare run)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (ValueError, OSError) as e:
        raise ShardError(f"{path}: not a readable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise ShardError(f"{path}: not a manifest (a JSON {type(manifest).__name__}, not an object)")
    if manifest.get("format") != PREPARED_FORMAT:
        raise ShardError(f"{path}: format {manifest.get('format')!r}, expected {PREPARED_FORMAT!r}")
    if manifest.get("format_version") not in PREPARED_FORMAT_VERSIONS:
        raise ShardError(f"{path}: format version {manifest.get('format_version')!r}; this reader knows "
                         f"{list(PREPARED_FORMAT_VERSIONS)} (prepare the graph again)")
    try:
        return validate_manifest(manifest)
    except SchemaError as e:
        raise ShardError(f"{path}: {e}") from None


def _check_shard(root, entry: dict, kind: str, verify: bool) -> str:
    path = os.path.join(root, entry[kind])
    if not os.path.isfile(path):
        raise ShardError(f"{path}: listed in the manifest but missing")
    if verify:
        digest = sha256_file(path)
        if digest != entry[f"{kind}_sha256"]:
            raise ShardError(f"{path}: sha256 {digest} does not match the manifest's {entry[f'{kind}_sha256']}")
    return path


def verify_shards(root: str | os.PathLike, manifest: dict | None = None) -> dict:
    """Check that every shard the manifest lists is there with its sha256, without reading it (what a pipeline
    that reads the shards itself checks first); returns the manifest."""
    manifest = manifest or read_manifest(root)
    for entry in manifest["partitions"]:
        for kind in ("edges", "vertices"):
            _check_shard(root, entry, kind, True)
    return manifest


def _read_shard(root, entry: dict, kind: str, verify: bool, columns=None) -> pa.Table:
    """kind: "edges" or "vertices" of a manifest partition entry."""
    path = _check_shard(root, entry, kind, verify)
    rows = entry["num_edges" if kind == "edges" else "num_vertices"]
    table = pq.read_table(path, columns=columns)
    if table.num_rows != rows:
        raise ShardError(f"{path}: {table.num_rows} rows, the manifest says {rows}")
    return table


def read_partition(root: str | os.PathLike, partition: int, verify: bool = True,
                   manifest: dict | None = None) -> tuple[pa.Table, pa.Table]:
    """(edges, vertices) Tables of one partition."""
    manifest = manifest or read_manifest(root)
    entries = [e for e in manifest["partitions"] if e["partition"] == partition]
    if len(entries) != 1:
        raise ShardError(f"{root}: partition {partition} is not in the manifest")
    return _read_shard(root, entries[0], "edges", verify), _read_shard(root, entries[0], "vertices", verify)


def read_all(root: str | os.PathLike, verify: bool = True, manifest: dict | None = None,
             vertex_columns=None) -> tuple[pa.Table, pa.Table, dict]:
    """(edges, vertices, manifest): all partitions' rows concatenated, vertices sorted by id."""
    manifest = manifest or read_manifest(root)
    entries = sorted(manifest["partitions"], key=lambda e: e["partition"])
    edges = [_read_shard(root, e, "edges", verify) for e in entries]
    vertices = [_read_shard(root, e, "vertices", verify, vertex_columns) for e in entries]
    edges = pa.concat_tables(edges) if edges else None
    vertices = pa.concat_tables(vertices) if vertices else None
    if vertices is not None:
        vertices = vertices.sort_by("vertex")
    return edges, vertices, manifest


def _columns(root, verify, manifest=None, vertex_columns=None):
    edges, vertices, manifest = read_all(root, verify, manifest, vertex_columns)
    n = int(manifest["num_vertices"])
    ids = vertices.column("vertex").to_numpy() if vertices is not None else np.zeros(0, np.int64)
    if not np.array_equal(ids, np.arange(n)):
        raise ShardError(f"{root}: the vertex shards do not hold every vertex 0..{n - 1} exactly once")
    return edges, vertices, manifest, n


def normalized_adjacency(root: str | os.PathLike, verify: bool = True) -> sp.csr_matrix:
    """Â = D^-1/2 (A + I) D^-1/2 from the stored weights: float32 CSR, sorted indices (row = dst, col = src)."""
    edges, _, manifest, n = _columns(root, verify, vertex_columns=["vertex"])
    if edges is None or edges.num_rows == 0:
        return sp.csr_matrix((n, n), dtype=np.float32)
    src = edges.column("src").to_numpy()
    dst = edges.column("dst").to_numpy()
    a = sp.csr_matrix((edges.column("weight").to_numpy(), (dst, src)), shape=(n, n), dtype=np.float32)
    a.sum_duplicates()
    a.sort_indices()
    a.indices = a.indices.astype(np.int32)
    a.indptr = a.indptr.astype(np.int64 if a.nnz > np.iinfo(np.int32).max else np.int32)
    return a


def _edge_list(edges: pa.Table | None) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of the stored edges without the self-loops."""
    if edges is None or edges.num_rows == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    src = edges.column("src").to_numpy()
    dst = edges.column("dst").to_numpy()
    keep = src != dst
    return src[keep], dst[keep]


def _vertex_arrays(vertices: pa.Table, manifest: dict, n: int):
    f = int(manifest.get("feature_dim", 0))
    if f > 0:
        col = vertices.column("features").combine_chunks()
        features = col.flatten().to_numpy().astype(np.float32, copy=False).reshape(n, f)
    else:
        features = np.zeros((n, 0), np.float32)
    labels = vertices.column("label").to_numpy().astype(np.int32) if n else np.zeros(0, np.int32)
    split = vertices.column("split").to_numpy() if n else np.zeros(0, np.int8)
    masks = [np.asarray(split == SPLIT_CODES[name], dtype=bool) for name in SPLIT_NAMES]
    return np.ascontiguousarray(features), labels, masks


def load_prepared(root: str | os.PathLike, verify: bool = True) -> Prepared:
    """(adj, features, labels, train_mask, val_mask, test_mask, manifest) of a prepared directory."""
    edges, vertices, manifest, n = _columns(root, verify)
    adj = clean_adjacency(*_edge_list(edges), n)
    features, labels, masks = _vertex_arrays(vertices, manifest, n)
    return Prepared(adj, features, labels, masks[0], masks[1], masks[2], manifest)


def partition_assignment(root: str | os.PathLike, verify: bool = True) -> np.ndarray:
    """int32 [N]: the partition of every vertex."""
    manifest = read_manifest(root)
    entries = sorted(manifest["partitions"], key=lambda e: e["partition"])
    n = int(manifest["num_vertices"])
    out = np.full(n, -1, np.int32)
    for e in entries:
        t = _read_shard(root, e, "vertices", verify, ["vertex", "partition"])
        out[t.column("vertex").to_numpy()] = t.column("partition").to_numpy()
    if (out < 0).any():
        raise ShardError(f"{root}: the vertex shards do not hold every vertex 0..{n - 1}")
    return out


def load_graph(root: str | os.PathLike, name: str | None = None, verify: bool = True):
    """The prepared graph as the project's :class:`pipelines.data.graph.Graph` (via ``make_graph``)."""
    edges, vertices, manifest, n = _columns(root, verify)
    src, dst = _edge_list(edges)
    del edges
    features, labels, masks = _vertex_arrays(vertices, manifest, n)
    num_classes = manifest.get("num_classes") or None
    return make_graph(name or manifest.get("name") or os.path.basename(os.path.abspath(root)), src, dst, features,
                      labels, *masks, num_classes=num_classes)


def feature_norm_of(root: str | os.PathLike, mode: str, manifest: dict | None = None) -> str:
    """The feature normalization `mode` resolves to for a prepared graph ("auto": decided from its features,
    one vertex shard at a time, as `pipelines.data.features.resolve_feature_norm` decides for a whole matrix)."""
    if mode != "auto":
        return mode
    manifest = manifest or read_manifest(root)
    dim = int(manifest["feature_dim"])
    stats = FeatureStats(dim, float("inf"), 0, 0)
    for entry in manifest["partitions"]:
        col = _read_shard(root, entry, "vertices", False, ["features"]).column("features").combine_chunks()
        x = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), dim)
        stats = stats + FeatureStats.of(x)
    return norm_from_stats(stats)
