"""Incremental stream checkpoints: a full base snapshot plus one delta per checkpoint since, compacted every N.

Files in ``OUT/checkpoint/``:

``NNNNNNNN.base.npz``   the graph (:meth:`StreamGraph.arrays`) and every dedupe key held
``NNNNNNNN.delta.npz``  the events the rounds since the previous checkpoint applied (Arrow IPC, in application
                        order) and the dedupe keys taken since it
``manifest.json``       the chain (one base, then its deltas in order) and ``meta``: round, offsets
                        ``{partition: next offset}``, watermark state, counters, config ...

Every file (base or delta) also holds what is small or replaced as a whole each time: the weights, the optimizer
state and the pending events (read, not applied yet). A checkpoint writes its file (temp + fsync + rename), then
the manifest the same way: the manifest's rename is the commit. A crash before it leaves the previous manifest,
whose chain names only complete files (an orphan file of the crashed checkpoint is deleted on load); restoring
loads the base and re-applies the deltas' events, which gives the same graph because applying is deterministic.
So a checkpoint costs bytes in proportion to the events since the previous one, plus the weights, and every N-th
(``full_every``) writes a new base and deletes the old chain.

Layout of a file: ``params/<stage>/<name>``, ``opt/<i>``, ``pending`` (uint8 Arrow IPC), ``keys/h1|h2|window``
(dedupe), and ``graph/<key>`` (base) or ``events`` (delta, uint8 Arrow IPC).
"""
from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa

from ops import params as P
from pipelines import rundir
from schemas.events import EVENT_SCHEMA

DIR = "checkpoint"
MANIFEST = "manifest.json"


def _ipc(table: pa.Table) -> np.ndarray:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return np.frombuffer(sink.getvalue().to_pybytes(), np.uint8)


def _from_ipc(arr: np.ndarray) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(arr.tobytes())).read_all()


def _events(t: pa.Table | None) -> np.ndarray:
    return _ipc(t.cast(EVENT_SCHEMA) if t is not None and t.num_rows else EVENT_SCHEMA.empty_table())


def read_manifest(out: Path) -> dict | None:
    path = Path(out) / DIR / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def save(out: Path, *, meta: dict, params: dict | None, opt_leaves: list | None, pending: pa.Table,
         keys: dict[str, np.ndarray], graph: dict | None = None, events: pa.Table | None = None,
         owner: tuple[int, np.ndarray] | None = None, kill_before_commit: bool = False,
         before_commit=None) -> dict:
    """Write one checkpoint: a base when `graph` is given (keys: every key held), else a delta of `events`
    (keys: those taken since the previous checkpoint). Returns what was written (file, kind, bytes).

    owner: (first slot, partition of each slot from it) of the pipelined engine's ownership, when it has one.
    before_commit(info): called after the file is written, before the manifest commits it; kill_before_commit:
    SIGKILL this process right then (crash tests)."""
    d = Path(out) / DIR
    d.mkdir(parents=True, exist_ok=True)
    old = read_manifest(out)
    if graph is None and old is None:
        raise ValueError("a delta checkpoint needs a base checkpoint before it")
    seq = (old["seq"] + 1) if old else 1
    kind = "base" if graph is not None else "delta"
    name = f"{seq:08d}.{kind}.npz"
    arrays: dict[str, np.ndarray] = {}
    if params is not None:
        arrays.update(P.flatten(params, prefix="params/"))
    for i, leaf in enumerate(opt_leaves or []):
        arrays[f"opt/{i:05d}"] = np.asarray(leaf)
    arrays["pending"] = _events(pending)
    for k, v in keys.items():
        arrays[f"keys/{k}"] = np.asarray(v)
    if graph is not None:
        for k, v in graph.items():
            arrays[f"graph/{k}"] = np.asarray(v)
    else:
        arrays["events"] = _events(events)
    if owner is not None:
        arrays["owner/start"] = np.asarray(owner[0], np.int64)
        arrays["owner/parts"] = np.asarray(owner[1], np.int32)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    rundir.atomic_write_bytes(d / name, data)
    chain = [name] if graph is not None else old["chain"] + [name]
    info = {"file": name, "kind": kind, "bytes": len(data), "chain": len(chain)}
    if before_commit is not None:
        before_commit(info)
    if kill_before_commit:
        os.kill(os.getpid(), signal.SIGKILL)
    rundir.atomic_write_json(d / MANIFEST, {"seq": seq, "chain": chain, "meta": meta})
    for f in d.glob("*.npz"):  # compaction: files of an older chain (or of a crashed checkpoint)
        if f.name not in chain:
            f.unlink()
    return info


def load(out: Path) -> dict | None:
    """The committed checkpoint in `out`, or None: meta, params, opt_leaves and pending (of the last file), the
    base graph arrays, the deltas' events in order, and the dedupe keys and ownership pieces (`owners`: first
    slot, partitions) of every file in the chain."""
    man = read_manifest(out)
    if man is None:
        return None
    d = Path(out) / DIR
    for f in d.glob("*.npz"):
        if f.name not in man["chain"]:
            f.unlink()  # written by a checkpoint that crashed before its commit
    graph, deltas, keys, owners = {}, [], [], []
    params, opt, pending = None, None, None
    for i, name in enumerate(man["chain"]):
        with np.load(d / name, allow_pickle=False) as z:
            files = list(z.files)
            keys.append({k.split("/", 1)[1]: z[k] for k in files if k.startswith("keys/")})
            if "owner/parts" in files:
                owners.append((int(z["owner/start"]), z["owner/parts"]))
            if i == 0:
                graph = {k.split("/", 1)[1]: z[k] for k in files if k.startswith("graph/")}
            else:
                deltas.append(_from_ipc(z["events"]))
            if i == len(man["chain"]) - 1:
                params = {}
                for k in files:
                    if k.startswith("params/"):
                        _, stage, pname = k.split("/", 2)
                        params.setdefault(stage, {})[pname] = z[k]
                opt = [z[k] for k in sorted(k for k in files if k.startswith("opt/"))]
                pending = _from_ipc(z["pending"])
    return {"meta": man["meta"], "params": params or None, "opt_leaves": opt or None, "graph": graph,
            "deltas": deltas, "keys": keys, "pending": pending, "chain": man["chain"], "owners": owners}


def clear(out: Path) -> None:
    d = Path(out) / DIR
    if d.exists():
        for f in d.iterdir():
            f.unlink()
