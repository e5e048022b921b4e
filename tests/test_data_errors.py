"""Bad inputs: every wrong file, id, value or name raises DataError saying what and where."""
import pickle
import shutil

import numpy as np
import pytest

from pipelines.data import DataError, load_dataset, verify_dataset
from pipelines.data.graph import make_graph
from pipelines.data.planetoid import load_planetoid


def _copy_cora(data_dir, tmp_path):
    (tmp_path / "planetoid").mkdir()
    for f in (data_dir / "planetoid").glob("ind.cora.*"):
        shutil.copy(f, tmp_path / "planetoid" / f.name)
    return tmp_path


def test_checksum_mismatch_names_file_and_hashes(data_dir, tmp_path):
    root = _copy_cora(data_dir, tmp_path)
    bad = root / "planetoid" / "ind.cora.graph"
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        load_dataset("cora", root)
    msg = str(e.value)
    assert str(bad) in msg and "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d" in msg
    assert "got" in msg


def test_missing_file_suggests_fetch(data_dir, tmp_path):
    root = _copy_cora(data_dir, tmp_path)
    (root / "planetoid" / "ind.cora.ty").unlink()
    with pytest.raises(DataError, match=r"ind\.cora\.ty.*dorylus data fetch cora.*--data-dir"):
        verify_dataset("cora", root)


def test_data_dir_from_env(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DORYLUS_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match=str(tmp_path)):
        load_dataset("cora-ml")
    monkeypatch.setenv("DORYLUS_DATA_DIR", str(data_dir))
    assert load_dataset("cora-ml").num_nodes == 2995


def test_unknown_dataset_lists_known_names():
    with pytest.raises(DataError, match="cora, cora-ml"):
        load_dataset("ogbn-papers100m")
    with pytest.raises(DataError, match="unknown parameter 'bogus'"):
        load_dataset("synthetic:planted?bogus=1")
    with pytest.raises(DataError, match="not a number"):
        load_dataset("synthetic:rmat?scale=x")


def test_planetoid_refuses_foreign_pickles(data_dir, tmp_path):
    root = _copy_cora(data_dir, tmp_path)
    (root / "planetoid" / "ind.cora.graph").write_bytes(pickle.dumps(shutil.rmtree, protocol=2))
    with pytest.raises(DataError, match="refusing to load shutil.rmtree"):
        load_planetoid(root / "planetoid" / "ind.cora")


def _masks(n):
    m = np.zeros(n, bool)
    return m, m, m


def test_edge_ids_out_of_range():
    with pytest.raises(DataError, match="out of range"):
        make_graph("g", [0, 1], [1, 5], np.zeros((3, 2)), np.zeros(3, int), *_masks(3))
    with pytest.raises(DataError, match="out of range"):
        make_graph("g", [-1], [1], np.zeros((3, 2)), np.zeros(3, int), *_masks(3))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features(bad):
    x = np.zeros((3, 2))
    x[1, 1] = bad
    with pytest.raises(DataError, match="NaN or inf.*node 1"):
        make_graph("g", [0], [1], x, np.zeros(3, int), *_masks(3))


def test_label_count_mismatch():
    with pytest.raises(DataError, match="label count 2 does not match node count 3"):
        make_graph("g", [0], [1], np.zeros((3, 2)), np.zeros(2, int), *_masks(3))


def _write(path, text):
    path.write_text(text)
    return path


def test_malformed_edge_line_names_file_and_line(tmp_path):
    np.save(tmp_path / "g.labels.npy", np.zeros(4, np.int64))
    p = _write(tmp_path / "g.csv", "src,dst\n# comment\n0,1\n1,2\n2,x\n")
    with pytest.raises(DataError, match=rf"{p}:5: node id 'x' is not an integer"):
        load_dataset(str(p))
    _write(p, "0,1\n\n1,2,3\n")
    with pytest.raises(DataError, match=rf"{p}:3: expected 2 columns"):
        load_dataset(str(p))
    _write(p, "0,1\n1,-2\n")
    with pytest.raises(DataError, match=rf"{p}:2: node id -2 is negative"):
        load_dataset(str(p))


def test_edge_list_ids_beyond_labels(tmp_path):
    np.save(tmp_path / "g.labels.npy", np.zeros(3, np.int64))
    p = _write(tmp_path / "g.tsv", "0\t1\n1\t7\n")
    with pytest.raises(DataError, match=r"edge endpoint id 7 is out of range \[0, 3\)"):
        load_dataset(str(p))


def test_edge_list_requires_labels(tmp_path):
    p = _write(tmp_path / "g.csv", "0,1\n")
    with pytest.raises(DataError, match="labels are required"):
        load_dataset(str(p))


def test_edge_list_feature_and_label_rows_must_agree(tmp_path):
    p = _write(tmp_path / "g.csv", "0,1\n")
    np.save(tmp_path / "g.labels.npy", np.zeros(3, np.int64))
    np.save(tmp_path / "g.features.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(DataError, match="label count 3.*does not match feature rows 4"):
        load_dataset(str(p))


def test_edge_list_nan_features(tmp_path):
    p = _write(tmp_path / "g.csv", "0,1\n")
    np.save(tmp_path / "g.labels.npy", np.zeros(2, np.int64))
    np.save(tmp_path / "g.features.npy", np.array([[0.0], [np.nan]], np.float32))
    with pytest.raises(DataError, match="NaN or inf"):
        load_dataset(str(p))


def test_npz_rejects_pickles_and_bad_layout(tmp_path):
    p = tmp_path / "g.npz"
    np.savez(p, adj_data=np.array([{"x": 1}], dtype=object))
    with pytest.raises(DataError, match="g.npz"):
        load_dataset(str(p))
    np.savez(p, adj_data=np.ones(1), adj_indices=[1], adj_indptr=[0, 1, 1], adj_shape=[2, 2])
    with pytest.raises(DataError, match="no 'labels' array"):
        load_dataset(str(p))


def test_unrecognized_path(tmp_path):
    (tmp_path / "g.bin").write_bytes(b"")
    with pytest.raises(DataError, match="cannot tell the format"):
        load_dataset(str(tmp_path / "g.bin"))
