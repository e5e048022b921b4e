"""OGB loader room: a node-property-prediction dataset in the directory layout OGB writes (ogbn-arxiv, -products).

    DIR/raw/edge.csv.gz          one edge per line: `src,dst` (0-based node ids, no header)
    DIR/raw/node-feat.csv.gz     one row per node: F comma-separated floats
    DIR/raw/node-label.csv.gz    one row per node: an integer class (empty or `nan`: unlabelled)
    DIR/raw/num-node-list.csv.gz the node count (OGB keeps it in raw/; DIR/num-node-list.csv.gz is accepted too)
    DIR/split/<name>/{train,valid,test}.csv.gz   node ids, one per line

`--dataset DIR` selects it (a directory with a raw/ folder); `DIR?split=NAME` picks a split when split/ holds
several (with exactly one it is used). Files are parsed with pyarrow's CSV reader (gzip by extension); a row that
does not parse is reported as `file:line` by a slow rescan, as for edge lists. Edges are symmetrized by
`make_graph` (ogbn-arxiv's are directed; OGB's own loaders add the inverse edges for training too).
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from pipelines.data.graph import DataError, Graph, make_graph

SPLIT_PARTS = ("train", "valid", "test")


def is_ogb_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "raw").is_dir() or (path / "split").is_dir())


def _need_file(root: Path, path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(f"OGB dataset {root}: missing {what} file {path}")
    return path


def _lines(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        yield from enumerate(f, start=1)


def _first_bad_line(path: Path, columns: int, kind: str) -> str | None:
    """Slow path, only after pyarrow failed: the first line that does not hold `columns` values of `kind`."""
    try:
        for lineno, line in _lines(path):
            tokens = [t.strip() for t in line.rstrip("\r\n").split(",")]
            if len(tokens) != columns:
                return f"{path}:{lineno}: expected {columns} comma-separated values, got {len(tokens)}: {line.strip()!r}"
            for t in tokens:
                if kind == "label" and t.lower() in ("", "nan"):
                    continue
                try:
                    float(t) if kind == "float" else int(t)
                except ValueError:
                    return f"{path}:{lineno}: {t!r} is not {'a number' if kind == 'float' else 'an integer'}"
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        return f"{path}: not a readable gzip CSV file ({e})"
    return None


def _width(path: Path) -> int:
    try:
        for _, line in _lines(path):
            return len(line.split(","))
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: not a readable gzip CSV file ({e})") from None
    return 0


def read_csv(path: Path, columns: int, dtype: pa.DataType, kind: str) -> list[np.ndarray]:
    """Parse a header-less CSV(.gz) of `columns` columns into numpy columns; DataError naming file:line if bad."""
    names = [f"c{i}" for i in range(columns)]
    if _width(path) == 0:  # an empty file (a split part with no nodes, say): pyarrow refuses it
        return [np.zeros(0, dtype.to_pandas_dtype()) for _ in names]
    try:
        table = pcsv.read_csv(
            path, read_options=pcsv.ReadOptions(column_names=names, block_size=1 << 24),
            parse_options=pcsv.ParseOptions(newlines_in_values=False),
            convert_options=pcsv.ConvertOptions(column_types={n: dtype for n in names},
                                                null_values=["", "nan", "NaN"] if kind == "label" else [],
                                                strings_can_be_null=False, quoted_strings_can_be_null=False))
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(_first_bad_line(path, columns, kind) or f"{path}: could not parse the file ({e})") from None
    out = []
    for n in names:
        col = table.column(n)
        if kind != "label" and col.null_count:
            raise DataError(_first_bad_line(path, columns, kind) or f"{path}: empty values")
        if kind == "label":
            col = col.fill_null(-1)
        out.append(col.to_numpy())
    return out


def _num_nodes(root: Path) -> int:
    path = root / "raw" / "num-node-list.csv.gz"
    if not path.is_file() and (root / "num-node-list.csv.gz").is_file():
        path = root / "num-node-list.csv.gz"
    (n,) = read_csv(_need_file(root, path, "node count"), 1, pa.int64(), "int")
    if n.size != 1 or n[0] < 1:
        raise DataError(f"{path}: expected one positive node count (one graph), got {n.tolist()[:5]}")
    return int(n[0])


def _split_dir(root: Path, name: str | None) -> Path:
    base = root / "split"
    names = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    if name is None:
        if not names:
            raise DataError(f"OGB dataset {root}: no split under {base} (split/<name>/train.csv.gz, valid, test)")
        if len(names) > 1:
            raise DataError(f"OGB dataset {root}: several splits {names}; pick one with {root}?split=NAME")
        name = names[0]
    if name not in names:
        raise DataError(f"OGB dataset {root}: unknown split {name!r}; the dataset has {names}")
    return base / name


def read_split(root: Path, n: int, name: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train/valid/test masks from split/<name>/*.csv.gz: ids in range, no id twice, the parts disjoint."""
    d = _split_dir(root, name)
    masks, owner = [], np.full(n, -1, np.int8)
    for k, part in enumerate(SPLIT_PARTS):
        path = _need_file(root, d / f"{part}.csv.gz", f"{part} split")
        (ids,) = read_csv(path, 1, pa.int64(), "int")
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise DataError(f"{path}: node id {bad} is out of range [0, {n})")
        if np.unique(ids).size != ids.size:
            raise DataError(f"{path}: a node id appears twice")
        clash = ids[owner[ids] >= 0]
        if clash.size:
            raise DataError(f"{path}: node {int(clash[0])} is also in the {SPLIT_PARTS[owner[clash[0]]]} split")
        owner[ids] = k
        m = np.zeros(n, bool)
        m[ids] = True
        masks.append(m)
    return masks[0], masks[1], masks[2]


def load_ogb(root: str | Path, split: str | None = None, name: str | None = None) -> Graph:
    """Load an OGB node-property-prediction directory (see the module docstring)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"OGB dataset {root}: not a directory")
    name = name or root.name
    n = _num_nodes(root)
    edges = _need_file(root, root / "raw" / "edge.csv.gz", "edge")
    src, dst = read_csv(edges, 2, pa.int64(), "int")
    if src.size:
        lo, hi = int(min(src.min(), dst.min())), int(max(src.max(), dst.max()))
        if lo < 0 or hi >= n:
            raise DataError(f"{edges}: node id {lo if lo < 0 else hi} is out of range [0, {n}) "
                            f"({n} nodes in num-node-list)")
    labels_path = _need_file(root, root / "raw" / "node-label.csv.gz", "node label")
    label_width = _width(labels_path)
    if label_width != 1:
        raise DataError(f"{labels_path}: {label_width} label columns; only single-label node "
                        f"classification is supported (one integer class per node)")
    (y,) = read_csv(labels_path, 1, pa.float64(), "label")
    if y.size != n:
        raise DataError(f"{labels_path}: {y.size} labels, expected {n} (one per node)")
    if (y != np.round(y)).any():
        raise DataError(f"{labels_path}: labels must be integers, found {float(y[y != np.round(y)][0])}")
    feats = _need_file(root, root / "raw" / "node-feat.csv.gz", "node feature")
    width = _width(feats)
    cols = read_csv(feats, width, pa.float32(), "float") if width else []
    if cols and cols[0].size != n:
        raise DataError(f"{feats}: {cols[0].size} feature rows, expected {n} (one per node)")
    x = np.empty((n, len(cols)), np.float32)
    for i, c in enumerate(cols):  # fill in place: one copy of the features, not a stack of columns plus one
        x[:, i] = c
    del cols
    train, val, test = read_split(root, n, split)
    return make_graph(name, src, dst, x, y.astype(np.int64), train, val, test)
