"""Faults of a Kafka run with one process per role: a broker restart mid-run and bad messages on its topics.

The run and its reference are shared with tests/test_kafka_resume.py (tests/support/kafka_runs.py, conftest)."""
import json
import subprocess
import uuid

import numpy as np
import pytest

pytest.importorskip("kafka")
import pyarrow as pa  # noqa: E402
from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # noqa: E402

from pipelines.transports.kafka import KafkaTransport, topic_name  # noqa: E402
from tests.support.kafka_runs import EPOCHS, metrics_rows, train_argv, wait_rows  # noqa: E402

pytestmark = pytest.mark.kafka


def test_broker_restart_and_bad_messages_lose_nothing(kafka_bootstrap, kafka_broker, data_dir, tmp_path,
                                                      uninterrupted_cora_run):
    uninterrupted = uninterrupted_cora_run
    run_id = f"fault-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    # Bad values already wait on two channels when the run starts: corrupt bytes, and Arrow of a foreign schema.
    KafkaTransport(kafka_bootstrap, run_id, 2).close()  # creates the run's topics
    raw = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    raw.send(topic_name(run_id, "ghosts"), b"\xde\xad\xbe\xef corrupt", partition=0)
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([pa.array(["hello"])], names=["greeting"])
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    raw.send(topic_name(run_id, "tensor.out"), sink.getvalue().to_pybytes(), partition=1)
    raw.flush()
    raw.close()

    proc = subprocess.Popen(train_argv(kafka_bootstrap, out, data_dir, run_id), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_rows(out, 3, proc)
        kafka_broker.restart()  # stop (data kept) and start again, mid-run
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["epochs"] == EPOCHS
    tr = s["transport"]
    assert tr["unacknowledged"] == 0 and not tr["failed_deliveries"]
    for ch, v in tr["channels"].items():  # per channel: every message produced was consumed, once per group
        for group, n in v["consumed"].items():
            assert n == v["produced"], (ch, group, n, v["produced"])
    assert tr["channels"]["tensor/0"]["produced"] >= 4 * 3 * EPOCHS  # the data channels really were used
    # The bad values went to the dead-letter topic, were counted, and changed nothing.
    assert s["dead_letters"] == 2 and tr["dead_letters"] == {"ghosts/0": 1, "tensor.out/1": 1}
    assert metrics_rows(out)[-1]["dead_letters"] == 2
    dl = KafkaConsumer(bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=10000)
    dl.assign([TopicPartition(topic_name(run_id, "dead-letter"), 0)])
    recs = [r for _, r in zip(range(2), dl)]
    dl.close()
    reasons = sorted(dict(r.headers)["dorylus.error"].decode() for r in recs)
    assert "not an Arrow IPC stream" in " ".join(reasons) and "schema version" in " ".join(reasons)
    logs = "".join(p.read_text() for p in (out / "logs").glob("graph-server-*.log"))
    assert logs.count("dead letter") == 2  # each one logged by the role that met it
    # A synchronous run is deterministic: the outage changed no number.
    l1 = np.array([r["loss"] for r in uninterrupted.history])
    l2 = np.array([r["loss"] for r in metrics_rows(out)])
    assert np.max(np.abs(l1 - l2) / np.abs(l1)) < 1e-4
    assert s["test_acc"] == pytest.approx(uninterrupted.summary["test_acc"])
