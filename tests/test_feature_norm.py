"""Feature normalization chosen from the features (feature_norm = auto), and what a run records of the choice."""
import numpy as np
import pytest

from pipelines.cli import main
from pipelines.data.features import normalize_features, resolve_feature_norm


def bag_of_words(rows, dim, words, seed=0):
    rng = np.random.default_rng(seed)
    x = np.zeros((rows, dim), np.float32)
    for r in range(rows):
        x[r, rng.choice(dim, words, replace=False)] = 1.0
    return x


def test_short_rows_are_row_normalized_long_rows_are_kept():
    short = bag_of_words(50, 400, 15)   # 15 <= sqrt(400) = 20 words a row, like Planetoid
    long = bag_of_words(50, 400, 60)    # 60 > 20, like Amazon's 267 of 767
    assert resolve_feature_norm(short) == "row"
    np.testing.assert_allclose(normalize_features(short).sum(1), 1.0, rtol=1e-6)
    assert resolve_feature_norm(long) == "none"
    assert normalize_features(long) is long


def test_signed_or_empty_features_are_kept_and_explicit_modes_win():
    signed = bag_of_words(20, 400, 5) - 0.5
    assert resolve_feature_norm(signed) == "none"
    assert resolve_feature_norm(np.zeros((4, 9), np.float32)) == "none"
    long = bag_of_words(20, 400, 60)
    assert resolve_feature_norm(long, "row") == "row"
    np.testing.assert_allclose(normalize_features(long, "row").sum(1), 1.0, rtol=1e-6)
    assert resolve_feature_norm(bag_of_words(20, 400, 5), "none") == "none"
    with pytest.raises(ValueError, match="feature_norm"):
        resolve_feature_norm(long, "l2")


@pytest.mark.parametrize("dataset,want", [("cora", "row"), ("synthetic:planted?nodes=300&classes=3", "none")])
def test_the_run_config_records_what_auto_chose(tmp_path, capsys, data_dir, dataset, want):
    out = tmp_path / "run"
    assert main(["train", "--dataset", dataset, "--data-dir", str(data_dir), "--epochs", "2", "--quiet",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    assert f'feature_norm = "{want}"' in (out / "config.toml").read_text()


def test_unknown_feature_norm_is_a_one_line_error(tmp_path, capsys):
    assert main(["train", "--feature-norm", "l2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--feature-norm" in err[0]
    assert not (tmp_path / "x").exists()
