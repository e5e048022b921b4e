"""Real datasets: the loaded graphs match the statistics in shared/datasets/README.md."""
import numpy as np
import pytest

from pipelines.data import load_dataset
from pipelines.data.graph import gcn_normalize
from pipelines.data.splits import largest_component

# name -> (nodes, directed edges both ways, features, classes, train, val, test, class counts)
PLANETOID = {
    "cora": (2708, 10556, 1433, 7, 140, 500, 1000, [351, 217, 418, 818, 426, 298, 180]),
    "citeseer": (3327, 9104, 3703, 6, 120, 500, 1000, [249, 590, 668, 701, 596, 508]),
}
# name -> (nodes, directed edges both ways, features, classes, class counts, LCC nodes)
NPZ = {
    "cora-ml": (2995, 16316, 2879, 7, [354, 402, 452, 442, 857, 193, 295], 2810),
    "amazon-computers": (13752, 491722, 767, 10, [436, 2142, 1414, 542, 5158, 308, 487, 818, 2156, 291], 13381),
    "coauthor-cs": (18333, 163788, 6805, 15,
                    [708, 462, 2050, 429, 1394, 2193, 371, 924, 775, 118, 1444, 2033, 420, 4136, 876], 18333),
    "gnn_benchmark/cora.npz": (2708, 10556, 1433, 7, [298, 418, 818, 426, 217, 180, 351], 2485),
    "gnn_benchmark/citeseer.npz": (3312, 9072, 3703, 6, [249, 596, 701, 508, 668, 590], 2110),
}


def _check_record(g):
    a = g.adj
    assert a.indices.dtype == np.int32 and g.features.dtype == np.float32 and g.labels.dtype == np.int32
    assert (a != a.T).nnz == 0 and a.diagonal().sum() == 0 and (a.data == 1).all()
    assert not (g.train_mask & g.val_mask).any() and not (g.train_mask & g.test_mask).any()
    assert not (g.val_mask & g.test_mask).any()


@pytest.mark.parametrize("name", sorted(PLANETOID))
def test_planetoid_statistics(data_dir, name):
    n, e, f, c, tr, va, te, counts = PLANETOID[name]
    g = load_dataset(name, data_dir)
    assert (g.num_nodes, g.num_edges, g.feature_dim, g.num_classes) == (n, e, f, c)
    assert (g.train_mask.sum(), g.val_mask.sum(), g.test_mask.sum()) == (tr, va, te)
    assert np.bincount(g.labels[g.labels >= 0]).tolist() == counts
    _check_record(g)
    # public split: the first len(y) ids train, the next 500 val
    assert np.flatnonzero(g.train_mask).tolist() == list(range(tr))
    assert np.flatnonzero(g.val_mask).tolist() == list(range(tr, tr + 500))
    assert (gcn_normalize(g.adj).diagonal() > 0).all()


def test_citeseer_missing_test_nodes(data_dir):
    g = load_dataset("citeseer", data_dir)
    missing = np.flatnonzero(g.labels < 0)
    assert missing.size == 15
    assert (g.features[missing] == 0).all() and not g.test_mask[missing].any()
    assert (g.adj.getnnz(axis=1) == 0).sum() == 48  # isolated nodes, README table


@pytest.mark.parametrize("spec", sorted(NPZ))
def test_npz_statistics(data_dir, spec):
    n, e, f, c, counts, lcc_nodes = NPZ[spec]
    g = load_dataset(str(data_dir / spec) if spec.endswith(".npz") else spec, data_dir, seed=0)
    assert (g.num_nodes, g.num_edges, g.feature_dim, g.num_classes) == (n, e, f, c)
    assert np.bincount(g.labels).tolist() == counts
    # Shchur split: over the largest connected component, 20 train and 30 val per class, every other LCC node test;
    # the graph keeps every node
    lcc = largest_component(g.adj)
    assert lcc.sum() == lcc_nodes
    assert np.bincount(g.labels[g.train_mask], minlength=c).tolist() == [20] * c
    assert np.bincount(g.labels[g.val_mask], minlength=c).tolist() == [30] * c
    assert g.test_mask.sum() == lcc_nodes - 50 * c
    assert not ((g.train_mask | g.val_mask | g.test_mask) & ~lcc).any()
    _check_record(g)


def test_npz_split_is_seeded(data_dir):
    a = load_dataset("cora-ml", data_dir, seed=1)
    b = load_dataset("cora-ml", data_dir, seed=1)
    c = load_dataset("cora-ml", data_dir, seed=2)
    assert np.array_equal(a.train_mask, b.train_mask) and np.array_equal(a.val_mask, b.val_mask)
    assert not np.array_equal(a.train_mask, c.train_mask)


def test_planetoid_prefix_path(data_dir):
    g = load_dataset(str(data_dir / "planetoid" / "ind.cora"))
    assert g.summary()["edges"] == 10556 and g.name == "cora"
