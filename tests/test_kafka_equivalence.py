"""Kafka with one process per role gives what the in-memory engine gives; any Arrow reader can read its topics."""
import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

pytest.importorskip("kafka")

from pipelines.config import build_config, load_toml  # noqa: E402
from pipelines.data.registry import load_dataset  # noqa: E402
from pipelines.engine.runner import train_engine  # noqa: E402
from ops.params import flatten  # noqa: E402
from tests.support.kafka_runs import assert_exact_accounting, rel  # noqa: E402

pytestmark = pytest.mark.kafka

EPOCHS = 12


def kafka_train(bootstrap: str, out, data_dir, staleness: str, run_id: str, epochs: int = EPOCHS,
                extra=(), timeout: float = 600) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pipelines.cli", "train", "--dataset", "cora", "--data-dir", str(data_dir),
            "--model", "gcn", "--partitions", "2", "--intervals", "4", "--staleness", staleness,
            "--sync-warmup", "0", "--epochs", str(epochs), "--patience", "0", "--transport", "kafka", "--bootstrap", bootstrap,
            "--spawn-local", "--run-id", run_id, "--out", str(out), "--quiet", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cora(data_dir):
    return load_dataset("cora", data_dir)


def test_synchronous_kafka_processes_equal_the_memory_engine(kafka_bootstrap, data_dir, cora, tmp_path):
    run_id = f"eq-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    proc = kafka_train(kafka_bootstrap, out, data_dir, "none", run_id)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["epochs"] == EPOCHS and s["partitions"] == 2
    pids = {r: f["pid"] for r, f in s["roles"].items()}
    assert sorted(pids) == ["graph-server-0", "graph-server-1", "param-server", "tensor-worker-0"]
    assert len(set(pids.values())) == 4 and os.getpid() not in pids.values()  # one OS process per role
    assert_exact_accounting(s)
    assert s["dead_letters"] == 0

    cfg = build_config(load_toml(out / "config.toml"), {"transport": "memory"})
    mem = train_engine(cfg, cora)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    l1 = np.array([r["loss"] for r in mem.history])
    l2 = np.array([r["loss"] for r in rows])
    assert np.max(np.abs(l1 - l2) / np.abs(l1)) < 1e-4
    assert s["best_epoch"] == mem.summary["best_epoch"] and s["test_acc"] == pytest.approx(mem.summary["test_acc"])
    # one timeline from the processes' spans: every role's lane, on the driver's clock origin
    spans = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert s["timeline"]["spans"] == len(spans) > 0
    assert {r["lane"] for r in spans} == {"graph-server-0", "graph-server-1", "param-server", "tensor-workers"}
    assert all(0 <= r["t0"] <= r["t1"] <= s["seconds"] for r in spans)
    assert {r["kind"] for r in spans} >= {"GA", "SC", "WU", "WAIT"} and "spans" not in s["roles"]["param-server"]
    # priced like the memory engine: every tensor task billed as a Lambda invocation, two graph servers; the
    # tasks are the memory run's, give or take straggler relaunches (timing-dependent in both runs)
    c, cm = s["cost"], mem.summary["cost"]
    assert c["mode"] == cm["mode"] and c["usage"]["graph_servers"] == 2 and s["cost_usd"] > 0
    assert c["usage"]["lambda_invocations"] == s["tensor_tasks"]
    # relaunches of tasks already answered are skipped, not run: only the others are extra invocations
    base = cm["usage"]["lambda_invocations"] - (mem.summary["relaunches"] - mem.summary["duplicates_skipped"])
    assert 0 < base <= s["tensor_tasks"] <= base + s["relaunches"]
    with np.load(out / "weights.npz") as z:
        for k, w in flatten(mem.best_params).items():
            assert rel(w, z[k]) < 1e-4, k
    with np.load(out / "ckpt" / f"param-server-{EPOCHS:06d}.npz") as z:  # the parameter server's final weights
        for k, w in flatten(mem.params).items():
            assert rel(w, z[f"params/{k}"]) < 1e-4, k

    # Interop: a plain kafka-python consumer, importing nothing of this project, decodes every value of every
    # topic of the run with pyarrow.ipc alone.
    script = textwrap.dedent(f"""
        import json, sys
        import pyarrow as pa
        from kafka import KafkaConsumer, TopicPartition
        c = KafkaConsumer(bootstrap_servers={kafka_bootstrap!r}, enable_auto_commit=False)
        topics = sorted(t for t in c.topics() if t.startswith("dorylus.{run_id}."))
        counts, types = {{}}, {{}}
        for topic in topics:
            tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic))]
            end = c.end_offsets(tps)
            c.assign(tps)
            c.seek_to_beginning(*tps)
            n = 0
            while any(c.position(tp) < end[tp] for tp in tps):
                for tp, recs in c.poll(1000).items():
                    for r in recs:
                        table = pa.ipc.open_stream(r.value).read_all()
                        types.setdefault(topic, set()).add(table.schema.metadata[b"dorylus.type"].decode())
                        n += 1
            counts[topic] = n
        assert not [m for m in sys.modules if m.split(".")[0] in ("pipelines", "schemas", "ops")]
        print(json.dumps({{"counts": counts, "types": {{k: sorted(v) for k, v in types.items()}}}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    res = json.loads(got.stdout)
    prefix = f"dorylus.{run_id}."
    for kind, n in s["transport"]["messages"].items():
        assert res["counts"][prefix + kind] == n, kind
    assert res["types"][prefix + "ghosts"] == ["vertex_block"]
    assert res["types"][prefix + "ghosts.grad"] == ["vertex_block"]
    assert res["types"][prefix + "watermarks"] == ["watermark"]
    assert res["types"][prefix + "weights"] == ["weights"] and res["types"][prefix + "grads"] == ["gradients"]
    assert res["types"][prefix + "tensor"] == ["tensor_batch"]


def test_bounded_staleness_over_kafka_lands_in_the_memory_engines_band(kafka_bootstrap, data_dir, cora,
                                                                        tmp_path):
    out = tmp_path / "run"
    proc = kafka_train(kafka_bootstrap, out, data_dir, "1", f"s1-{uuid.uuid4().hex[:8]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["max_staleness_observed"] == 1
    assert_exact_accounting(s)
    cfg = build_config(load_toml(out / "config.toml"), {"transport": "memory"})
    mem = train_engine(cfg, cora)
    assert abs(s["test_acc"] - mem.summary["test_acc"]) <= 0.02, (s["test_acc"], mem.summary["test_acc"])
    assert abs(s["best_val_acc"] - mem.summary["best_val_acc"]) <= 0.02


def test_a_bfloat16_wire_over_kafka_equals_the_memory_engine_with_it(kafka_bootstrap, data_dir, cora, tmp_path):
    # the narrowing is the transports' wrapper, not the codec's: both transports round the same values
    out = tmp_path / "run"
    proc = kafka_train(kafka_bootstrap, out, data_dir, "none", f"bf-{uuid.uuid4().hex[:8]}", epochs=6,
                       extra=("--wire-dtype", "bfloat16"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert_exact_accounting(s)
    w = s["wire"]
    assert w["wire_dtype"] == "bfloat16" and w["ratio_to_minimum"] <= 1.3
    # ghost rows: two bytes a value and their int64 ids
    assert w["minimum_bytes_per_epoch"]["ghosts"] <= w["bytes_per_epoch"]["ghosts"] \
        <= 1.5 * w["minimum_bytes_per_epoch"]["ghosts"]
    cfg = build_config(load_toml(out / "config.toml"), {"transport": "memory"})
    assert cfg.wire_dtype == "bfloat16"
    mem = train_engine(cfg, cora)
    l1 = np.array([r["loss"] for r in mem.history])
    l2 = np.array([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert np.max(np.abs(l1 - l2) / np.abs(l1)) < 1e-4
    assert s["test_acc"] == pytest.approx(mem.summary["test_acc"])
