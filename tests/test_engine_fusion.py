"""Fused row-local tensor tasks, unpadded row-local payloads, the wire counters and the latency pool."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from ops import models
from ops.tasks import run_tensor_task
from pipelines.config import TrainConfig
from pipelines.data.registry import load_dataset
from pipelines.engine.runner import train_engine
from pipelines.train import train
from pipelines.transports.memory import MemoryTransport
from schemas.tasks import TaskKind


def _model():
    # auto order with F <= hidden: GA0, AV0, AV1, GA1, LOSS - AV0 and AV1 fuse into one task
    return models.gcn(8, 16, 3, dropout=0.5)


def test_tensor_groups_fuse_consecutive_row_local_stages():
    m = _model()
    assert models.tensor_groups(m) == [(0,), (1, 2), (3,), (4,)]
    assert models.requires_grad(m) == {-1: False, 0: False, 1: True, 2: True, 3: True, 4: True}
    gat = models.gat(8, 4, 3, heads=2)
    assert all(len(g) == 1 for g in models.tensor_groups(gat))  # AV -> AE: nothing row-local to fuse


def test_fused_task_equals_the_unfused_stages():
    m = _model()
    params = jax.tree_util.tree_map(np.asarray, m.init(jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    R, n = 12, 9
    h = np.zeros((R, 8), np.float32)
    h[:n] = rng.standard_normal((n, 8))
    gids = np.full(R, -1, np.int32)
    gids[:n] = np.arange(100, 100 + n)
    seeds = [11, 22]
    # forward: AV0 then AV1 as two tasks, against one fused task sent unpadded
    a1, _, _ = run_tensor_task(m, TaskKind.AV, 1, params, {"h": h, "row_gids": gids}, {"seed": seeds[0]})
    a2, _, _ = run_tensor_task(m, TaskKind.AV, 2, params, {"h": np.asarray(a1["h"]), "row_gids": gids},
                               {"seed": seeds[1]})
    fused_meta = {"seed": seeds[0], "stages": [1, 2], "seeds": seeds, "rows": R}
    f, _, _ = run_tensor_task(m, TaskKind.AV, 1, params, {"h": h[:n], "row_gids": gids[:n]}, fused_meta)
    assert f["h"].shape == (n, 3)
    np.testing.assert_allclose(np.asarray(f["h"]), np.asarray(a2["h"])[:n], rtol=1e-6, atol=1e-6)
    # backward: ∇AV1 then ∇AV0 against one fused ∇ task (no input gradient: GA0 reads the features)
    g = np.zeros((R, 3), np.float32)
    g[:n] = rng.standard_normal((n, 3))
    b2, gp2, _ = run_tensor_task(m, TaskKind.AV_BWD, 2, params, {"h": np.asarray(a1["h"]), "row_gids": gids,
                                                                 "g_h": g}, {"seed": seeds[1], "wrt": ["h"]})
    _, gp1, _ = run_tensor_task(m, TaskKind.AV_BWD, 1, params, {"h": h, "row_gids": gids,
                                                                "g_h": np.asarray(b2["d_h"])},
                                {"seed": seeds[0], "wrt": []})
    out, gp, _ = run_tensor_task(m, TaskKind.AV_BWD, 1, params, {"h": h[:n], "row_gids": gids[:n], "g_h": g[:n]},
                                 {**fused_meta, "wrt": []})
    assert out == {} and set(gp) == {"av0", "av1"}
    for name, ref in (("av0", gp1["av0"]), ("av1", gp2["av1"])):
        for k in ref:
            np.testing.assert_allclose(np.asarray(gp[name][k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)


class _CountingTransport(MemoryTransport):
    """Sums every payload it is handed, apart from the transport's own counters."""

    def __init__(self):
        super().__init__()
        self.payload = {}

    def send(self, kind, partition, msg):
        self.payload[str(kind)] = self.payload.get(str(kind), 0) + sum(a.nbytes for a in msg.arrays.values())
        super().send(kind, partition, msg)


@pytest.fixture(scope="module")
def small():
    return load_dataset("synthetic:planted?nodes=1200&classes=4&degree=8&features=8", None, seed=0)


def test_fused_engine_equals_whole_graph_and_counts_its_bytes(small):
    cfg = TrainConfig(model="gcn", hidden=16, epochs=4, patience=0, partitions=2, intervals=3, staleness=None,
                      tensor_workers=2, straggler_min_s=60.0).resolved()
    whole = train(cfg, small)
    tr = _CountingTransport()
    eng = train_engine(cfg, small, transport=tr, evaluate=False)
    l1 = np.array([r["loss"] for r in whole.history])
    l2 = np.array([r["loss"] for r in eng.history])
    assert np.max(np.abs(l1 - l2) / np.abs(l1)) < 1e-4
    s = eng.summary
    # 3 tensor tasks per interval and epoch: fused AV0+AV1, LOSS, fused ∇ (GA0 over features has no backward)
    assert s["tensor_tasks"] == 3 * 2 * 3 * len(eng.history)
    wire = s["wire"]
    assert {c: v * wire["epochs"] for c, v in wire["bytes_per_epoch"].items()} == tr.payload
    assert wire["ratio_to_minimum"] <= 1.3


def test_latency_pool_overlaps_and_stays_within_staleness(small):
    cfg = TrainConfig(model="gcn", hidden=16, epochs=3, patience=0, partitions=2, intervals=3, staleness=1,
                      tensor_workers=8, task_latency_s=0.02, straggler_min_s=60.0, sync_warmup=0).resolved()
    a = train_engine(cfg, small, evaluate=False)
    b = train_engine(dataclasses.replace(cfg, tensor_workers=3), small, evaluate=False)
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    assert a.summary["max_staleness_observed"] <= 1
    assert a.summary["tensor_concurrency_peak"] >= 3  # intervals' tasks wait out their latency together


def test_kept_residuals_are_used_and_change_no_bit(small):
    cfg = TrainConfig(model="gcn", hidden=16, epochs=3, patience=0, partitions=2, intervals=3, staleness=1,
                      tensor_workers=3, straggler_min_s=60.0, sync_warmup=0).resolved()
    kept = train_engine(cfg, small, evaluate=False)
    redone = train_engine(dataclasses.replace(cfg, residual_cache_mb=0), small, evaluate=False)
    assert [r["loss"] for r in kept.history] == [r["loss"] for r in redone.history]
    for stage, p in kept.params.items():
        for name, w in p.items():
            np.testing.assert_array_equal(np.asarray(w), np.asarray(redone.params[stage][name]))
    # one fused AV0+AV1 backward per interval and epoch, each finding its forward's residuals
    rc = kept.summary["tensor_pool"]["residual_cache"]
    assert rc["hits"] == 2 * 3 * len(kept.history) and rc["misses"] == 0 and rc["refused"] == 0
    assert "residual_cache" not in redone.summary["tensor_pool"]


def test_residual_cache_refuses_when_full_and_matches_epoch_and_version():
    from pipelines.engine.tensor_worker import ResidualCache
    from schemas.tasks import Message

    class Kept:
        nbytes = 600

    cache = ResidualCache(1000)
    cache.put(Message(TaskKind.AV, 0, 1, 0, 0, 5), Kept())
    cache.put(Message(TaskKind.AV, 0, 1, 1, 0, 5), Kept())   # over the cap: not kept
    assert cache.take(Message(TaskKind.AV_BWD, 0, 1, 1, 0, 5)) is None
    assert cache.take(Message(TaskKind.AV_BWD, 0, 1, 0, 0, 6)) is None   # another weight version
    assert cache.take(Message(TaskKind.AV_BWD, 1, 1, 0, 0, 5)) is None   # another epoch
    assert cache.take(Message(TaskKind.AV_BWD, 0, 1, 0, 0, 5)) is not None
    assert cache.take(Message(TaskKind.AV_BWD, 0, 1, 0, 0, 5)) is None   # taken once
    # a newer forward of the same interval replaces the older one, whose backward ran elsewhere
    cache.put(Message(TaskKind.AV, 0, 1, 2, 0, 5), Kept())
    cache.put(Message(TaskKind.AV, 1, 1, 2, 0, 6), Kept())
    assert cache.take(Message(TaskKind.AV_BWD, 1, 1, 2, 0, 6)) is not None
    assert cache.stats()["hits"] == 2 and cache.stats()["refused"] == 1 and cache.bytes == 0


def test_lambda_handler_runs_fused_unpadded_tasks():
    from ops import lambda_handler as LH
    from ops.params import flatten
    from ops.spec import ModelSpec
    from schemas import lambda_events as LE
    from schemas.tasks import Message

    spec = ModelSpec("gcn", 8, 3, (16,), 0.5).to_json()
    m = models.from_spec(spec)
    params = jax.tree_util.tree_map(np.asarray, m.init(jax.random.PRNGKey(0)))
    rng = np.random.default_rng(1)
    n, R = 5, 7
    arrays = {"h": rng.standard_normal((n, 8)).astype(np.float32), "row_gids": np.arange(n, dtype=np.int32)}
    meta = {"model": spec, "seed": 3, "stages": [1, 2], "seeds": [3, 4], "rows": R}
    for kind, extra, mextra in ((TaskKind.AV, {}, {}),
                                (TaskKind.AV_BWD, {"g_h": rng.standard_normal((n, 3)).astype(np.float32)},
                                 {"wrt": []})):
        msg = Message(kind, 0, 1, 0, 0, 0, arrays={**arrays, **extra}, meta={**meta, **mextra})
        ref, ref_grads, _ = run_tensor_task(m, kind, 1, params, msg.arrays, msg.meta)
        task = LE.encode_task(kind, 0, 1, 0, 0, 0, msg.arrays, msg.meta)
        resp = LH.handler(LE.make_event(LE.inline(task), LE.inline(LE.encode_weights(0, flatten(params))), None,
                                        kind=kind), None)
        assert resp["ok"], resp
        out, grads, _ = LE.decode_result(resp)
        assert sorted(out) == sorted(ref)
        for k, v in ref.items():
            np.testing.assert_allclose(out[k], np.asarray(v), atol=1e-6)
        assert sorted(grads) == sorted(flatten(ref_grads))
    bad = LE.encode_task(TaskKind.AV, 0, 1, 0, 0, 0, arrays, {**meta, "stages": [1, 3]})
    resp = LH.handler(LE.make_event(LE.inline(bad), LE.inline(LE.encode_weights(0, flatten(params))), None,
                                    kind=TaskKind.AV), None)
    assert not resp["ok"] and "consecutive AV" in json.dumps(resp)
