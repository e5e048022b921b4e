"""Cost and value: the price table, the cost model's arithmetic, what every run records (local-pool and cpu-only
runs of the engine on Cora and on the default synthetic graph, whole-graph runs), and `dorylus report`."""
from __future__ import annotations

import json
import subprocess
import tomllib

import pytest

from pipelines.config import ConfigError, TrainConfig
from pipelines.engine import cost
from tests.support.lambda_tasks import cora


def test_default_prices_are_the_aws_list_prices():
    p = cost.load_prices()
    assert p["lambda"] == {"gb_second": 0.0000166667, "per_million_requests": 0.20}
    assert p["ec2"] == {"c5.xlarge": 0.17, "c5.2xlarge": 0.34, "c5n.2xlarge": 0.432, "c5n.4xlarge": 0.864,
                        "p3.2xlarge": 3.06}
    assert p["s3"] == {"put_per_1000": 0.005, "get_per_1000": 0.0004}
    assert tomllib.loads(cost.PRICES_FILE.read_text()) == cost.DEFAULT_PRICES  # the file and the fallback agree


def test_price_file_overrides_entries(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[ec2]\n"m5.large" = 0.096\n"c5.xlarge" = 0.2\n[lambda]\ngb_second = 0.0000133334\n')
    p = cost.load_prices(f)
    assert p["ec2"]["m5.large"] == 0.096 and p["ec2"]["c5.xlarge"] == 0.2 and p["ec2"]["p3.2xlarge"] == 3.06
    assert p["lambda"] == {"gb_second": 0.0000133334, "per_million_requests": 0.20} and p["source"] == str(f)
    for text, msg in [("[gpu]\nx = 1\n", "unknown section"), ("[lambda]\ngb_sec = 1\n", "unknown price"),
                      ("[ec2]\n\"x\" = -1\n", ">= 0"), ("[ec2]\n\"x\" = \"cheap\"\n", "number"), ("[ec2\n", "TOML")]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            cost.load_prices(f)
    with pytest.raises(ConfigError, match="does not exist"):
        cost.load_prices(tmp_path / "missing.toml")


def test_cost_arithmetic():
    u = {"time_s": 3600.0, "graph_servers": 2, "graph_instance": "c5n.2xlarge", "param_servers": 1,
         "ps_instance": "c5.xlarge", "lambda_invocations": 1_000_000, "lambda_billed_ms": 1_000_000,
         "lambda_memory_mb": 3008, "s3_puts": 1000, "s3_gets": 1000}
    usd = cost.price_usage(u, cost.load_prices())
    assert usd["graph_servers"] == pytest.approx(2 * 0.432)
    assert usd["param_server"] == pytest.approx(0.17)
    assert usd["lambda_compute"] == pytest.approx(1000 * 3008 / 1024 * 0.0000166667)  # 2937.5 GB-s
    assert usd["lambda_requests"] == pytest.approx(0.20)
    assert usd["s3"] == pytest.approx(0.005 + 0.0004)
    assert usd["total"] == pytest.approx(sum(v for k, v in usd.items() if k != "total"))
    assert cost.value(10.0, 0.5) == pytest.approx(0.2) and cost.value(0, 1) is None
    assert cost.lambda_gb_s(1000, 1024) == pytest.approx(1.0) and cost.lambda_gb_s(1, 128) == pytest.approx(0.000125)


def _check_run(out, mode, epochs):
    s = json.loads((out / "summary.json").read_text())
    c = s["cost"]
    assert s["time_s"] > 0 and s["cost_usd"] > 0 and s["value"] == pytest.approx(1 / (s["time_s"] * s["cost_usd"]))
    assert c["mode"] == mode and c["usd"]["total"] == pytest.approx(s["cost_usd"])
    assert s["cost_per_epoch_usd"] == pytest.approx(s["cost_usd"] / epochs)
    assert c["usd"]["graph_servers"] == pytest.approx(2 * 0.432 * s["time_s"] / 3600)
    assert c["bytes_moved"]["total"] > 0 and c["busy_s_by_role"]["graph_server"] > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == epochs
    for r in rows:
        assert r["cost_usd"] > 0 and r["value"] == pytest.approx(1 / (r["epoch_s"] * r["cost_usd"]))
    assert rows[-1]["cum_cost_usd"] <= s["cost_usd"] * 1.0001
    return s, rows


@pytest.mark.parametrize("dataset", ["cora", "synthetic"])
def test_engine_runs_record_time_cost_and_value(tmp_path, dataset):
    from pipelines.data.registry import load_dataset
    from pipelines.engine.runner import train_engine

    graph = cora() if dataset == "cora" else load_dataset(None)
    base = dict(model="gcn", partitions=2, intervals=2, epochs=4)
    out = {m: tmp_path / m for m in ("serverless", "cpu-only")}
    for d in out.values():
        d.mkdir()
    local = train_engine(TrainConfig(**base).resolved(), graph, out=out["serverless"])
    cpu = train_engine(TrainConfig(**base, mode="cpu-only").resolved(), graph, out=out["cpu-only"])
    s, rows = _check_run(out["serverless"], "serverless", 4)
    u = s["cost"]["usage"]
    assert u["lambda_invocations"] == s["tensor_tasks"] > 0 and u["lambda_memory_mb"] == 3008
    assert u["lambda_gb_s"] == pytest.approx(u["lambda_billed_ms"] / 1000 * 3008 / 1024)
    assert u["lambda_billed_ms"] >= s["busy_s"]["tensor_workers"] * 1000  # rounded up per task
    assert s["cost"]["usd"]["lambda_compute"] > 0 and sum(r["lambda_invocations"] for r in rows) == s["tensor_tasks"]
    c, _ = _check_run(out["cpu-only"], "cpu-only", 4)
    assert c["cost"]["usage"]["lambda_invocations"] == 0 and c["cost"]["usd"]["lambda_compute"] == 0
    assert c["cost"]["tensor_backend"] == "inline" and "graph_server.tensor" in c["busy_s"]
    # same training, whoever runs the tensor tasks
    assert [r["loss"] for r in local.history] == pytest.approx([r["loss"] for r in cpu.history], abs=1e-6)


@pytest.fixture
def cli(capsys):
    """`dorylus ARGS` in this process: (exit code, stdout, stderr)."""
    from pipelines.cli import main

    def run(*args):
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def test_report_and_flags(tmp_path, cli):
    ds = ["--dataset", "synthetic:planted?nodes=300&classes=3&features=16", "--epochs", "3", "--quiet"]
    prices = tmp_path / "prices.toml"
    prices.write_text('[ec2]\n"m5.large" = 0.096\n')
    a, b, w = tmp_path / "a", tmp_path / "b", tmp_path / "w"
    r = cli("train", *ds, "--partitions", "2", "--out", str(a), "--lambda-memory-mb", "1024", "--prices",
             str(prices), "--ps-instance", "m5.large")
    assert r.returncode == 0, r.stderr
    r = cli("train", *ds, "--partitions", "2", "--mode", "cpu-only", "--out", str(b))
    assert r.returncode == 0, r.stderr
    r = cli("train", *ds, "--out", str(w))  # whole-graph trainer: one machine
    assert r.returncode == 0, r.stderr
    sa = json.loads((a / "summary.json").read_text())
    assert sa["cost"]["usage"]["lambda_memory_mb"] == 1024 and sa["cost"]["usage"]["ps_instance"] == "m5.large"
    assert sa["cost"]["usd"]["param_server"] == pytest.approx(0.096 * sa["time_s"] / 3600)
    sw = json.loads((w / "summary.json").read_text())
    assert sw["cost"]["mode"] == "single-machine" and sw["cost"]["usage"]["param_servers"] == 0 and sw["value"] > 0
    assert "cost_usd" in json.loads((w / "metrics.jsonl").read_text().splitlines()[-1])

    r = cli("report", str(a), str(b), str(w))
    assert r.returncode == 0, r.stderr
    for text in ("[cost (USD)]", "[value]", "value vs first run", "1.000x", "serverless", "cpu-only",
                 "single-machine", "lambda GB-s", "bytes moved", "busy graph_server (s)"):
        assert text in r.stdout, (text, r.stdout)
    # re-pricing: twice the EC2 prices double the server lines
    dear = tmp_path / "dear.toml"
    p = cost.load_prices()
    dear.write_text("[ec2]\n" + "".join(f'"{k}" = {2 * v}\n' for k, v in p["ec2"].items()) + '"m5.large" = 1.0\n')
    j1 = json.loads(cli("report", str(b), "--json").stdout)
    j2 = json.loads(cli("report", str(b), "--json", "--prices", str(dear)).stdout)
    assert j1["runs"] == [str(b)] and j1["sections"]["cost (USD)"]["graph servers"][0].startswith("$")
    assert j2["sections"]["cost (USD)"]["graph servers"] != j1["sections"]["cost (USD)"]["graph servers"]
    from pipelines.report import load_run

    c1, c2 = load_run(b).cost, load_run(b, cost.load_prices(dear)).cost
    assert c2["usd"]["graph_servers"] == pytest.approx(2 * c1["usd"]["graph_servers"])
    assert c2["value"] == pytest.approx(1 / (c2["time_s"] * c2["usd"]["total"])) and c2["prices"] == str(dear)

    r = cli("train", *ds, "--partitions", "2", "--out", str(tmp_path / "x"), "--graph-instance", "z9.mega")
    assert r.returncode == 2 and "instance type 'z9.mega' has no price" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("report", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not a run directory" in r.stderr


def test_lambda_package(tmp_path, cli):
    import tarfile
    import zipfile

    r = cli("lambda", "package", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "does not fit" in r.stdout and "artifact: container image" in r.stdout
    rep = json.loads((tmp_path / "size_report.json").read_text())
    assert rep["numpy_jax_jaxlib_pyarrow_bytes"] > rep["limits"]["zip_unzipped_with_layers"]
    assert rep["zip_deployment_fits"] is False
    names = zipfile.ZipFile(tmp_path / "dorylus-lambda-code.zip").namelist()
    assert "ops/lambda_handler.py" in names and "schemas/messages.py" in names
    assert {n.split("/")[0] for n in names} == {"ops", "schemas"} and not any("__pycache__" in n for n in names)
    with tarfile.open(tmp_path / "dorylus-lambda-image.tar.gz") as t:
        tn = t.getnames()
    assert tn[:2] == ["Dockerfile", "pyproject.toml"] and "ops/lambda_handler.py" in tn
    assert {n.split("/")[0] for n in tn} <= {"Dockerfile", "pyproject.toml", "README.md", "ops", "schemas"}
    # reproducible: a second build is byte-identical
    r2 = cli("lambda", "package", "--out", str(tmp_path / "again"))
    rep2 = json.loads((tmp_path / "again" / "size_report.json").read_text())
    assert rep2["code_zip"]["sha256"] == rep["code_zip"]["sha256"]
    assert rep2["image_context"]["sha256"] == rep["image_context"]["sha256"] and r2.returncode == 0
