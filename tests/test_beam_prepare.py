"""The Beam prepare pipeline (pipelines/beam/prepare/) and its reader (pipelines/data/prepared.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("apache_beam")

from pipelines.beam import prepare  # noqa: E402
from pipelines.data import prepared as shards  # noqa: E402
from pipelines.data.graph import DataError, clean_adjacency, gcn_normalize  # noqa: E402
from pipelines.data.splits import per_class_split  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
N, F, C = 14, 5, 3


def _edges():
    """The valid edges of the test graph as (src, dst) records, self-loops and duplicates included."""
    rng = np.random.default_rng(3)
    pairs = [(int(a), int(b)) for a, b in rng.integers(0, N - 1, size=(30, 2))]  # vertex 13 stays isolated
    pairs += [(0, 1), (1, 0), (0, 1), (5, 5), (12, 12)]  # reverse, duplicate, self-loops
    return pairs


def write_inputs(d: Path, bad_lines: bool = True) -> dict:
    """Edges over three files (CSV with header, comments and bad lines; TSV; Parquet), features and labels."""
    pairs = _edges()
    a, b, c = pairs[:15], pairs[15:28], pairs[28:]
    lines = ["src,dst", "# a comment", ""]
    lines += [f"{u},{v}" for u, v in a[:5]]
    bad = []
    if bad_lines:
        lines += ["3,x", "1 2 3", "4.5,2"]
        bad = [f"e-0.csv:{len(lines) - 2}", f"e-0.csv:{len(lines) - 1}", f"e-0.csv:{len(lines)}"]
    lines += [f"{u} , {v}  # trailing comment" for u, v in a[5:]]
    (d / "e-0.csv").write_text("\n".join(lines) + "\n")
    (d / "e-1.csv").write_text("".join(f"{u}\t{v}\n" for u, v in b))
    pq.write_table(pa.table({"src": [u for u, _ in c], "dst": [v for _, v in c]}), d / "e-2.parquet")
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, F)).astype(np.float32)
    y = rng.integers(0, C, size=N).astype(np.int64)
    y[[2, 9]] = -1
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", y)
    return {"pairs": pairs, "x": x, "y": y, "bad": bad, "edges": str(d / "e-*")}


def base_argv(d: Path, inp: dict, out: str = "out", *extra: str) -> list[str]:
    return ["--edges", inp["edges"], "--features", str(d / "x.npy"), "--labels", str(d / "y.npy"),
            "--out", str(d / out), *extra]


def no_leftovers(d: Path, out: str = "out"):
    return not [p for p in d.iterdir() if p.name.startswith(f"{out}.tmp-") or p.name.startswith(f"{out}.old-")]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep")
    inp = write_inputs(d)
    argv = base_argv(d, inp, "out", "--partitions", "3", "--max-bad-records", "3", "--split",
                     "--train-per-class", "2", "--val-per-class", "1", "--seed", "5", "--runner=DirectRunner")
    manifest = prepare.run(argv)
    return d, inp, manifest


def test_direct_adjacency_and_normalization_match_scipy(prepared):
    d, inp, manifest = prepared
    src, dst = np.array(inp["pairs"]).T
    expected = clean_adjacency(src, dst, N)
    adj, x, y, train, val, test, m = shards.load_prepared(d / "out")
    assert m == manifest
    assert adj.shape == (N, N) and (adj != expected).nnz == 0
    assert np.array_equal(adj.indptr, expected.indptr) and np.array_equal(adj.indices, expected.indices)
    a_hat = shards.normalized_adjacency(d / "out")
    ref = gcn_normalize(expected)
    assert np.array_equal(a_hat.indptr, ref.indptr) and np.array_equal(a_hat.indices, ref.indices)
    np.testing.assert_array_equal(a_hat.data, ref.data)  # bit-exact: the same float64 products, then float32
    np.testing.assert_array_equal(x, inp["x"])
    np.testing.assert_array_equal(y, inp["y"])
    masks = per_class_split(inp["y"], C, 2, 1, 5)
    for got, want in zip((train, val, test), masks):
        np.testing.assert_array_equal(got, want)
    assert manifest["num_vertices"] == N and manifest["num_edges"] == expected.nnz
    assert manifest["num_edge_rows"] == expected.nnz + N
    assert manifest["feature_dim"] == F and manifest["num_classes"] == C and manifest["num_partitions"] == 3
    assert manifest["split"]["train"] == int(masks[0].sum())


def test_direct_counters_and_bad_record_locations(prepared):
    d, inp, manifest = prepared
    c = manifest["counters"]
    pairs = inp["pairs"]
    assert c["bad_records"] == 3 and c["header_lines"] == 1
    assert c["self_loops"] == sum(u == v for u, v in pairs)
    non_loops = [(u, v) for u, v in pairs if u != v]
    assert c["duplicate_edges"] == len(non_loops) - len(set(non_loops))
    assert c["input_records"] == len(pairs) + 3
    samples = manifest["bad_record_samples"]
    for loc in inp["bad"]:
        assert any(loc in s for s in samples), (loc, samples)
    assert any("non-integer field 'x'" in s for s in samples)
    assert any("expected 2 fields" in s for s in samples)


def test_direct_shards_partition_by_destination_and_verify(prepared):
    d, _, manifest = prepared
    assert sorted(os.listdir(d / "out")) == ["edges", "manifest.json", "vertices"]
    for p in range(3):
        edges, vertices = shards.read_partition(d / "out", p)
        assert vertices.schema.equals(prepare.vertex_schema(F), check_metadata=False)
        assert edges.schema.equals(prepare.EDGE_SCHEMA, check_metadata=False)
        v = vertices.column("vertex").to_numpy()
        assert (v % 3 == p).all() and (vertices.column("partition").to_numpy() == p).all()
        dst = edges.column("dst").to_numpy()
        assert (dst % 3 == p).all()
        keys = list(zip(dst.tolist(), edges.column("src").to_pylist()))
        assert keys == sorted(keys)
    g = shards.load_graph(d / "out", name="t")
    assert g.num_nodes == N and g.feature_dim == F and g.num_classes == C
    # streamed into place: the same graph as the whole-table reader
    want = shards.load_prepared(d / "out")
    assert (g.adj != want.adj).nnz == 0 and np.array_equal(g.adj.indices, want.adj.indices)
    for got, ref in zip((g.features, g.labels, g.train_mask, g.val_mask, g.test_mask), want[1:6]):
        np.testing.assert_array_equal(got, ref)
    assert no_leftovers(d)
    # a changed shard is detected by its sha256
    victim = d / "out" / manifest["partitions"][1]["vertices"]
    data = victim.read_bytes()
    try:
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(shards.ShardError, match="sha256"):
            shards.load_prepared(d / "out")
    finally:
        victim.write_bytes(data)


def test_bad_records_beyond_limit_fail_without_manifest(tmp_path):
    inp = write_inputs(tmp_path)
    with pytest.raises(DataError, match=r"3 bad edge records exceed --max-bad-records=2") as e:
        prepare.run(base_argv(tmp_path, inp, "out", "--max-bad-records", "2"))
    assert "e-0.csv:" in str(e.value)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_ids_out_of_range_error(tmp_path):
    inp = write_inputs(tmp_path, bad_lines=False)
    with (tmp_path / "e-1.csv").open("a") as f:
        f.write("3\t14\n")
    with pytest.raises(DataError, match=r"vertex id 14 out of range \[0, 14\)") as e:
        prepare.run(base_argv(tmp_path, inp))
    assert "e-1.csv:14" in str(e.value)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)
    with pytest.raises(DataError, match="vertex id 14 out of range"):
        prepare.run(["--edges", inp["edges"], "--num-nodes", "14", "--out", str(tmp_path / "out")])


def test_feature_shape_errors(tmp_path):
    inp = write_inputs(tmp_path, bad_lines=False)
    np.save(tmp_path / "x9.npy", inp["x"][:9])
    with pytest.raises(DataError, match="has 9 rows but the graph has 14 vertices"):
        prepare.run(["--edges", inp["edges"], "--features", str(tmp_path / "x9.npy"), "--num-nodes", "14",
                     "--out", str(tmp_path / "out")])
    with pytest.raises(DataError, match=r"--labels .* has 14 rows but the graph has 9 vertices \(from the 9 rows "
                                        r"of --features"):
        prepare.run(["--edges", inp["edges"], "--features", str(tmp_path / "x9.npy"), "--labels",
                     str(tmp_path / "y.npy"), "--out", str(tmp_path / "out")])
    # a Parquet list column with one row of another width
    rows = [list(map(float, r)) for r in inp["x"]]
    rows[4] = rows[4][:-1]
    pq.write_table(pa.table({"vertex": np.arange(N), "features": pa.array(rows, pa.list_(pa.float32()))}),
                   tmp_path / "xbad.parquet")
    with pytest.raises(DataError, match=r"row 4: 4 features, expected 5"):
        prepare.run(["--edges", inp["edges"], "--features", str(tmp_path / "xbad.parquet"),
                     "--out", str(tmp_path / "out")])
    # NaN
    x = inp["x"].copy()
    x[6, 2] = np.nan
    np.save(tmp_path / "xnan.npy", x)
    with pytest.raises(DataError, match=r"NaN/inf.*vertex 6"):
        prepare.run(["--edges", inp["edges"], "--features", str(tmp_path / "xnan.npy"),
                     "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_file_and_metis_partitioners_and_parquet_features(tmp_path):
    inp = write_inputs(tmp_path, bad_lines=False)
    # wide Parquet features with a shuffled vertex column
    perm = np.random.default_rng(0).permutation(N)
    pq.write_table(pa.table({"vertex": perm, **{f"f{j}": inp["x"][perm, j] for j in range(F)}}),
                   tmp_path / "x.parquet")
    # Parquet labels: shuffled `node` id column, nulls = unlabelled
    y = inp["y"]
    pq.write_table(pa.table({"node": perm, "label": pa.array([None if y[v] < 0 else int(y[v]) for v in perm],
                                                             pa.int32())}), tmp_path / "y.parquet")
    parts = np.random.default_rng(1).integers(0, 2, size=N)
    (tmp_path / "g.part.2").write_text("".join(f"{p}\n" for p in parts))
    m = prepare.run(["--edges", inp["edges"], "--features", str(tmp_path / "x.parquet"), "--partitions", "2",
                     "--labels", str(tmp_path / "y.parquet"), "--partitioner", "file",
                     "--assignment", str(tmp_path / "g.part.2"), "--out", str(tmp_path / "file")])
    assert m["feature_dim"] == F and m["num_classes"] == C and m["split"] is None
    np.testing.assert_array_equal(shards.partition_assignment(tmp_path / "file"), parts)
    p = shards.load_prepared(tmp_path / "file")
    np.testing.assert_array_equal(p.features, inp["x"])
    np.testing.assert_array_equal(p.labels, y)
    assert not p.train_mask.any()

    prepare.run(["--edges", inp["edges"], "--partitions", "2", "--partitioner", "metis",
                 "--out", str(tmp_path / "metis")])
    assign = shards.partition_assignment(tmp_path / "metis")
    assert set(assign.tolist()) == {0, 1}
    for part in range(2):
        edges, _ = shards.read_partition(tmp_path / "metis", part)
        assert (assign[edges.column("dst").to_numpy()] == part).all()
    # N inferred as max id + 1 (vertex 13 is isolated, so 13 vertices)
    assert shards.read_manifest(tmp_path / "metis")["num_vertices"] == N - 1

    # a short assignment file is an error
    (tmp_path / "short").write_text("0\n1\n")
    with pytest.raises(DataError, match="2 partition ids for 14 vertices"):
        prepare.run(["--edges", inp["edges"], "--num-nodes", str(N), "--partitions", "2", "--partitioner",
                     "file", "--assignment", str(tmp_path / "short"), "--out", str(tmp_path / "short-out")])


def test_cli_module_exit_status(tmp_path):
    inp = write_inputs(tmp_path, bad_lines=False)
    np.save(tmp_path / "x9.npy", inp["x"][:9])
    r = subprocess.run([sys.executable, "-m", "pipelines.prepare", "--edges", inp["edges"], "--features",
                        str(tmp_path / "x9.npy"), "--num-nodes", "14", "--out", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "prepare: error:" in r.stderr and "9 rows" in r.stderr
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(tmp_path):
    inp = write_inputs(tmp_path, bad_lines=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(DataError, match="--overwrite"):
        prepare.run(["--edges", inp["edges"], "--out", str(tmp_path / "out")])
    m = prepare.run(["--edges", inp["edges"], "--out", str(tmp_path / "out"), "--overwrite"])
    assert sorted(os.listdir(tmp_path / "out")) == ["edges", "manifest.json", "vertices"]
    assert m["num_vertices"] == N - 1 and no_leftovers(tmp_path)


def _tables(root: Path) -> dict:
    edges, vertices, manifest = shards.read_all(root)
    strip = {k: v for k, v in manifest.items() if k not in ("flags", "pipeline_args", "created_at", "name")}
    return {"edges": edges.sort_by([("dst", "ascending"), ("src", "ascending")]).to_pydict(),
            "vertices": vertices.to_pydict(), "manifest": strip}


@pytest.mark.flink
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # LOOPBACK data-plane hang-up
def test_flink_runner_matches_direct_runner(prepared, tmp_path, flink_flags):
    d, inp, _ = prepared
    argv = base_argv(d, inp, "unused", "--partitions", "3", "--max-bad-records", "3", "--split",
                     "--train-per-class", "2", "--val-per-class", "1", "--seed", "5")
    argv[argv.index("--out") + 1] = str(tmp_path / "flink")
    prepare.run(argv + flink_flags + ["--parallelism=2"])
    got, want = _tables(tmp_path / "flink"), _tables(d / "out")
    assert got["manifest"] == want["manifest"]   # includes every shard's sha256
    assert got["edges"] == want["edges"] and got["vertices"] == want["vertices"]


def test_dorylus_prepare_subcommand_with_gzip_edges(tmp_path, capsys):
    import gzip

    from pipelines import cli

    pairs = _edges()
    with gzip.open(tmp_path / "e.tsv.gz", "wt") as f:
        f.write("# gzipped\n" + "".join(f"{u}\t{v}\n" for u, v in pairs))
    rc = cli.main(["prepare", "--edges", str(tmp_path / "e.tsv.gz"), "--num-nodes", str(N), "--partitions", "2",
                   "--out", str(tmp_path / "out"), "--runner=DirectRunner"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_vertices"] == N
    src, dst = np.array(pairs).T
    assert (shards.load_prepared(tmp_path / "out").adj != clean_adjacency(src, dst, N)).nnz == 0
    assert cli.main(["prepare", "--edges", str(tmp_path / "e.tsv.gz"), "--out", str(tmp_path / "out")]) == 2


def test_text_blocks_fast_path_and_per_line_fallback_keep_line_numbers(monkeypatch):
    """Blocks cut mid-file, Arrow's fast path, halving around bad lines: every edge keeps its file line."""
    import io
    import re

    from apache_beam import pvalue

    from pipelines.beam.prepare import read_edges

    monkeypatch.setattr(read_edges, "MIN_FAST_LINES", 4)
    lines = ["# comment", "", "src\tdst"] + [f"{i}\t{(i * 7) % 50}" for i in range(200)]
    lines[60] = "7\tx"                    # bad
    lines[90] = "  9 \t 10  # trailing"   # valid, odd spacing and a comment
    lines[120] = ""                       # blank
    lines[150] = "1\t2\t3"                # bad
    data = ("\n".join(lines)).encode()    # no final newline
    out = list(prepare.read_text(io.BytesIO(data), "f.tsv", block_bytes=97))
    chunks = [o for o in out if isinstance(o, prepare.EdgeChunk)]
    stats = [o.value for o in out if isinstance(o, pvalue.TaggedOutput)]
    got = [(c.line(i), int(c.src[i]), int(c.dst[i])) for c in chunks for i in range(c.src.size)]
    want = []
    for lineno, line in enumerate(lines, start=1):
        m = re.fullmatch(r"\s*(\d+)\s+(\d+)\s*(#.*)?", line)   # written by hand above: tab or spaces
        if lineno > 3 and m:
            want.append((lineno, int(m[1]), int(m[2])))
    assert got == want
    count = {name: sum(s.n for s in stats if s.name == name) for name in ("input_records", "bad_records",
                                                                          "header_lines")}
    assert count == {"input_records": 199, "bad_records": 2, "header_lines": 1}
    samples = sorted(s.sample for s in stats if s.name == "bad_records" and s.sample)
    assert samples == ["f.tsv:151: expected 2 fields (src dst), got 3", "f.tsv:61: non-integer field 'x'"]
