"""`dorylus report RUN_DIR` writes RUN_DIR/report/: PNG plots and an index.html; the engine records the timeline."""
import json

import pytest

from pipelines.engine.spans import SpanLog

PLOTS = ["loss.png", "accuracy.png", "timeline.png", "staleness.png", "cost.png"]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, data_dir):
    from pipelines.config import TrainConfig
    from pipelines.data.registry import load_dataset
    from pipelines.engine.runner import train_engine

    cora = load_dataset("cora", data_dir)
    out = tmp_path_factory.mktemp("runs") / "cora-engine"
    out.mkdir()
    cfg = TrainConfig(model="gcn", epochs=4, patience=0, partitions=2, intervals=2, staleness=1,
                      tensor_workers=2, sync_warmup=0).resolved()
    train_engine(cfg, cora, out=out)
    return out


def _check_report(run_dir, min_size=(300, 200)):
    import matplotlib.image as mpimg

    rep = run_dir / "report"
    html = (rep / "index.html").read_text(encoding="utf-8")
    for name in PLOTS:
        png = rep / name
        assert png.is_file() and png.stat().st_size > 5_000, name
        img = mpimg.imread(png)
        h, w = img.shape[:2]
        assert w >= min_size[0] and h >= min_size[1], (name, img.shape)
        assert img[..., :3].std() > 0.01, f"{name} is blank"
        assert f'src="{name}"' in html, name
    # self-contained: no network resources, the summary table is on the page
    assert "http://" not in html and "https://" not in html and "<link" not in html
    assert "<table>" in html and "best val acc" in html and "<style>" in html
    return html, json.loads((rep / "report.json").read_text())


def test_engine_records_a_timeline(engine_run):
    spans = [json.loads(line) for line in (engine_run / "timeline.jsonl").read_text().splitlines()]
    lanes = {s["lane"] for s in spans}
    assert {"graph-server-0", "graph-server-1", "tensor-workers", "param-server"} <= lanes
    kinds = {s["kind"] for s in spans}
    assert {"GA", "GA_BWD", "SC", "SC_BWD", "AV", "AV_BWD", "WU", "WAIT"} <= kinds
    assert kinds & {"LAST", "LOSS"}
    assert all(0 <= s["t0"] <= s["t1"] for s in spans)
    assert {s["epoch"] for s in spans if s["kind"] == "WU"} == {0, 1, 2, 3}
    assert all(s["gate"] in {"ghosts", "ghost_grads", "weights", "local", "barrier"}
               for s in spans if s["kind"] == "WAIT")
    assert all(s["lane"] == "param-server" for s in spans if s["kind"] == "WU")
    assert all(s["lane"] == "tensor-workers" and s["partition"] in (0, 1) for s in spans if s["kind"] == "AV")
    summary = json.loads((engine_run / "summary.json").read_text())
    assert summary["timeline"]["spans"] == len(spans) and summary["timeline"]["dropped"] == 0
    rows = [json.loads(line) for line in (engine_run / "metrics.jsonl").read_text().splitlines()]
    assert all("interval_epoch_spread" in r for r in rows)


def test_report_renders_plots_and_html(engine_run, capsys):
    from pipelines.cli import main

    assert main(["report", str(engine_run)]) == 0
    out = capsys.readouterr().out
    assert "[cost (USD)]" in out and "report:" in out
    html, meta = _check_report(engine_run)
    assert meta["timeline"]["lanes"] == ["graph-server-0", "graph-server-1", "tensor-workers", "param-server"]
    assert meta["timeline"]["spans"] > 0 and meta["timeline"]["window"][1] == 3
    assert "graph server" in html.lower()


def test_report_of_a_whole_graph_run(tmp_path, capsys):
    from pipelines.cli import main

    out = tmp_path / "whole"
    assert main(["train", "--dataset", "synthetic:planted?nodes=300&classes=3&features=16", "--epochs", "5",
                 "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["report", str(out), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # --json output stays pure JSON
    _, meta = _check_report(out)
    assert meta["timeline"]["lanes"] == ["whole-graph trainer"]
    assert main(["report", str(out), "--no-plots"]) == 0


def test_span_log_is_bounded(tmp_path):
    log = SpanLog(max_epochs=2, max_spans=5, origin=10.0)
    for e in range(4):
        for i in range(3):
            log.add("graph-server-0", "GA", e, i, 10.0 + e + i / 10, 10.05 + e + i / 10)
    assert len(log.spans) == 5 and log.dropped == 7
    assert log.write(tmp_path / "t.jsonl") == 5
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows[0] == {"lane": "graph-server-0", "kind": "GA", "epoch": 0, "interval": 0, "t0": 0.0, "t1": 0.05}
    assert [r["t0"] for r in rows] == sorted(r["t0"] for r in rows)
