"""`dorylus train` end to end: outputs, config files, determinism, and one-line errors on bad input."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipelines.cli import main


def run_cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_train_writes_a_complete_run_directory(tmp_path, capsys, data_dir):
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train", "--dataset", "cora", "--data-dir", str(data_dir), "--epochs", "30",
                                 "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} >= {"metrics.jsonl", "summary.json", "config.toml", "weights.npz"}
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(30))
    assert {"loss", "train_acc", "val_acc", "test_acc", "epoch_s"} <= set(rows[0])
    assert rows[-1]["loss"] < rows[0]["loss"]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["epochs"] == 30
    assert s["test_acc"] == rows[s["best_epoch"]]["test_acc"]
    assert s["best_val_acc"] == max(r["val_acc"] for r in rows)
    w = np.load(out / "weights.npz")
    assert w["av0/w"].shape == (1433, 16)
    assert "cora" in stdout


def test_config_file_gives_the_same_run_as_flags(tmp_path, capsys, data_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(["train", "--dataset", "cora", "--data-dir", str(data_dir), "--epochs", "12", "--lr", "0.02",
                    "--hidden", "8", "--seed", "3", "--out", str(a), "--quiet"], capsys)[0] == 0
    # The written config.toml, fed back, reproduces the run bit for bit (seeds everywhere).
    cfg = tmp_path / "c.toml"
    shutil.copy(a / "config.toml", cfg)
    text = cfg.read_text().replace(f'out = "{a}"', f'out = "{b}"')
    cfg.write_text(text)
    assert run_cli(["train", "--config", str(cfg), "--quiet"], capsys)[0] == 0
    ra = (a / "metrics.jsonl").read_text().splitlines()
    rb = (b / "metrics.jsonl").read_text().splitlines()
    timing = {"epoch_s", "cost_usd", "cum_cost_usd", "value"}  # wall-clock dependent (cost and value too)
    strip = lambda rows: [{k: v for k, v in json.loads(r).items() if k not in timing} for r in rows]
    assert strip(ra) == strip(rb)
    assert np.array_equal(np.load(a / "weights.npz")["av0/w"], np.load(b / "weights.npz")["av0/w"])


def test_default_dataset_needs_no_files(tmp_path, capsys):
    code, stdout, err = run_cli(["train", "--epochs", "60", "--out", str(tmp_path / "r"), "--quiet"], capsys)
    assert code == 0, err
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["dataset"]["name"].startswith("planted")
    assert s["test_acc"] > 0.5  # 7 classes: chance is ~0.14


def test_console_script_runs_as_a_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", "--epochs", "3", "--out",
                        str(tmp_path / "r"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r" / "summary.json").exists()


def _bad(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    code, stdout, err = run_cli(argv + ["--out", str(out), "--quiet"], capsys)
    assert code == 2
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert needle.lower() in lines[0].lower(), lines[0]
    assert not out.exists(), "no output directory is left behind on bad input"


def test_unknown_dataset(tmp_path, capsys):
    _bad(tmp_path, capsys, ["train", "--dataset", "cora-xl"], "unknown dataset")


def test_missing_files(tmp_path, capsys):
    _bad(tmp_path, capsys, ["train", "--dataset", "cora", "--data-dir", str(tmp_path / "empty")], "missing")


def test_corrupt_file_fails_the_checksum(tmp_path, capsys, data_dir):
    d = tmp_path / "data"
    shutil.copytree(data_dir / "planetoid", d / "planetoid")
    p = d / "planetoid" / "ind.cora.x"
    p.chmod(0o644)
    raw = bytearray(p.read_bytes())
    raw[100] ^= 0xFF
    p.write_bytes(bytes(raw))
    _bad(tmp_path, capsys, ["train", "--dataset", "cora", "--data-dir", str(d)], "sha256")


def _edge_graph(tmp_path, edges, feats, labels):
    g = tmp_path / "g.csv"
    g.write_text("src,dst\n" + "".join(f"{u},{v}\n" for u, v in edges))
    np.save(tmp_path / "g.features.npy", feats)
    np.save(tmp_path / "g.labels.npy", labels)
    return g


def test_edge_ids_out_of_range(tmp_path, capsys):
    g = _edge_graph(tmp_path, [(0, 1), (1, 7)], np.ones((4, 3), np.float32), np.array([0, 1, 0, 1]))
    _bad(tmp_path, capsys, ["train", "--dataset", str(g)], "out of range")


def test_nan_features(tmp_path, capsys):
    f = np.ones((4, 3), np.float32)
    f[2, 1] = np.nan
    g = _edge_graph(tmp_path, [(0, 1), (1, 2), (2, 3)], f, np.array([0, 1, 0, 1]))
    _bad(tmp_path, capsys, ["train", "--dataset", str(g)], "nan")


def test_label_count_mismatch(tmp_path, capsys):
    g = _edge_graph(tmp_path, [(0, 1), (1, 2), (2, 3)], np.ones((4, 3), np.float32), np.array([0, 1, 0]))
    _bad(tmp_path, capsys, ["train", "--dataset", str(g)], "label")


@pytest.mark.parametrize("flags,needle", [
    (["--epochs", "0"], "epochs"),
    (["--epochs", "ten"], "--epochs"),
    (["--lr", "-1"], "lr"),
    (["--dropout", "1.5"], "dropout"),
    (["--model", "transformer"], "--model"),
    (["--hidden", "0"], "hidden"),
    (["--bogus-flag"], "unrecognized"),
    (["--partitions", "0"], "partitions"),
    (["--intervals", "0"], "intervals"),
    (["--staleness", "-1"], "staleness"),
    (["--staleness", "soon"], "staleness"),
    (["--staleness-mode", "eventual"], "--staleness-mode"),
    (["--config", "/nonexistent/c.toml"], "config"),
])
def test_nonsense_flags(tmp_path, capsys, flags, needle):
    _bad(tmp_path, capsys, ["train"] + flags, needle)


def test_bad_config_file(tmp_path, capsys):
    c = tmp_path / "c.toml"
    c.write_text('epochs = 5\nlearning_rate = 0.1\n')
    _bad(tmp_path, capsys, ["train", "--config", str(c)], "learning_rate")
    c.write_text('epochs = "five"\n')
    _bad(tmp_path, capsys, ["train", "--config", str(c)], "epochs")
    c.write_text('staleness_mode = "eventual"\n')
    _bad(tmp_path, capsys, ["train", "--config", str(c)], "staleness_mode")
    c.write_text('epochs = [\n')
    _bad(tmp_path, capsys, ["train", "--config", str(c)], "toml")


def test_more_partitions_than_vertices(tmp_path, capsys):
    _bad(tmp_path, capsys, ["train", "--dataset", "synthetic:planted?nodes=50&classes=2&degree=4&features=8",
                            "--partitions", "51"], "partitions")


def test_refuses_to_mix_runs_in_one_directory(tmp_path, capsys):
    out = tmp_path / "r"
    assert run_cli(["train", "--epochs", "2", "--out", str(out), "--quiet"], capsys)[0] == 0
    code, _, err = run_cli(["train", "--epochs", "2", "--out", str(out), "--quiet"], capsys)
    assert code == 2 and "not empty" in err
