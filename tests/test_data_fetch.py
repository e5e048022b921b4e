"""fetch(): download from a local HTTP mirror, verify sha256, write atomically, skip files already good."""
import functools
import http.server
import threading

import pytest

from pipelines.data import DataError, fetch, load_dataset


class _Quiet(http.server.SimpleHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def serve():
    servers = []

    def start(directory):
        handler = functools.partial(_Quiet, directory=str(directory))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_fetch_verifies_and_skips_good_files(data_dir, tmp_path, serve):
    base = serve(data_dir)
    out = tmp_path / "data"
    _Quiet.requests.clear()
    paths = fetch("cora", out, base_url=base)
    assert len(paths) == 8 and all(p.is_file() for p in paths)
    assert len(_Quiet.requests) == 8
    assert load_dataset("cora", out).num_edges == 10556
    # a second fetch downloads nothing; a damaged local file is downloaded again
    (out / "planetoid" / "ind.cora.y").write_bytes(b"junk")
    _Quiet.requests.clear()
    fetch("cora", out, base_url=base)
    assert _Quiet.requests == ["/planetoid/ind.cora.y"]
    assert load_dataset("cora", out).num_nodes == 2708


def test_fetch_base_url_from_env(data_dir, tmp_path, serve, monkeypatch):
    monkeypatch.setenv("DORYLUS_DATASET_BASE_URL", serve(data_dir) + "/")
    monkeypatch.setenv("DORYLUS_DATA_DIR", str(tmp_path))
    fetch("cora-ml")
    assert load_dataset("cora-ml").num_nodes == 2995


def test_fetch_rejects_corrupted_download(data_dir, tmp_path, serve):
    mirror = tmp_path / "mirror" / "gnn_benchmark"
    mirror.mkdir(parents=True)
    raw = bytearray((data_dir / "gnn_benchmark" / "cora_ml.npz").read_bytes())
    raw[-10] ^= 0x01
    (mirror / "cora_ml.npz").write_bytes(bytes(raw))
    out = tmp_path / "data"
    with pytest.raises(DataError, match="checksum mismatch.*ffbe4e64857dc6bf38f1877e4312559a064df84b59d0f32f938717de5d5af0fd"):
        fetch("cora-ml", out, base_url=serve(tmp_path / "mirror"))
    assert list(out.rglob("*")) == [out / "gnn_benchmark"]  # no file, no temp file left behind


def test_fetch_missing_on_server_and_unknown(tmp_path, serve, monkeypatch):
    with pytest.raises(DataError, match="could not download .*ind.citeseer.x.*404"):
        fetch("citeseer", tmp_path / "data", base_url=serve(tmp_path))
    assert not list((tmp_path / "data").rglob("ind.*"))
    with pytest.raises(DataError, match="known datasets"):
        fetch("pubmed", tmp_path)
    monkeypatch.delenv("DORYLUS_DATASET_BASE_URL", raising=False)
    with pytest.raises(DataError, match="DORYLUS_DATASET_BASE_URL"):
        fetch("coauthor-cs", tmp_path / "data")


def test_cli_data_fetch_then_train(data_dir, tmp_path, serve, capsys):
    from pipelines.cli import main

    base = serve(data_dir)
    out = tmp_path / "data"
    assert main(["data", "fetch", "citeseer", "--data-dir", str(out), "--base-url", base]) == 0
    assert "8 files verified" in capsys.readouterr().out
    assert main(["train", "--dataset", "citeseer", "--data-dir", str(out), "--epochs", "3", "--quiet",
                 "--out", str(tmp_path / "run")]) == 0
    assert main(["data", "fetch", "no-such-graph", "--data-dir", str(out), "--base-url", base]) == 2
    assert "unknown dataset" in capsys.readouterr().err.lower()
