"""Dataset registry room: names, checksums, the data directory, fetching, and `load_dataset(spec)`.

A dataset spec is one of:

- None or "": the default synthetic graph, `planted_partition()` (3000 nodes, 7 classes; see synthetic.py).
- a known name: cora, citeseer (Planetoid, public split), cora-ml, amazon-computers, coauthor-cs
  (gnn-benchmark npz, seeded 20/30-per-class split). Every file is checked against its sha256 first.
- `synthetic:planted?nodes=3000&classes=7&degree=8&homophily=0.55&features=128&noise=0.8`
- `synthetic:rmat?scale=16&edges=1000000&a=0.57&b=0.19&c=0.19&features=32&classes=8` (or `nodes=` for scale)
  Both take `train=`/`val=` (nodes per class, default 20/30) and `seed=` (overrides the seed argument).
- a path, with the format taken from its shape:
  - `dir/name.npz`: a flat SparseGraph npz (npz.py);
  - `dir/ogbn_arxiv`: a directory in OGB's node-property layout (`raw/edge.csv.gz`, ..., `split/<name>/`),
    `?split=NAME` when it holds several splits (ogb.py);
  - `dir/ind.cora`: a Planetoid prefix, i.e. `dir/ind.cora.x`, `.y`, ... exist (planetoid.py);
  - `dir/g.csv` / `.tsv` / `.txt` / `.edges` / `.el`: an edge list; its labels, features and split come
    from the siblings `g.labels.npy|parquet`, `g.features.npy|parquet`, `g.split.npy|parquet`, or from a
    query string `g.csv?labels=l.parquet&features=x.npy&split=s.npy` (relative to the edge file's folder).

The data directory is `--data-dir`, else $DORYLUS_DATA_DIR, else ~/.cache/dorylus/datasets. Its layout
mirrors the shared datasets folder (`planetoid/ind.cora.x`, `gnn_benchmark/cora_ml.npz`), so pointing it at
a copy of that folder works, and so does serving such a folder over HTTP as a fetch base URL.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipelines.data.graph import DataError, Graph
from pipelines.data.npz import load_npz
from pipelines.data.planetoid import PARTS, load_planetoid
from pipelines.data.synthetic import planted_partition, rmat

ENV_DATA_DIR = "DORYLUS_DATA_DIR"
ENV_BASE_URL = "DORYLUS_DATASET_BASE_URL"
DEFAULT_DATA_DIR = Path("~/.cache/dorylus/datasets")

_PLANETOID_URL = "https://raw.githubusercontent.com/kimiyoung/planetoid/af6abf468a772cc055bec88c52e4d6f51b7c37e3/data"
_CORA_ML_URL = ("https://raw.githubusercontent.com/danielzuegner/gnn-meta-attack/"
                "982d900d05f19f0bd061b8d4988310bd7baa5f91/data/cora_ml.npz")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A known dataset: files (path under the data dir -> sha256), how to load it, where to fetch it."""

    name: str
    kind: str  # "planetoid" or "npz"
    files: dict[str, str]
    # Public URL per file holding exactly these bytes; None where no public copy is byte-identical.
    urls: dict[str, str | None]
    description: str


def _planetoid(name: str, sha: dict[str, str], description: str) -> DatasetInfo:
    files = {f"planetoid/ind.{name}.{part}": sha[part] for part in PARTS}
    urls = {rel: f"{_PLANETOID_URL}/{rel.split('/', 1)[1]}" for rel in files}
    return DatasetInfo(name, "planetoid", files, urls, description)


DATASETS: dict[str, DatasetInfo] = {
    "cora": _planetoid("cora", {
        "allx": "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543",
        "ally": "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71",
        "graph": "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d",
        "test.index": "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875",
        "tx": "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a",
        "ty": "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad",
        "x": "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab",
        "y": "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1",
    }, "Cora citation graph (Planetoid), 2708 nodes, public 140/500/1000 split"),
    "citeseer": _planetoid("citeseer", {
        "allx": "2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668",
        "ally": "f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95",
        "graph": "d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7",
        "test.index": "2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4",
        "tx": "539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21",
        "ty": "55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce",
        "x": "d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6",
        "y": "8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924",
    }, "CiteSeer citation graph (Planetoid), 3327 nodes, public 120/500/1000 split"),
    "cora-ml": DatasetInfo(
        "cora-ml", "npz",
        {"gnn_benchmark/cora_ml.npz": "ffbe4e64857dc6bf38f1877e4312559a064df84b59d0f32f938717de5d5af0fd"},
        {"gnn_benchmark/cora_ml.npz": _CORA_ML_URL},
        "Cora-ML citation graph (gnn-benchmark npz), 2995 nodes, 20/30 per class split"),
    # The two below are flat, pickle-free conversions of EdisonLeeeee/GraphData's pickled npz files (see the
    # datasets README); no public URL serves these exact bytes, so fetch needs a mirror base URL.
    "amazon-computers": DatasetInfo(
        "amazon-computers", "npz",
        {"gnn_benchmark/amazon_electronics_computers.npz":
            "3fdcaaaed9208b9cc9f9dc1698d4e926dec4e1e57bc5f640eb6c0ab8132f1a17"},
        {"gnn_benchmark/amazon_electronics_computers.npz": None},
        "Amazon Computers co-purchase graph (gnn-benchmark npz), 13752 nodes, 20/30 per class split"),
    "coauthor-cs": DatasetInfo(
        "coauthor-cs", "npz",
        {"gnn_benchmark/ms_academic_cs.npz": "7ac5c70cf637c3ef1557111d388366d422192e071dcdc4df79c0b68d12f69f5e"},
        {"gnn_benchmark/ms_academic_cs.npz": None},
        "Coauthor CS co-authorship graph (gnn-benchmark npz), 18333 nodes, 20/30 per class split"),
}

_SPLIT_KEYS = {"train": "train_per_class", "val": "val_per_class"}
_PLANTED_KEYS = {"nodes": "num_nodes", "classes": "num_classes", "degree": "avg_degree",
                 "homophily": "homophily", "features": "feature_dim", "noise": "feature_noise", **_SPLIT_KEYS}
_RMAT_KEYS = {"scale": "scale", "nodes": "num_nodes", "edges": "num_edges", "a": "a", "b": "b", "c": "c",
              "features": "feature_dim", "classes": "num_classes", "edge_factor": "edge_factor", **_SPLIT_KEYS}
_FLOAT_ARGS = {"avg_degree", "homophily", "feature_noise", "a", "b", "c"}


def known_datasets() -> list[str]:
    return sorted(DATASETS)


def resolve_data_dir(flag: str | os.PathLike | None = None) -> Path:
    """--data-dir, else $DORYLUS_DATA_DIR, else ~/.cache/dorylus/datasets."""
    if flag:
        return Path(flag).expanduser()
    env = os.environ.get(ENV_DATA_DIR)
    return Path(env).expanduser() if env else DEFAULT_DATA_DIR.expanduser()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _info(name: str) -> DatasetInfo:
    key = name.strip().lower().replace("_", "-")
    if key not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(known_datasets())}")
    return DATASETS[key]


def verify_dataset(name: str, data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Check that every file of a known dataset exists under data_dir with its sha256; return the paths."""
    info = _info(name)
    root = resolve_data_dir(data_dir)
    paths = []
    for rel, expected in info.files.items():
        path = root / rel
        if not path.is_file():
            raise DataError(f"dataset {info.name!r}: missing file {path}; run `dorylus data fetch {info.name}` "
                            f"or point --data-dir (or ${ENV_DATA_DIR}) at a folder holding {rel}")
        got = sha256_file(path)
        if got != expected:
            raise DataError(f"dataset {info.name!r}: checksum mismatch for {path}: "
                            f"expected sha256 {expected}, got {got}")
        paths.append(path)
    return paths


def _parse_query(spec: str, query: str, allowed: dict[str, str] | None) -> dict[str, str]:
    out = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if allowed is not None and key not in allowed and key != "seed":
            raise DataError(f"{spec!r}: unknown parameter {key!r}; allowed: {', '.join(sorted(allowed))}, seed")
        out[key] = value
    return out


def _synthetic(spec: str, seed: int) -> Graph:
    body = spec[len("synthetic:"):]
    kind, _, query = body.partition("?")
    keys = {"planted": _PLANTED_KEYS, "rmat": _RMAT_KEYS}.get(kind)
    if keys is None:
        raise DataError(f"{spec!r}: unknown synthetic generator {kind!r}; use synthetic:planted or synthetic:rmat")
    kwargs: dict = {}
    for key, value in _parse_query(spec, query, keys).items():
        arg = keys.get(key, "seed")
        try:
            kwargs[arg] = float(value) if arg in _FLOAT_ARGS else int(value)
        except ValueError:
            raise DataError(f"{spec!r}: parameter {key}={value!r} is not a number") from None
    kwargs.setdefault("seed", seed)
    if kind == "planted":
        return planted_partition(**kwargs)
    if "scale" not in kwargs and "num_nodes" not in kwargs:
        kwargs["scale"] = 10
    return rmat(**kwargs)


def _from_path(spec: str, seed: int) -> Graph | None:
    """Load a spec that names a file; None if it does not look like a path at all."""
    path, query = Path(spec), ""
    if not path.exists() and "?" in spec:
        head, _, query = spec.partition("?")
        path = Path(head)
    path = path.expanduser()
    suffix = path.suffix.lower()
    if path.is_dir():
        from pipelines.data.ogb import is_ogb_dir, load_ogb

        if not is_ogb_dir(path):
            raise DataError(f"{spec!r}: a directory, but not an OGB node-property dataset (no raw/ or split/ in it)")
        extra = _parse_query(spec, query, {"split": ""})
        if "seed" in extra:
            raise DataError(f"{spec!r}: an OGB dataset has its own split; it takes ?split=NAME, not seed")
        return load_ogb(path, split=extra.get("split"))
    if suffix == ".npz":
        return load_npz(path, seed=seed) if not query else _no_query(spec)
    if path.name.startswith("ind.") or Path(f"{path}.graph").is_file():
        return load_planetoid(path) if not query else _no_query(spec)
    from pipelines.data.edgelist import EDGE_SUFFIXES, load_edgelist  # pyarrow: only paid when needed

    if suffix in EDGE_SUFFIXES:
        extra = _parse_query(spec, query, {"labels": "", "features": "", "split": ""})
        if "seed" in extra:
            try:
                seed = int(extra.pop("seed"))
            except ValueError:
                raise DataError(f"{spec!r}: seed must be an integer") from None
        companions = {k: (v if Path(v).is_absolute() else path.parent / v) for k, v in extra.items()}
        return load_edgelist(path, seed=seed, **companions)
    if path.exists() or os.sep in spec or "/" in spec:
        raise DataError(f"{spec!r}: cannot tell the format; use a .npz file, a Planetoid prefix like dir/ind.cora, "
                        f"or an edge list ending in {', '.join(EDGE_SUFFIXES)}")
    return None


def _no_query(spec: str):
    raise DataError(f"{spec!r}: only edge-list paths take ?labels=/features=/split= parameters")


def load_dataset(spec: str | None, data_dir: str | os.PathLike | None = None, seed: int = 0) -> Graph:
    """Resolve a dataset spec (see the module docstring) to a Graph; `seed` drives any random split."""
    if spec is None or not spec.strip():
        return planted_partition(seed=seed)
    spec = spec.strip()
    if spec.startswith("synthetic:"):
        return _synthetic(spec, seed)
    key = spec.lower().replace("_", "-")
    if key in DATASETS:
        info = DATASETS[key]
        paths = verify_dataset(key, data_dir)
        if info.kind == "planetoid":
            return load_planetoid(resolve_data_dir(data_dir) / "planetoid" / f"ind.{info.name}", name=info.name)
        return load_npz(paths[0], name=info.name, seed=seed)
    graph = _from_path(spec, seed)
    if graph is None:
        raise DataError(f"unknown dataset {spec!r}; known datasets: {', '.join(known_datasets())}; "
                        f"or give synthetic:planted?..., synthetic:rmat?..., or a file path")
    return graph


def _download(url: str, dest: Path, expected: str, timeout: float) -> None:
    """Stream url into a temp file beside dest, verify its sha256, then rename it into place atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
        got = h.hexdigest()
        if got != expected:
            raise DataError(f"checksum mismatch for {url}: expected sha256 {expected}, got {got}; nothing written")
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError) as e:
        raise DataError(f"could not download {url}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fetch(name: str, data_dir: str | os.PathLike | None = None, base_url: str | None = None,
          timeout: float = 60.0) -> list[Path]:
    """Download a known dataset's files into data_dir, verified by sha256; files that already verify are kept.

    base_url (else $DORYLUS_DATASET_BASE_URL) is a folder laid out like the data dir: file `rel` comes from
    `base_url/rel`. Without it, each file comes from its public source (pinned raw-GitHub commits);
    amazon-computers and coauthor-cs have none and need a base URL.
    """
    info = _info(name)
    root = resolve_data_dir(data_dir)
    base = base_url or os.environ.get(ENV_BASE_URL)
    paths = []
    for rel, expected in info.files.items():
        dest = root / rel
        paths.append(dest)
        if dest.is_file() and sha256_file(dest) == expected:
            continue
        if base:
            url = f"{base.rstrip('/')}/{rel}"
        else:
            url = info.urls.get(rel)
            if url is None:
                raise DataError(f"dataset {info.name!r}: no public source serves {rel} byte for byte; set "
                                f"${ENV_BASE_URL} (or --base-url) to a mirror laid out like the data dir, "
                                f"or copy the file to {dest}")
        _download(url, dest, expected, timeout)
    return paths
