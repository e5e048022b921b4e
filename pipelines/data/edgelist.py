"""Edge-list loader room: a CSV/TSV/whitespace edge list plus per-node feature, label and split files.

Edge file: one edge per line, exactly two non-negative integer node ids `src dst` separated by a comma, a tab
or spaces (sniffed from the first data line). `#` starts a comment (whole line or trailing); blank lines
are skipped; the first data line may be a header (e.g. `src,dst`). Edges are undirected for training:
`make_graph` symmetrizes them and drops self-loops and duplicates.

Companion files, by default found next to the edge file: for `g.csv` (or `g.tsv`, `g.txt`) they are
`g.labels.{npy,parquet}` (required), `g.features.{npy,parquet}` (optional) and `g.split.{npy,parquet}`
(optional). Explicit paths override the siblings.

- labels: int array [N] (.npy), or a Parquet column `label`; -1 = unlabelled. N = len(labels) is the node
  count, so every edge id must be < N. Labels are required: a graph without them cannot be trained on.
- features: float array [N, F] (.npy), or Parquet with one list<float> column or F numeric columns.
  Without a feature file the nodes get `degree_features` (constant + one-hot log2 degree bucket).
- split: int array [N] (.npy) or Parquet column `split`, with 0/1/2 (or "train"/"val"/"test") and -1/null
  for none. Without it, a seeded Shchur split: 20 train and 30 val nodes per class, other labelled nodes test.

In Parquet files an optional integer column `node` (or `node_id`, `id`) gives each row's node id; rows are
then placed by it (it must be a permutation of 0..N-1). Parquet files must not be pickles: .npy files are
loaded with allow_pickle=False.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data.features import degree_features
from pipelines.data.graph import DataError, Graph, make_graph
from pipelines.data.splits import per_class_split

EDGE_SUFFIXES = (".csv", ".tsv", ".txt", ".edges", ".el")
ID_COLUMNS = ("node", "node_id", "id")
SPLIT_NAMES = {"train": 0, "val": 1, "valid": 1, "validation": 1, "test": 2}


def _data_lines(path: Path):
    """Yield (line number, tokens-string) of every non-blank line with comments stripped."""
    with open(path, "r", encoding="utf-8-sig", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            body = line.split("#", 1)[0].strip()
            if body:
                yield lineno, body


def _split_tokens(body: str, delimiter: str | None) -> list[str]:
    return [t.strip() for t in body.split(delimiter)] if delimiter else body.split()


def _is_int(token: str) -> bool:
    try:
        int(token)
        return True
    except ValueError:
        return False


def _sniff(path: Path) -> tuple[str | None, int, int]:
    """(delimiter, line number of a header or 0, line number of the first data line or 0)."""
    lines = _data_lines(path)
    first = next(lines, None)
    if first is None:
        return None, 0, 0
    lineno, body = first
    delimiter = "," if "," in body else "\t" if "\t" in body else None
    tokens = _split_tokens(body, delimiter)
    if all(_is_int(t) for t in tokens):
        return delimiter, 0, lineno
    nxt = next(lines, None)
    return delimiter, lineno, nxt[0] if nxt else 0


def _scan_for_error(path: Path, delimiter: str | None, header_line: int) -> None:
    """Slow path, only after the fast parser failed: find the first bad line and name it."""
    for lineno, body in _data_lines(path):
        if lineno <= header_line:
            continue
        tokens = _split_tokens(body, delimiter)
        if len(tokens) != 2:
            raise DataError(f"{path}:{lineno}: expected 2 columns (src, dst), got {len(tokens)}: {body!r}")
        for t in tokens:
            if not _is_int(t):
                raise DataError(f"{path}:{lineno}: node id {t!r} is not an integer")
            if int(t) < 0:
                raise DataError(f"{path}:{lineno}: node id {t} is negative")


def read_edges(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse an edge-list file into int64 (src, dst); malformed lines raise DataError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing edge-list file {path}")
    delimiter, header_line, first_data = _sniff(path)
    if first_data == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    try:
        # NumPy's C reader is ~100x faster than a Python loop; it only reports data-row numbers, so on
        # failure we rescan in Python to name the physical line.
        arr = np.loadtxt(path, dtype=np.int64, comments="#", delimiter=delimiter, skiprows=header_line,
                         ndmin=2, encoding="utf-8-sig")
    except ValueError:
        arr = None
    if arr is None or arr.shape[1] != 2 or (arr.size and arr.min() < 0):
        _scan_for_error(path, delimiter, header_line)
        raise DataError(f"{path}: could not parse the edge list")
    return np.ascontiguousarray(arr[:, 0]), np.ascontiguousarray(arr[:, 1])


def _parquet_rows(path: Path, table: pa.Table) -> tuple[np.ndarray | None, pa.Table]:
    """Split off the node-id column, if any, and return the row order it implies."""
    for col in ID_COLUMNS:
        if col in table.column_names:
            ids = table.column(col).to_numpy()
            if not np.issubdtype(ids.dtype, np.integer):
                raise DataError(f"{path}: column {col!r} must hold integer node ids")
            if not np.array_equal(np.sort(ids), np.arange(ids.size)):
                raise DataError(f"{path}: column {col!r} is not a permutation of 0..{ids.size - 1}")
            return ids, table.drop_columns([col])
    return None, table


def _place(ids: np.ndarray | None, values: np.ndarray) -> np.ndarray:
    if ids is None:
        return values
    out = np.empty_like(values)
    out[ids] = values
    return out


def _read_parquet(path: Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def _read_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a readable .npy file ({e})") from None


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def read_features(path: str | Path) -> np.ndarray:
    """Node features [N, F] from .npy or Parquet (one list column, or one numeric column per feature)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing feature file {path}")
    if path.suffix == ".npy":
        x = _read_npy(path)
    elif path.suffix == ".parquet":
        ids, table = _parquet_rows(path, _read_parquet(path))
        if table.num_columns == 1 and _is_list(table.schema.field(0).type):
            col = table.column(0).combine_chunks()
            if col.null_count:
                raise DataError(f"{path}: feature column has null rows")
            if pa.types.is_fixed_size_list(col.type):
                lengths = np.full(len(col), col.type.list_size)
            else:
                lengths = col.value_lengths().to_numpy()
            if lengths.size and (lengths != lengths[0]).any():
                raise DataError(f"{path}: feature rows have different lengths")
            width = int(lengths[0]) if lengths.size else 0
            x = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), width)
        else:
            for field in table.schema:
                if not (pa.types.is_integer(field.type) or pa.types.is_floating(field.type)):
                    raise DataError(f"{path}: feature column {field.name!r} has non-numeric type {field.type}")
            x = np.column_stack([table.column(i).to_numpy() for i in range(table.num_columns)]) \
                if table.num_columns else np.zeros((table.num_rows, 0))
        x = _place(ids, x)
    else:
        raise DataError(f"{path}: feature files must be .npy or .parquet")
    if x.ndim != 2:
        raise DataError(f"{path}: features must be 2-D [nodes, features], got shape {x.shape}")
    return x


def _read_column(path: Path, column: str) -> np.ndarray:
    if path.suffix == ".npy":
        return _read_npy(path)
    if path.suffix != ".parquet":
        raise DataError(f"{path}: {column} files must be .npy or .parquet")
    ids, table = _parquet_rows(path, _read_parquet(path))
    if column in table.column_names:
        col = table.column(column)
    elif table.num_columns == 1:
        col = table.column(0)
    else:
        raise DataError(f"{path}: no {column!r} column among {table.column_names}")
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_dictionary(col.type):
        values = np.array(col.to_pylist(), dtype=object)
    else:
        values = col.to_numpy(zero_copy_only=False)
        if col.null_count:  # nulls arrive as NaN in a float array
            values = np.where(np.isnan(values), -1, values).astype(np.int64)
    return _place(ids, values)


def _read_1d(path: str | Path, column: str, what: str) -> tuple[Path, np.ndarray]:
    """(path, values) of a per-node file (.npy or a Parquet `column`); DataError when missing or not 1-D."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing {column} file {path}")
    values = _read_column(path, column)
    if values.ndim != 1:
        raise DataError(f"{path}: {what} must be 1-D, got shape {values.shape}")
    return path, values


def read_labels(path: str | Path) -> np.ndarray:
    """Integer labels [N] from .npy or a Parquet `label` column; -1 (or null) means unlabelled."""
    path, y = _read_1d(path, "label", "labels")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: labels must be integers, got dtype {y.dtype}")
    return y


def read_split(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train/val/test masks from 0/1/2 (or "train"/"val"/"test") per node, -1 or null = no split."""
    path, s = _read_1d(path, "split", "split")
    if s.dtype == object or s.dtype.kind in "US":
        unknown = {v for v in s.tolist() if v is not None and str(v).lower() not in SPLIT_NAMES}
        if unknown:
            raise DataError(f"{path}: unknown split names {sorted(map(str, unknown))}; use train/val/test")
        s = np.array([-1 if v is None else SPLIT_NAMES[str(v).lower()] for v in s.tolist()], dtype=np.int64)
    if not np.issubdtype(s.dtype, np.integer) or (s.size and (s.min() < -1 or s.max() > 2)):
        raise DataError(f"{path}: split values must be -1, 0 (train), 1 (val) or 2 (test)")
    return s == 0, s == 1, s == 2


def companion(path: str | Path, kind: str) -> Path | None:
    """The sibling `<stem>.<kind>.npy` or `.parquet` of an edge file, if one exists."""
    path = Path(path)
    for ext in (".npy", ".parquet"):
        p = path.with_name(f"{path.stem}.{kind}{ext}")
        if p.is_file():
            return p
    return None


def load_edgelist(
    path: str | Path,
    features: str | Path | None = None,
    labels: str | Path | None = None,
    split: str | Path | None = None,
    name: str | None = None,
    seed: int = 0,
    train_per_class: int = 20,
    val_per_class: int = 30,
) -> Graph:
    """Load an edge list with its companion files (see the module docstring for the layout)."""
    path = Path(path)
    name = name or path.stem
    if not path.is_file():
        raise DataError(f"missing edge-list file {path}")
    labels = Path(labels) if labels is not None else companion(path, "labels")
    if labels is None:
        raise DataError(f"{path}: node labels are required for training; pass labels=FILE or put "
                        f"{path.with_name(path.stem + '.labels.npy')} (or .parquet) next to it")
    features = Path(features) if features is not None else companion(path, "features")
    split = Path(split) if split is not None else companion(path, "split")

    y = read_labels(labels)
    n = y.shape[0]
    src, dst = read_edges(path)
    if src.size:
        hi = int(max(src.max(), dst.max()))
        if hi >= n:
            raise DataError(f"{path}: edge endpoint id {hi} is out of range [0, {n}) "
                            f"({n} nodes, from the label file {labels})")
    if features is not None:
        x = read_features(features)
        if x.shape[0] != n:
            raise DataError(f"label count {n} ({labels}) does not match feature rows {x.shape[0]} ({features})")
    else:
        x = None
    if split is not None:
        train, val, test = read_split(split)
        if train.shape[0] != n:
            raise DataError(f"{split}: split has {train.shape[0]} entries, expected {n} (one per node)")
    else:
        num_classes = int(y.max()) + 1 if y.size and y.max() >= 0 else 0
        train, val, test = per_class_split(y, num_classes, train_per_class, val_per_class, seed)
    if x is None:
        # Default features need the degrees, so build the graph once with a placeholder and swap them in.
        g = make_graph(name, src, dst, np.zeros((n, 0), np.float32), y, train, val, test)
        return g.replace(features=degree_features(g.adj))
    return make_graph(name, src, dst, x, y, train, val, test)
