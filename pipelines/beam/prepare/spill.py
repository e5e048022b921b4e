"""Spill: numpy arrays written to files under the run's staging folder, so that only their paths go through Beam.

Beam's DirectRunner keeps every element of a shuffled PCollection in memory (encoded, often twice over) until
its consumer runs; the edge entries and the feature rows are the bulk of a graph, so the transforms that route
them write each chunk to ``ROOT/_spill/<kind>/<partition>/<uuid>.npz`` and emit ``(partition, path)`` instead.
A consumer reads its partition's files one at a time. The names are unique per write, so a retried bundle's
files are simply never named downstream; the driver removes the whole folder (:func:`remove`) after the run.
Like the shards themselves, the folder must be on a file system the workers and the driver share.
"""
from __future__ import annotations

import os
import shutil
import uuid

import numpy as np

SPILL_DIR = "_spill"


def spill(root: str, kind: str, partition: int, *arrays: np.ndarray) -> str:
    """Write ``arrays`` (uncompressed: the bytes are read back once, soon) and return the file's path."""
    folder = os.path.join(root, SPILL_DIR, kind, str(int(partition)))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{uuid.uuid4().hex}.npz")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, *arrays)
    os.replace(tmp, path)
    return path


def load(path: str) -> tuple[np.ndarray, ...]:
    """The arrays :func:`spill` wrote to ``path``, in order."""
    with np.load(path, allow_pickle=False) as z:
        return tuple(z[f"arr_{i}"] for i in range(len(z.files)))


def remove(root: str) -> None:
    """Remove the spill folder of a finished run (nothing when there is none)."""
    shutil.rmtree(os.path.join(root, SPILL_DIR), ignore_errors=True)
