"""Stream checkpoints: weights, optimizer state, the applied graph, pending events and consumer offsets, in one
file written atomically (an npz through temp + fsync + rename), so they can never disagree after a crash.

Layout of ``checkpoint.npz``:

``meta``              uint8: UTF-8 JSON (round, offsets ``{partition: next offset}``, watermark state, last cut,
                      counters, feature_dim, num_classes, model version, the config)
``params/<stage>/<name>``  the weights training continues from (the last epoch of the last round)
``opt/<i>``           the optimizer state's leaves in tree order (the tree comes from the optimizer itself)
``graph/<key>``       the applied graph (:meth:`StreamGraph.arrays`): vertex, features, label, split, src, dst
``pending``           uint8: Arrow IPC stream of the events read but not applied yet
``seen``              uint8: Arrow IPC stream of the event ids taken so far (applied or pending), for dedupe
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from ops import params as P
from pipelines import rundir
from schemas.events import EVENT_SCHEMA

FILE = "checkpoint.npz"


def _ipc(table: pa.Table) -> np.ndarray:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return np.frombuffer(sink.getvalue().to_pybytes(), np.uint8)


def _from_ipc(arr: np.ndarray) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(arr.tobytes())).read_all()


def save(out: Path, *, meta: dict, params: dict | None, opt_leaves: list | None, graph: dict,
         pending: pa.Table, seen: list[str]) -> Path:
    arrays: dict[str, np.ndarray] = {"meta": np.frombuffer(json.dumps(meta, default=rundir._json_default)
                                                          .encode(), np.uint8)}
    if params is not None:
        arrays.update(P.flatten(params, prefix="params/"))
    if opt_leaves is not None:
        for i, leaf in enumerate(opt_leaves):
            arrays[f"opt/{i:05d}"] = np.asarray(leaf)
    for k, v in graph.items():
        arrays[f"graph/{k}"] = np.asarray(v)
    arrays["pending"] = _ipc(pending.cast(EVENT_SCHEMA) if pending.num_rows else EVENT_SCHEMA.empty_table())
    arrays["seen"] = _ipc(pa.table({"event_id": pa.array(seen, pa.string())}))
    path = Path(out) / FILE
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    rundir.atomic_write_bytes(path, buf.getvalue())
    return path


def load(out: Path) -> dict | None:
    """The checkpoint in `out`, or None when there is none."""
    path = Path(out) / FILE
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as z:
        files = list(z.files)
        meta = json.loads(z["meta"].tobytes().decode())
        params: dict = {}
        for k in files:
            if k.startswith("params/"):
                _, stage, name = k.split("/", 2)
                params.setdefault(stage, {})[name] = z[k]
        opt = [z[k] for k in sorted(k for k in files if k.startswith("opt/"))]
        graph = {k.split("/", 1)[1]: z[k] for k in files if k.startswith("graph/")}
        pending = _from_ipc(z["pending"])
        seen = _from_ipc(z["seen"]).column("event_id").to_pylist()
    return {"meta": meta, "params": params or None, "opt_leaves": opt or None, "graph": graph,
            "pending": pending, "seen": seen}
