"""Edge-list loading: delimiters, headers, comments, companion files in .npy and Parquet."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data import load_dataset
from pipelines.data.edgelist import load_edgelist, read_edges
from pipelines.data.features import degree_features


def test_read_edges_formats(tmp_path):
    cases = {
        "a.csv": "# a graph\nsrc,dst\n0,1\n1, 2  # trailing comment\n\n2,0\n",
        "b.tsv": "0\t1\n1\t2\n2\t0\n",
        "c.txt": "from to\n0 1\n1   2\n2 0\n",
    }
    for fname, text in cases.items():
        p = tmp_path / fname
        p.write_text(text)
        src, dst = read_edges(p)
        assert src.tolist() == [0, 1, 2] and dst.tolist() == [1, 2, 0], fname
    crlf = tmp_path / "d.csv"
    crlf.write_bytes(b"\xef\xbb\xbf0,1\r\n1,2\r\n2,0\r\n")  # UTF-8 BOM and Windows line ends
    assert read_edges(crlf)[0].tolist() == [0, 1, 2]
    empty = tmp_path / "e.csv"
    empty.write_text("# nothing\n")
    assert read_edges(empty)[0].size == 0


def test_companions_npy_default_features_and_split(tmp_path):
    (tmp_path / "g.csv").write_text("0,1\n1,2\n2,3\n3,0\n0,2\n4,4\n")
    labels = np.array([0, 1, 0, 1, -1] + [0] * 120 + [1] * 120)
    np.save(tmp_path / "g.labels.npy", labels)
    g = load_dataset(str(tmp_path / "g.csv"), seed=3)
    assert g.num_nodes == 245 and g.num_edges == 10 and g.num_classes == 2
    assert np.array_equal(g.features, degree_features(g.adj))
    assert g.train_mask.sum() == 40 and g.val_mask.sum() == 60 and g.test_mask.sum() == 244 - 100
    assert not (g.train_mask | g.val_mask | g.test_mask)[4]
    again = load_dataset(str(tmp_path / "g.csv"), seed=3)
    assert np.array_equal(g.train_mask, again.train_mask)


def test_companions_parquet_with_node_ids(tmp_path):
    (tmp_path / "g.csv").write_text("0,1\n1,2\n")
    order = [2, 0, 1]
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    pq.write_table(pa.table({"node": order, "features": pa.array([x[i].tolist() for i in order],
                                                                  pa.list_(pa.float32()))}),
                   tmp_path / "x.parquet")
    pq.write_table(pa.table({"id": order, "label": [1, 0, 2]}), tmp_path / "g.labels.parquet")
    pq.write_table(pa.table({"split": ["train", "val", None]}), tmp_path / "s.parquet")
    g = load_dataset(f"{tmp_path / 'g.csv'}?features=x.parquet&split=s.parquet")
    assert np.array_equal(g.features, x)
    assert g.labels.tolist() == [0, 2, 1]
    assert g.train_mask.tolist() == [True, False, False] and g.val_mask.tolist() == [False, True, False]
    assert not g.test_mask.any()


def test_parquet_wide_features(tmp_path):
    (tmp_path / "g.txt").write_text("0 1\n")
    pq.write_table(pa.table({"f0": [1.0, 2.0], "f1": [3, 4]}), tmp_path / "g.features.parquet")
    np.save(tmp_path / "g.labels.npy", np.array([0, 1]))
    np.save(tmp_path / "g.split.npy", np.array([0, 2]))
    g = load_edgelist(tmp_path / "g.txt")
    assert g.features.tolist() == [[1.0, 3.0], [2.0, 4.0]]
    assert g.train_mask.tolist() == [True, False] and g.test_mask.tolist() == [False, True]
