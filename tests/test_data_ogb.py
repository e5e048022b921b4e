"""The OGB node-property loader (pipelines/data/ogb.py) on small directories written in OGB's layout."""
import numpy as np
import pytest

from pipelines.data import DataError, load_dataset
from pipelines.data.synthetic import planted_partition
from tests.support.ogb import gz as _gz, write_ogb


@pytest.fixture(scope="module")
def graph():
    return planted_partition(num_nodes=240, num_classes=3, feature_dim=6, seed=3)


def test_layout_loads_the_same_graph(graph, tmp_path):
    root = write_ogb(tmp_path / "ogbn_tiny", graph)
    g = load_dataset(str(root))
    assert g.name == "ogbn_tiny" and g.num_nodes == graph.num_nodes and g.num_classes == graph.num_classes
    assert (g.adj != graph.adj).nnz == 0  # directed edges once in the file, symmetric in the graph
    np.testing.assert_allclose(g.features, graph.features, atol=1e-6)
    np.testing.assert_array_equal(g.labels, graph.labels)
    for a, b in ((g.train_mask, graph.train_mask), (g.val_mask, graph.val_mask), (g.test_mask, graph.test_mask)):
        np.testing.assert_array_equal(a, b)


def test_unlabelled_nodes_and_node_count_beside_raw(graph, tmp_path):
    root = write_ogb(tmp_path / "d", graph)
    labels = graph.labels.copy()
    unl = np.flatnonzero(~(graph.train_mask | graph.val_mask | graph.test_mask))[:5]
    labels[unl] = -1
    _gz(root / "raw" / "node-label.csv.gz", ["nan" if v < 0 else str(v) for v in labels])
    (root / "raw" / "num-node-list.csv.gz").rename(root / "num-node-list.csv.gz")
    g = load_dataset(str(root))
    assert (g.labels[unl] == -1).all() and g.num_nodes == graph.num_nodes


@pytest.mark.parametrize("rel,what", [("raw/edge.csv.gz", "edge"), ("raw/node-feat.csv.gz", "node feature"),
                                      ("raw/node-label.csv.gz", "node label"),
                                      ("raw/num-node-list.csv.gz", "node count"),
                                      ("split/time/valid.csv.gz", "valid split")])
def test_missing_file(graph, tmp_path, rel, what):
    root = write_ogb(tmp_path / "d", graph)
    (root / rel).unlink()
    with pytest.raises(DataError, match=rf"OGB dataset .*d: missing {what} file .*{rel}"):
        load_dataset(str(root))


@pytest.mark.parametrize("rel,rows,match", [
    ("raw/edge.csv.gz", ["0,1", "1,2,3"], r"edge\.csv\.gz:2: expected 2 comma-separated values, got 3"),
    ("raw/edge.csv.gz", ["0,1", "1,x"], r"edge\.csv\.gz:2: 'x' is not an integer"),
    ("raw/edge.csv.gz", ["0,1", "1,500"], r"edge\.csv\.gz: node id 500 is out of range \[0, 240\)"),
    ("raw/edge.csv.gz", ["0,1", "-1,2"], r"edge\.csv\.gz: node id -1 is out of range"),
    ("raw/node-feat.csv.gz", None, r"node-feat\.csv\.gz:3: expected 6 comma-separated values, got 5"),
    ("raw/node-feat.csv.gz", "abc", r"node-feat\.csv\.gz:2: 'abc' is not a number"),
    ("raw/node-feat.csv.gz", "nan", r"features contain NaN or inf \(first at node 1\)"),
    ("raw/node-label.csv.gz", "2.5", r"labels must be integers"),
    ("raw/node-label.csv.gz", "q", r"node-label\.csv\.gz:2: 'q' is not an integer"),
    ("raw/node-label.csv.gz", "short", r"node-label\.csv\.gz: 239 labels, expected 240"),
    ("raw/node-label.csv.gz", "multi", r"2 label columns; only single-label"),
    ("raw/num-node-list.csv.gz", ["240", "50"], r"expected one positive node count"),
    ("raw/node-feat.csv.gz", "short", r"node-feat\.csv\.gz: 239 feature rows, expected 240"),
])
def test_bad_row(graph, tmp_path, rel, rows, match):
    root = write_ogb(tmp_path / "d", graph)
    if rel == "raw/node-feat.csv.gz":
        feats = [",".join(f"{v:.6f}" for v in row) for row in graph.features]
        if rows is None:
            feats[2] = feats[2].rsplit(",", 1)[0]
        elif rows == "short":
            feats = feats[:-1]
        else:
            feats[1] = feats[1].replace(feats[1].split(",")[3], rows, 1)
        rows = feats
    elif rel == "raw/node-label.csv.gz":
        labels = [str(v) for v in graph.labels]
        if rows == "short":
            labels = labels[:-1]
        elif rows == "multi":
            labels = [f"{v},0" for v in labels]
        else:
            labels[1] = rows
        rows = labels
    _gz(root / rel, rows)
    with pytest.raises(DataError, match=match):
        load_dataset(str(root))


def test_the_split(graph, tmp_path):
    root = write_ogb(tmp_path / "d", graph, splits=("time", "random"))
    with pytest.raises(DataError, match=r"several splits \['random', 'time'\]; pick one with .*\?split=NAME"):
        load_dataset(str(root))
    g = load_dataset(f"{root}?split=random")
    assert g.train_mask.sum() == graph.train_mask.sum()
    with pytest.raises(DataError, match=r"unknown split 'nope'; the dataset has \['random', 'time'\]"):
        load_dataset(f"{root}?split=nope")
    with pytest.raises(DataError, match=r"unknown parameter 'seed'|takes \?split=NAME"):
        load_dataset(f"{root}?split=time&seed=1")
    # a picked split is the one used: move a test node into train in one of them
    test_ids = np.flatnonzero(graph.test_mask)
    train = np.concatenate([np.flatnonzero(graph.train_mask), test_ids[:1]])
    _gz(root / "split" / "random" / "train.csv.gz", [str(i) for i in train])
    _gz(root / "split" / "random" / "test.csv.gz", [str(i) for i in test_ids[1:]])
    g = load_dataset(f"{root}?split=random")
    assert g.train_mask[test_ids[0]] and not g.test_mask[test_ids[0]]
    assert not load_dataset(f"{root}?split=time").train_mask[test_ids[0]]


@pytest.mark.parametrize("part,ids,match", [
    ("valid", [0, 999], r"valid\.csv\.gz: node id 999 is out of range \[0, 240\)"),
    ("test", "dup", r"test\.csv\.gz: a node id appears twice"),
    ("test", "overlap", r"test\.csv\.gz: node \d+ is also in the train split"),
    ("train", ["1", "x"], r"train\.csv\.gz:2: 'x' is not an integer"),
])
def test_bad_split(graph, tmp_path, part, ids, match):
    root = write_ogb(tmp_path / "d", graph)
    if ids == "dup":
        t = np.flatnonzero(graph.test_mask)
        ids = list(t) + [t[0]]
    elif ids == "overlap":
        ids = list(np.flatnonzero(graph.test_mask)) + [int(np.flatnonzero(graph.train_mask)[0])]
    _gz(root / "split" / "time" / f"{part}.csv.gz", [str(i) for i in ids])
    with pytest.raises(DataError, match=match):
        load_dataset(str(root))


def test_not_an_ogb_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not an OGB node-property dataset"):
        load_dataset(str(tmp_path / "empty"))
    (tmp_path / "nosplit" / "raw").mkdir(parents=True)
    with pytest.raises(DataError, match="missing node count file"):
        load_dataset(str(tmp_path / "nosplit"))
