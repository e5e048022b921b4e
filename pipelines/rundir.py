"""Run directories: atomic file writes, append-only metrics, and the completeness marker in summary.json."""
from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write a file so that readers see either the old content or the whole new one, never a prefix."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path | str, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def atomic_write_npz(path: Path | str, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


class MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed per epoch so a crash loses at most the running epoch."""

    def __init__(self, path: Path | str, truncate_after_epoch: int | None = None):
        self.path = Path(path)
        if truncate_after_epoch is not None and self.path.exists():
            # On resume, drop rows past the checkpoint so the log has each epoch exactly once.
            rows = [r for r in read_jsonl(self.path) if r.get("epoch", -1) <= truncate_after_epoch]
            atomic_write_text(self.path, "".join(json.dumps(r, default=_json_default) + "\n" for r in rows))
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row, default=_json_default) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path | str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a crash
    return rows


def prepare_out_dir(out: Path | str, overwrite: bool = False, resume: bool = False) -> Path:
    """Create the run directory only once inputs are validated; refuse to mix two runs in one directory."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (overwrite or resume):
        raise FileExistsError(f"--out {out} is not empty (use --overwrite, or --resume to continue a run)")
    if out.exists() and overwrite and not resume:
        for name in ("summary.json", "metrics.jsonl", "weights.npz", "config.toml", "checkpoint.npz"):
            if (out / name).exists():
                (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out
