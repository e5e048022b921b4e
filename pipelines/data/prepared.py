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

from ops.host import host_zeros
from pipelines.data.features import FeatureStats, norm_from_stats
from pipelines.data.graph import DataError, clean_adjacency, make_graph, release_free_memory
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
    """The prepared graph as the project's :class:`pipelines.data.graph.Graph`.

    Streamed into place: the adjacency is built from the edge shards' (dst, src) columns a record batch at a time
    (two passes: degrees, then indices; the weights are not read), and every vertex shard's features, labels
    and split are written into preallocated arrays, so the graph costs its final arrays and one batch beside
    them (``make_graph`` then checks the features, labels and masks as for every other source)."""
    manifest = read_manifest(root)
    n = int(manifest["num_vertices"])
    adj = _adjacency_from_shards(root, manifest, n, verify)
    features, labels, masks = _vertex_arrays_streamed(root, manifest, n, verify)
    release_free_memory()
    num_classes = manifest.get("num_classes") or None
    return make_graph(name or manifest.get("name") or os.path.basename(os.path.abspath(root)), None, None,
                      features, labels, *masks, num_classes=num_classes, adj=adj)


EDGE_BATCH = 1 << 22   # rows per record batch when the edge shards are streamed


def _edge_batches(root, manifest: dict, verify: bool):
    """(dst, src) int64 arrays of every stored entry without the self-loops, a record batch at a time."""
    for entry in sorted(manifest["partitions"], key=lambda e: e["partition"]):
        path = _check_shard(root, entry, "edges", verify)
        pf = pq.ParquetFile(path)
        if pf.metadata.num_rows != entry["num_edges"]:
            raise ShardError(f"{path}: {pf.metadata.num_rows} rows, the manifest says {entry['num_edges']}")
        for batch in pf.iter_batches(columns=["dst", "src"], batch_size=EDGE_BATCH):
            dst = batch.column(0).to_numpy()
            src = batch.column(1).to_numpy()
            keep = src != dst
            yield dst[keep], src[keep]


def _adjacency_from_shards(root, manifest: dict, n: int, verify: bool) -> sp.csr_matrix:
    """The binary symmetric CSR (Graph convention) of the stored entries. Each entry's row is its dst; a
    partition's shard is sorted by (dst, src) and owns its dst rows, so indices arrive sorted row by row."""
    deg = np.zeros(n, np.int64)
    out_deg = np.zeros(n, np.int64)
    for dst, src in _edge_batches(root, manifest, verify):
        if dst.size and (min(dst.min(), src.min()) < 0 or max(dst.max(), src.max()) >= n):
            raise ShardError(f"{root}: an edge shard names a vertex outside [0, {n})")
        deg += np.bincount(dst, minlength=n)
        out_deg += np.bincount(src, minlength=n)
    if not np.array_equal(deg, out_deg):   # both directions of every edge are stored
        raise ShardError(f"{root}: the edge shards are not symmetric (vertex {int(np.flatnonzero(deg != out_deg)[0])} "
                         f"has {int(deg[deg != out_deg][0])} in- and {int(out_deg[deg != out_deg][0])} out-entries)")
    del out_deg
    nnz = int(deg.sum())
    itype = np.int64 if nnz > np.iinfo(np.int32).max else np.int32
    indptr = np.zeros(n + 1, itype)
    np.cumsum(deg, out=indptr[1:])
    del deg
    indices = np.empty(nnz, np.int32)
    fill = indptr[:-1].astype(np.int64)
    for dst, src in _edge_batches(root, manifest, verify):
        if dst.size > 1 and not (dst[1:] >= dst[:-1]).all():
            order = np.argsort(dst, kind="stable")
            dst, src = dst[order], src[order]
        if not dst.size:
            continue
        starts = np.flatnonzero(np.concatenate([[True], dst[1:] != dst[:-1]]))
        runs = np.diff(np.append(starts, dst.size))
        heads = dst[starts]
        pos = np.repeat(fill[heads] - starts, runs) + np.arange(dst.size)
        indices[pos] = src
        fill[heads] += runs
    if not np.array_equal(fill, indptr[1:]):
        raise ShardError(f"{root}: the edge shards changed while they were read")
    # The binary adjacency's values are one read-only 1.0 seen nnz times (stride 0), not 4 bytes per entry: the
    # Graph's adjacency is read, never written, and every consumer (normalization, partitioning) builds its own
    ones = np.broadcast_to(np.float32(1.0), (nnz,))
    a = sp.csr_matrix((ones, indices, indptr), shape=(n, n))
    if not a.has_sorted_indices:   # shards written by prepare are sorted by (dst, src): this is for others
        a.data = np.ones(nnz, np.float32)
        a.sort_indices()
        a.data = ones
    a.has_sorted_indices = True
    return a


def _vertex_arrays_streamed(root, manifest: dict, n: int, verify: bool):
    """(features [N, F] float32, labels [N] int32, (train, val, test) masks), each shard's rows placed by id."""
    f = int(manifest.get("feature_dim", 0))
    features = host_zeros((n, f), np.float32)   # aligned: the device uses it in place (`ops.host`)
    labels = np.full(n, -1, np.int32)
    split = np.full(n, SPLIT_CODES["none"], np.int8)
    seen = np.zeros(n, bool)
    columns = ["vertex", "label", "split"] + (["features"] if f > 0 else [])
    for entry in manifest["partitions"]:
        path = _check_shard(root, entry, "vertices", verify)
        pf = pq.ParquetFile(path)
        if pf.metadata.num_rows != entry["num_vertices"]:
            raise ShardError(f"{path}: {pf.metadata.num_rows} rows, the manifest says {entry['num_vertices']}")
        for batch in pf.iter_batches(columns=columns, batch_size=EDGE_BATCH // max(f, 1)):
            ids = batch.column(0).to_numpy()
            if ids.size and (ids.min() < 0 or ids.max() >= n or seen[ids].any()):
                raise ShardError(f"{root}: the vertex shards do not hold every vertex 0..{n - 1} exactly once")
            seen[ids] = True
            labels[ids] = batch.column(1).to_numpy()
            split[ids] = batch.column(2).to_numpy()
            if f > 0:
                col = batch.column(3)
                features[ids] = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), f)
    if not seen.all():
        raise ShardError(f"{root}: the vertex shards do not hold every vertex 0..{n - 1} exactly once")
    return features, labels, [np.asarray(split == SPLIT_CODES[name]) for name in SPLIT_NAMES]


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
