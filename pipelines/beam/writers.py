"""Writers shared by the Beam pipelines: Parquet shards with their sha256, the stats file, atomic output folders.

An output folder is staged: :func:`staged_output` yields ``DIR.tmp-<uuid>`` next to DIR, the pipeline writes
into it (the record file, ``manifest.json`` or ``infer.json``, last, with :func:`write_json`), and it is renamed
to DIR only when the block ends without an error; on any error the temporary folder is removed, so a DIR with
its record file is always complete. An existing DIR is replaced only with ``overwrite``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data.graph import DataError
from pipelines.data.registry import sha256_file

STATS_FILE = "_stats.json"


def shard_name(shard: int) -> str:
    """The file name of shard (partition) ``shard``: ``part-XXXXX.parquet``."""
    return f"part-{shard:05d}.parquet"


def write_table(table: pa.Table, path: str) -> dict:
    """Write ``table`` as zstd Parquet atomically; returns its file record {rows, bytes, sha256}."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
    return {"rows": table.num_rows, "bytes": os.path.getsize(path), "sha256": sha256_file(path)}


def write_stats(stats: dict, root: str) -> None:
    """The merged stats (:class:`pipelines.beam.combiners.StatsFn`) as ``root/_stats.json``: a pipeline's last step."""
    tmp = os.path.join(root, STATS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(stats, f, default=str)
    os.replace(tmp, os.path.join(root, STATS_FILE))


def read_stats(root: Path) -> dict:
    """The stats file a finished pipeline wrote under ``root`` (removed once read)."""
    path = Path(root) / STATS_FILE
    if not path.is_file():
        raise RuntimeError(f"the pipeline finished without writing {path}")
    stats = json.loads(path.read_text())
    path.unlink()
    return stats


def write_json(path: Path, obj: dict) -> None:
    """``obj`` as indented JSON at ``path``, atomically (a temporary file renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def check_output(out: Path, overwrite: bool) -> None:
    """DataError when ``out`` exists (a file, or a folder that is not empty) and ``overwrite`` is not set."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists; pass --overwrite to replace it")


@contextlib.contextmanager
def staged_output(out: Path, overwrite: bool):
    """Yield a temporary folder next to ``out``; renamed to ``out`` when the block succeeds, else removed."""
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        yield tmp
        _commit(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif not overwrite:
            raise DataError(f"--out {out} exists; pass --overwrite to replace it")
        else:
            old = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.replace(tmp, out)
