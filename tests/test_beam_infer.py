"""Cora through the Beam pipelines: prepare -> train from the shards (same accuracy as from the loader, the
engine on the stored partitions) -> Beam inference equal to ops.models.forward; Flink equals Direct."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("apache_beam")

from pipelines import cli  # noqa: E402
from pipelines.beam import infer, prepare  # noqa: E402
from pipelines.data import prepared as shards  # noqa: E402
from pipelines.config import TrainConfig  # noqa: E402
from pipelines.data.graph import DataError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cora(data_dir):
    from pipelines.data.registry import load_dataset

    return load_dataset("cora", data_dir)


@pytest.fixture(scope="module")
def prepared(cora, tmp_path_factory):
    """Cora written as raw files (edges in Parquet, one direction per edge; features; labels; its split) and
    prepared into 2 hash partitions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("cora")
    coo = cora.adj.tocoo()
    up = coo.row < coo.col
    pq.write_table(pa.table({"src": coo.row[up].astype(np.int64), "dst": coo.col[up].astype(np.int64)}),
                   d / "edges.parquet")
    np.save(d / "x.npy", cora.features)
    np.save(d / "y.npy", cora.labels)
    split = np.full(cora.num_nodes, -1, np.int8)
    for code, mask in enumerate((cora.train_mask, cora.val_mask, cora.test_mask)):
        split[mask] = code
    np.save(d / "split.npy", split)
    prepare.run(["--edges", str(d / "edges.parquet"), "--features", str(d / "x.npy"), "--labels", str(d / "y.npy"),
                 "--split-file", str(d / "split.npy"), "--partitions", "2", "--out", str(d / "prepared")])
    return d / "prepared"


RUNS = {
    "gcn-ga-first": dict(model="gcn", order="ga-first"),
    "gcn-av-first": dict(model="gcn", order="av-first"),
    "gat": dict(model="gat", heads=2, hidden=8),
    "sage": dict(model="sage", hidden=16),
}


@pytest.fixture(scope="module")
def runs(cora, tmp_path_factory):
    """Short whole-graph training runs (run directories) of each model kind on the loader's Cora."""
    from pipelines import rundir
    from pipelines.train import train

    out = {}
    for name, kw in RUNS.items():
        cfg = TrainConfig(dataset="cora", epochs=3, seed=1, **kw).resolved()
        d = tmp_path_factory.mktemp(name)
        rundir.atomic_write_text(d / "config.toml", cfg.to_toml())
        out[name] = (d, cfg, train(cfg, cora, out=d).best_params)
    return out


def test_prepared_cora_is_the_loaders_cora(cora, prepared):
    g = shards.load_graph(prepared)
    assert (g.adj != cora.adj).nnz == 0 and np.array_equal(g.adj.indptr, cora.adj.indptr)
    np.testing.assert_array_equal(g.features, cora.features)
    np.testing.assert_array_equal(g.labels, cora.labels)
    for a, b in ((g.train_mask, cora.train_mask), (g.val_mask, cora.val_mask), (g.test_mask, cora.test_mask)):
        np.testing.assert_array_equal(a, b)
    assert g.num_classes == cora.num_classes


def test_train_from_prepared_matches_the_loader(cora, prepared, tmp_path, data_dir, capsys):
    from pipelines.train import train

    want = train(TrainConfig(dataset="cora", epochs=20, patience=0).resolved(), cora).summary
    assert cli.main(["train", "--prepared", str(prepared), "--epochs", "20", "--patience", "0", "--quiet",
                     "--out", str(tmp_path / "run")]) == 0
    got = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert got["test_acc"] == want["test_acc"] and got["best_val_acc"] == want["best_val_acc"]
    assert got["final_loss"] == pytest.approx(want["final_loss"], rel=1e-6)
    assert want["test_acc"] > 0.6
    assert 'prepared = "' in (tmp_path / "run" / "config.toml").read_text()
    # --prepared and --dataset exclude each other
    assert cli.main(["train", "--prepared", str(prepared), "--dataset", "cora", "--out", str(tmp_path / "x")]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_engine_trains_on_the_stored_partitions(prepared, tmp_path):
    assert cli.main(["train", "--prepared", str(prepared), "--partitions", "2", "--intervals", "2", "--epochs", "3",
                     "--quiet", "--out", str(tmp_path / "run")]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["engine"] == "pipelined" and s["partition_stats"]["partitioner"] == "prepared"
    assert 'partitioner = "prepared"' in (tmp_path / "run" / "config.toml").read_text()
    parts = shards.partition_assignment(prepared)
    a = shards.load_prepared(prepared).adj.tocoo()
    assert s["partition_stats"]["edge_cut"] == int((parts[a.row] != parts[a.col]).sum()) // 2


def _forward_logits(cfg, graph, params):
    import jax.numpy as jnp

    from ops import models
    from ops.sparse import Adjacency
    from pipelines.train import build_model, model_inputs

    model = build_model(cfg, graph)
    x, a = model_inputs(cfg, graph)
    p = {k: {n: jnp.asarray(v) for n, v in d.items()} for k, d in params.items()}
    return np.asarray(models.forward(model, p, Adjacency.from_scipy(a).to_device(), jnp.asarray(x), None))


def _table_arrays(table):
    emb = table.column("embedding").combine_chunks()
    width = emb.type.list_size
    return (table.column("vertex").to_numpy(), table.column("prediction").to_numpy(),
            emb.flatten().to_numpy().reshape(-1, width))


@pytest.fixture(scope="module")
def direct(prepared, runs, data_dir, tmp_path_factory):
    """Beam inference on the DirectRunner, run once per (model, input) and shared by the tests."""
    done = {}

    def get(name, source):
        if (name, source) not in done:
            out = tmp_path_factory.mktemp(f"pred-{name}-{source}") / "pred"
            src = (["--prepared", str(prepared)] if source == "prepared"
                   else ["--dataset", "cora", "--data-dir", str(data_dir)])
            record = infer.run(["--run", str(runs[name][0]), *src, "--block-size", "1024", "--out", str(out)])
            done[name, source] = (out, record)
        return done[name, source]

    return get


@pytest.mark.parametrize("name,source", [("gcn-ga-first", "dataset"), ("gcn-av-first", "prepared"),
                                         ("gat", "prepared"), ("sage", "prepared")])
def test_infer_equals_the_whole_graph_forward(cora, runs, direct, name, source):
    _, cfg, params = runs[name]
    out, record = direct(name, source)
    assert sorted(os.listdir(out)) == ["infer.json", "predictions"]
    assert record["num_vertices"] == cora.num_nodes and record["num_classes"] == cora.num_classes
    assert len(record["files"]) == (2 if source == "prepared" else 1)
    vertex, pred, logits = _table_arrays(infer.load_predictions(out))
    want = _forward_logits(cfg, cora, params)
    np.testing.assert_array_equal(vertex, np.arange(cora.num_nodes))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pred, want.argmax(1))


def test_infer_errors(runs, tmp_path, capsys):
    run_dir = runs["gcn-ga-first"][0]
    # the weights expect Cora's 1433 features; a planted graph has 500
    with pytest.raises(DataError, match=r"do not fit a gcn with \d+ input features"):
        infer.run(["--run", str(run_dir), "--dataset", "synthetic:planted?nodes=200", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.tmp-*"))
    assert cli.main(["infer", "--run", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no config.toml" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "pipelines.infer", "--run", str(tmp_path / "nope"), "--out",
                        str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "infer: error:" in r.stderr


@pytest.mark.flink
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # LOOPBACK data-plane hang-up
def test_infer_on_flink_matches_direct(prepared, runs, direct, tmp_path, flink_flags):
    flags = flink_flags + ["--parallelism=2"]
    want = infer.load_predictions(direct("gcn-av-first", "prepared")[0])
    infer.run(["--run", str(runs["gcn-av-first"][0]), "--prepared", str(prepared), "--block-size", "1024",
               "--out", str(tmp_path / "flink")] + flags)
    assert infer.load_predictions(tmp_path / "flink").equals(want)


# --- the block store (pipelines/beam/blockstore.py) ----------------------------------------------------------------
def _write_shard(d: Path, dst, src, vertices, feature_dim=2):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (d / "edges").mkdir(parents=True, exist_ok=True)
    (d / "vertices").mkdir(exist_ok=True)
    pq.write_table(pa.table({"src": np.asarray(src, np.int64), "dst": np.asarray(dst, np.int64),
                             "weight": np.arange(len(src), dtype=np.float32)}), d / "edges" / "e.parquet")
    x = np.arange(len(vertices) * feature_dim, dtype=np.float32)
    pq.write_table(pa.table({"vertex": np.asarray(vertices, np.int64),
                             "features": pa.FixedSizeListArray.from_arrays(pa.array(x), feature_dim)}),
                   d / "vertices" / "v.parquet")
    return {"edges": "edges/e.parquet", "vertices": "vertices/v.parquet", "num_edges": len(src),
            "num_vertices": len(vertices)}


def test_block_store_slices_every_shard_by_block(tmp_path):
    from pipelines.beam import blockstore

    blocks = blockstore.Blocks(7, 3)                      # blocks [0,3) [3,6) [6,7)
    assert blocks.count == 3 and blocks.rows(2) == (6, 7)
    # two shards, each sorted by dst (as prepare writes them); each holds some of every block's rows
    e0 = _write_shard(tmp_path / "s0", dst=[0, 0, 2, 4, 6], src=[1, 0, 2, 4, 6], vertices=[0, 2, 4, 6])
    e1 = _write_shard(tmp_path / "s1", dst=[1, 3, 3, 5], src=[1, 5, 3, 5], vertices=[1, 3, 5])
    work = str(tmp_path / "work")
    for i, (d, e) in enumerate([(tmp_path / "s0", e0), (tmp_path / "s1", e1)]):
        rec = blockstore.write_shard_columns(str(d), e, work, i, blocks, 2, unit_weights=False)
        assert rec == {"index": i, "edges": e["num_edges"], "vertices": e["num_vertices"]}
    cols = blockstore.ShardColumns(work, 2, unit_weights=False)
    dst, src, w = cols.edges(1)                           # dst 3 and 5 from shard 1, 4 from shard 0
    order = np.lexsort((src, dst))
    dst, src, w = dst[order], src[order], w[order]
    np.testing.assert_array_equal(dst, [3, 3, 4, 5])
    np.testing.assert_array_equal(src, [3, 5, 4, 5])     # sorted by (dst, src) across the shards
    np.testing.assert_array_equal(w, [2, 1, 3, 3])
    x = cols.vertices(0, 0, 3, 2)                         # vertex 0 and 2 from shard 0, 1 from shard 1
    np.testing.assert_array_equal(x, [[0, 1], [0, 1], [2, 3]])
    assert blockstore.ShardColumns(work, 2, unit_weights=True).edges(2)[2].tolist() == [1.0]


def test_block_store_rejects_what_prepare_never_writes(tmp_path):
    from pipelines.beam import blockstore

    blocks = blockstore.Blocks(4, 2)
    bad_order = _write_shard(tmp_path / "a", dst=[1, 0], src=[0, 1], vertices=[0, 1, 2, 3])
    with pytest.raises(DataError, match="not sorted by dst"):
        blockstore.write_shard_columns(str(tmp_path / "a"), bad_order, str(tmp_path / "w"), 0, blocks, 2, False)
    out_of_range = _write_shard(tmp_path / "b", dst=[0, 1], src=[0, 9], vertices=[0, 1, 2, 3])
    with pytest.raises(DataError, match="vertex id 9 out of range"):
        blockstore.write_shard_columns(str(tmp_path / "b"), out_of_range, str(tmp_path / "w"), 0, blocks, 2, False)
    repeated = _write_shard(tmp_path / "c", dst=[0, 1], src=[0, 1], vertices=[0, 1, 1, 3])
    with pytest.raises(DataError, match="not sorted by vertex"):
        blockstore.write_shard_columns(str(tmp_path / "c"), repeated, str(tmp_path / "w"), 0, blocks, 2, False)
    missing = _write_shard(tmp_path / "d", dst=[0, 1], src=[0, 1], vertices=[0, 1, 3])
    blockstore.write_shard_columns(str(tmp_path / "d"), missing, str(tmp_path / "w2"), 0, blocks, 2, False)
    with pytest.raises(DataError, match="vertex 2 is in 0 vertex shards"):
        blockstore.ShardColumns(str(tmp_path / "w2"), 1, False).vertices(1, 2, 4, 2)


def test_block_state_rows_are_written_in_place(tmp_path):
    from pipelines.beam import blockstore

    state = blockstore.State(str(tmp_path), 10)
    state.create(1, {"h": (3,), "s": (2, 2)})
    state.write_rows(1, "h", 4, np.ones((2, 3), np.float32))
    state.write_rows(1, "h", 8, np.full((2, 3), 2, np.float32))
    state.write_rows(1, "h", 4, np.ones((2, 3), np.float32))   # a retried block rewrites the same bytes
    state.write_rows(1, "s", 0, np.arange(4, dtype=np.float32).reshape(1, 2, 2))
    np.testing.assert_array_equal(state.read(1, "h", np.array([0, 4, 5, 9]))[:, 0], [0, 1, 1, 2])
    np.testing.assert_array_equal(state.read(1, "s", slice(0, 1)), np.arange(4).reshape(1, 2, 2))
    assert np.load(state.path(1, "h")).shape == (10, 3)
    with pytest.raises(RuntimeError, match="rows of shape"):
        state.write_rows(1, "h", 0, np.ones((1, 4), np.float32))
