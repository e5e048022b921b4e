"""The infer pipeline's on-disk arrays: shards as raw columns cut into vertex blocks, and each segment's vertex state.

Beam's DirectRunner holds every shuffled PCollection in memory, and an exchange between vertex blocks ships each
source row once per destination block that reads it (nearly once per edge on a graph without locality). So the
infer pipeline moves no graph data through Beam at all; its elements are block ids, and the data lives here:

* **Shard columns** (``WORK/shards/<i>.{src,dst,weight,vertex,features}.npy``): one pass over a prepared shard
  copies its Parquet columns into raw ``.npy`` files (ids as int32 when they fit) and records, per vertex block,
  the row range the block's rows occupy (``<i>.{edge,vertex}_offsets.npy``). Shards are sorted by destination
  (edges) and by vertex (vertices), so a block is one contiguous slice of every shard, read by memory map.
* **State** (``WORK/state/<k>/<tensor>.npy``): dense float arrays ``[N, ...]`` indexed by vertex id, one per row
  tensor of the state after segment k (k = 0: the input features). The driver creates them at full size (sparse
  files: nothing is written until a block writes its rows); each block writes its own contiguous row range with
  ``pwrite``, so concurrent writers never touch the same bytes and a retried block rewrites the same bytes.
  The next segment reads source rows at any vertex by memory map, after a barrier (a side input) says every
  block of the previous segment is done.

Like prepare's spill folder, WORK must be on a file system the workers and the driver share; the driver removes it.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import pyarrow.parquet as pq

from pipelines.data.graph import DataError

_BATCH = 1 << 20


def id_dtype(num_vertices: int):
    """The narrowest integer type of vertex ids: int32 below 2^31 vertices."""
    return np.int32 if num_vertices <= np.iinfo(np.int32).max else np.int64


class Blocks(NamedTuple):
    """Vertex blocks of ``size`` consecutive ids over ``num_vertices`` vertices (the last one may be short)."""

    num_vertices: int
    size: int

    @property
    def count(self) -> int:
        return -(-self.num_vertices // self.size)

    def rows(self, b: int) -> tuple[int, int]:
        return b * self.size, min(self.num_vertices, (b + 1) * self.size)

    def starts(self) -> np.ndarray:
        """The first id of every block and N at the end: [count + 1]."""
        return np.minimum(np.arange(self.count + 1, dtype=np.int64) * self.size, self.num_vertices)


class _NpyWriter:
    """A ``.npy`` file of known shape written front to back in chunks, then renamed into place (atomic)."""

    def __init__(self, path: str, dtype, shape: tuple):
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.f = open(path + ".tmp", "wb")
        np.lib.format.write_array_header_1_0(self.f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                      "fortran_order": False, "shape": self.shape})
        self.rows = 0

    def write(self, a: np.ndarray) -> None:
        np.ascontiguousarray(a, self.dtype).tofile(self.f)
        self.rows += a.shape[0]

    def close(self) -> None:
        self.f.close()
        if self.rows != self.shape[0]:
            raise RuntimeError(f"internal error: {self.path}: {self.rows} rows written of {self.shape[0]}")
        os.replace(self.path + ".tmp", self.path)


def _save(path: str, a: np.ndarray) -> None:
    w = _NpyWriter(path, a.dtype, a.shape)
    w.write(a)
    w.close()


def _check_range(ids: np.ndarray, n: int, what: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise DataError(f"{what}: vertex id {ids[(ids < 0) | (ids >= n)][0]} out of range [0, {n})")


def _check_sorted(ids: np.ndarray, prev: int, n: int, what: str, row: int, strict: bool) -> int:
    """Ids in [0, n) and sorted (strictly for vertices) after ``prev`` (-1 at the start); returns the last id."""
    if ids.size == 0:
        return prev
    _check_range(ids, n, what)
    d = np.diff(ids, prepend=prev)
    bad = np.flatnonzero(d <= 0 if strict else d < 0)
    if bad.size:
        raise DataError(f"{what}: rows are not sorted by {'vertex' if strict else 'dst'} (row {row + bad[0]}); "
                        f"it was not written by dorylus prepare")
    return int(ids[-1])


def write_shard_columns(root: str, entry: dict, work: str, index: int, blocks: Blocks, feature_dim: int,
                        unit_weights: bool) -> dict:
    """Copy one prepared shard (its edge and vertex Parquet files) into raw columns under ``work/shards``; returns
    the small record the block stages read (:class:`ShardColumns` paths are derived from ``work`` and ``index``)."""
    folder = os.path.join(work, "shards")
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, str(index))
    n, itype, starts = blocks.num_vertices, id_dtype(blocks.num_vertices), blocks.starts()

    pf = pq.ParquetFile(os.path.join(root, entry["edges"]))
    e = pf.metadata.num_rows
    if e != entry["num_edges"]:
        raise DataError(f"{entry['edges']}: {e} rows, the manifest says {entry['num_edges']}")
    cols = ["src", "dst"] if unit_weights else ["src", "dst", "weight"]
    out = {c: _NpyWriter(f"{base}.{c}.npy", np.float32 if c == "weight" else itype, (e,)) for c in cols}
    offsets, prev, row = np.zeros(starts.size, np.int64), -1, 0
    for batch in pf.iter_batches(batch_size=_BATCH, columns=cols):
        src, dst = batch.column(0).to_numpy(), batch.column(1).to_numpy()
        prev = _check_sorted(dst, prev, n, entry["edges"], row, strict=False)
        _check_range(src, n, entry["edges"])
        offsets += np.searchsorted(dst, starts)
        out["src"].write(src)
        out["dst"].write(dst)
        if not unit_weights:
            out["weight"].write(batch.column(2).to_numpy())
        row += src.size
    offsets[-1] = e
    for w in out.values():
        w.close()
    _save(f"{base}.edge_offsets.npy", offsets)

    pf = pq.ParquetFile(os.path.join(root, entry["vertices"]))
    v = pf.metadata.num_rows
    if v != entry["num_vertices"]:
        raise DataError(f"{entry['vertices']}: {v} rows, the manifest says {entry['num_vertices']}")
    ids_w = _NpyWriter(f"{base}.vertex.npy", itype, (v,))
    x_w = _NpyWriter(f"{base}.features.npy", np.float32, (v, feature_dim))
    offsets, prev, row = np.zeros(starts.size, np.int64), -1, 0
    cols = ["vertex", "features"] if feature_dim else ["vertex"]
    for batch in pf.iter_batches(batch_size=_BATCH // 8, columns=cols):
        ids = batch.column(0).to_numpy()
        prev = _check_sorted(ids, prev, n, entry["vertices"], row, strict=True)
        offsets += np.searchsorted(ids, starts)
        ids_w.write(ids)
        if feature_dim:
            x_w.write(batch.column(1).flatten().to_numpy().reshape(-1, feature_dim))
        row += ids.size
    offsets[-1] = v
    ids_w.close()
    x_w.close()
    _save(f"{base}.vertex_offsets.npy", offsets)
    return {"index": index, "edges": e, "vertices": v}


class NpyFile:
    """Read side of one ``.npy`` file: row ranges by ``pread`` (they stay out of the process's resident set) and
    scattered rows through one memory map kept open (the kernel keeps its pages as reclaimable page cache)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            np.lib.format.read_magic(f)
            self.shape, _, self.dtype = np.lib.format.read_array_header_1_0(f)
            self.offset = f.tell()
        self.row_items = int(np.prod(self.shape[1:], dtype=np.int64))
        self._map = None

    def rows(self, lo: int, hi: int) -> np.ndarray:
        n = (hi - lo) * self.row_items
        a = np.fromfile(self.path, self.dtype, count=n, offset=self.offset + lo * self.row_items * self.dtype.itemsize)
        if a.size != n:
            raise RuntimeError(f"internal error: {self.path}: rows {lo}:{hi} past its end")
        return a.reshape((hi - lo, *self.shape[1:]))

    def take(self, ids: np.ndarray) -> np.ndarray:
        if self._map is None:
            self._map = np.load(self.path, mmap_mode="r")
        return np.array(self._map[ids])


class ShardColumns:
    """Read side of the shard columns: the slices of every shard that hold one block's rows (memory-mapped)."""

    def __init__(self, work: str, shards: int, unit_weights: bool):
        self.base = [os.path.join(work, "shards", str(i)) for i in range(shards)]
        self.unit = unit_weights
        self.edge_offsets = [np.load(f"{b}.edge_offsets.npy") for b in self.base]
        self.vertex_offsets = [np.load(f"{b}.vertex_offsets.npy") for b in self.base]
        self._files: dict[str, NpyFile] = {}

    def _rows(self, base: str, column: str, lo: int, hi: int) -> np.ndarray:
        path = f"{base}.{column}.npy"
        if path not in self._files:
            self._files[path] = NpyFile(path)
        return self._files[path].rows(lo, hi)

    def edges(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dst, src, weight) of block b's in-edges, shard after shard: a destination's in-edges are all in the
        shard of its partition, sorted by src there. Weight 1 for unit-weight models; ids in the columns' type."""
        parts = []
        for base, off in zip(self.base, self.edge_offsets):
            lo, hi = int(off[b]), int(off[b + 1])
            if hi > lo:
                cols = [self._rows(base, c, lo, hi) for c in ("dst", "src")]
                w = np.ones(hi - lo, np.float32) if self.unit else self._rows(base, "weight", lo, hi)
                parts.append((*cols, w))
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))

    def vertices(self, b: int, lo: int, hi: int, feature_dim: int) -> np.ndarray:
        """The features of vertices [lo, hi) (block b), in id order; DataError unless every one is held once."""
        ids, xs = [], []
        for base, off in zip(self.base, self.vertex_offsets):
            s, e = int(off[b]), int(off[b + 1])
            if e > s:
                ids.append(self._rows(base, "vertex", s, e))
                xs.append(self._rows(base, "features", s, e))
        ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
        order = np.argsort(ids, kind="stable")
        if not np.array_equal(ids[order], np.arange(lo, hi)):
            have = np.zeros(hi - lo, np.int64)
            np.add.at(have, ids - lo, 1)
            bad = int(np.flatnonzero(have != 1)[0]) + lo
            raise DataError(f"vertex {bad} is in {int(have[bad - lo])} vertex shards (want exactly 1)")
        if not feature_dim:
            return np.zeros((hi - lo, 0), np.float32)
        return np.concatenate(xs)[order].astype(np.float32, copy=False)


class State:
    """The vertex state after each segment: ``work/state/<k>/<name>.npy`` of shape [N, *shape], float32."""

    def __init__(self, work: str, num_vertices: int):
        self.work, self.n = work, num_vertices
        self._files: dict[str, NpyFile] = {}

    def path(self, k: int, name: str) -> str:
        return os.path.join(self.work, "state", str(k), f"{name}.npy")

    def create(self, k: int, shapes: dict) -> None:
        """Driver side: empty (sparse) files for every tensor of state k, at full size."""
        os.makedirs(os.path.dirname(self.path(k, "_")), exist_ok=True)
        for name, shape in shapes.items():
            with open(self.path(k, name), "wb") as f:
                np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                                         "shape": (self.n, *shape)})
                f.truncate(f.tell() + self.n * int(np.prod(shape, dtype=np.int64)) * 4)

    def write_rows(self, k: int, name: str, lo: int, rows: np.ndarray) -> None:
        """Write rows [lo, lo + len(rows)) of tensor ``name`` of state k in place (idempotent)."""
        path = self.path(k, name)
        with open(path, "r+b") as f:
            np.lib.format.read_magic(f)
            shape, _, _ = np.lib.format.read_array_header_1_0(f)
            header = f.tell()
        rows = np.ascontiguousarray(rows, np.float32)
        if rows.shape[1:] != tuple(shape[1:]):
            raise RuntimeError(f"internal error: {path}: rows of shape {rows.shape[1:]}, the file {shape[1:]}")
        data = memoryview(rows).cast("B")
        fd = os.open(path, os.O_WRONLY)
        try:
            off, done = header + lo * int(np.prod(shape[1:], dtype=np.int64)) * 4, 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], off + done)
        finally:
            os.close(fd)

    def read(self, k: int, name: str, ids: np.ndarray | slice) -> np.ndarray:
        """Rows ``ids`` (sorted ids, or a slice) of tensor ``name`` of state k, as an in-memory array."""
        path = self.path(k, name)
        if path not in self._files:
            self._files[path] = NpyFile(path)
        f = self._files[path]
        return f.rows(ids.start, ids.stop) if isinstance(ids, slice) else f.take(ids)
