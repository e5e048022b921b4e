"""Faults a deployment sees, on a real 3-broker Kafka cluster behind a TCP fault proxy: the leader of the busiest
run topic killed with SIGKILL mid-epoch, a graph server's connections cut (shortly, then for longer than the
broker timeout), and `dorylus stream` under the same broker kill. Nothing is lost, nothing is applied twice, and
synchronous runs end with the weights of an undisturbed run."""
import collections
import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("kafka")
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition  # noqa: E402
from kafka.admin import ConfigResource, ConfigResourceType  # noqa: E402

from pipelines.config import TrainConfig  # noqa: E402
from pipelines.continuous.replay import dataset_slices, replay  # noqa: E402
from pipelines.continuous.stream import read_applied  # noqa: E402
from pipelines.data.registry import load_dataset  # noqa: E402
from pipelines.engine.runner import train_engine  # noqa: E402
from ops.params import flatten  # noqa: E402
from tests.support.kafka_runs import assert_exact_accounting, metrics_rows, rel, wait_rows  # noqa: E402

pytestmark = pytest.mark.kafka

EPOCHS = 4
START_MS = 1_700_000_000_000
SLICES = 4


#: the roles log kafka-python's warnings (leader changes, retries, coordinator moves), so that a run that fails
#: here says in its roles' last words what their clients saw
ROLE_ENV = {**os.environ, "DORYLUS_LOG_LEVEL": "kafka=WARNING,kafka.net.selector=ERROR"}


def _train_argv(bootstrap, out, data_dir, run_id, *extra):
    return [sys.executable, "-m", "pipelines.cli", "train", "--dataset", "cora", "--data-dir", str(data_dir),
            "--model", "gcn", "--partitions", "2", "--intervals", "4", "--staleness", "none", "--epochs",
            str(EPOCHS), "--patience", "0", "--transport", "kafka", "--bootstrap", bootstrap, "--spawn-local",
            "--run-id", run_id, "--out", str(out), "--quiet", *extra]


@pytest.fixture(scope="module")
def undisturbed(data_dir):
    """The same synchronous run on the in-memory engine: the numbers every Kafka run here must give (a Kafka
    run equals it, tests/test_kafka_equivalence.py)."""
    cora = load_dataset("cora", data_dir)
    cfg = TrainConfig(dataset="cora", data_dir=str(data_dir), model="gcn", partitions=2, intervals=4,
                      staleness=None, epochs=EPOCHS, patience=0).resolved()
    return train_engine(cfg, cora)


def _admin(cluster):
    return KafkaAdminClient(bootstrap_servers=cluster.bootstrap, client_id="test-admin")


def _leaders(cluster, topics) -> dict:
    """{(topic, partition): leader node} from the cluster's metadata."""
    admin = _admin(cluster)
    try:
        return {(d["name"], p["partition_index"]): p["leader_id"] for d in admin.describe_topics(topics)
                for p in d["partitions"]}
    finally:
        admin.close()


def _busiest_partition(cluster, prefix) -> tuple[str, int, int]:
    """(topic, partition, messages) of the run's partition with the most messages so far."""
    c = KafkaConsumer(bootstrap_servers=cluster.bootstrap)
    try:
        tps = [TopicPartition(t, p) for t in c.topics() if t.startswith(prefix)
               for p in c.partitions_for_topic(t)]
        end = c.end_offsets(tps)
    finally:
        c.close()
    tp = max(tps, key=lambda tp: end[tp])
    return tp.topic, tp.partition, end[tp]


def _kill_leader_of_busiest(cluster, prefix) -> tuple[int, str]:
    topic, part, n = _busiest_partition(cluster, prefix)
    assert n > 0
    leader = _leaders(cluster, [topic])[(topic, part)]
    cluster.kill(leader)
    return leader, topic


def _partition_state(cluster, prefix) -> str:
    """The run's partitions as the cluster sees them after a failure: leader and in-sync replicas."""
    try:
        c = KafkaConsumer(bootstrap_servers=cluster.bootstrap)
        try:
            topics = sorted(t for t in c.topics() if t.startswith(prefix))
        finally:
            c.close()
        rows = [f"{d['name'][len(prefix):]}[{p['partition_index']}] leader {p['leader_id']} isr {p['isr_nodes']}"
                for d in _admin_describe(cluster, topics) for p in d["partitions"]]
        return "\npartitions: " + "; ".join(rows)
    except Exception as e:  # the diagnosis must not hide the failure
        return f"\npartitions: unknown ({e})"


def _admin_describe(cluster, topics) -> list:
    admin = _admin(cluster)
    try:
        return admin.describe_topics(topics)
    finally:
        admin.close()


def _check_replicated(cluster, topic) -> None:
    admin = _admin(cluster)
    try:
        parts = admin.describe_topics([topic])[0]["partitions"]
        cfg = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        admin.close()
    assert all(len(p["replica_nodes"]) == 3 for p in parts), parts
    assert cfg["topic"][topic]["min.insync.replicas"]["value"] == "2"


def _check_weights(out, undisturbed) -> None:
    l1 = np.array([r["loss"] for r in undisturbed.history])
    l2 = np.array([r["loss"] for r in metrics_rows(out)])
    assert np.max(np.abs(l1 - l2) / np.abs(l1)) < 1e-4
    with np.load(out / "weights.npz") as z:
        for k, w in flatten(undisturbed.best_params).items():
            assert rel(w, z[k]) < 1e-4, k
    with np.load(out / "ckpt" / f"param-server-{EPOCHS:06d}.npz") as z:
        for k, w in flatten(undisturbed.params).items():
            assert rel(w, z[f"params/{k}"]) < 1e-4, k


def _finish(proc, timeout=600):
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err


def _summary(out):
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["epochs"] == EPOCHS
    assert_exact_accounting(s)
    assert s["transport"]["channels"]["tensor/0"]["produced"] >= 4 * 3 * EPOCHS
    return s


def test_leader_of_the_busiest_topic_killed_mid_epoch(kafka_cluster, data_dir, tmp_path, undisturbed):
    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    proc = subprocess.Popen(_train_argv(kafka_cluster.bootstrap_via("roles"), out, data_dir, run_id),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ROLE_ENV)
    killed = None
    try:
        wait_rows(out, 2, proc)
        killed, topic = _kill_leader_of_busiest(kafka_cluster, f"dorylus.{run_id}.")
        err = _finish(proc)
        assert proc.returncode == 0, err[-3000:] + _partition_state(kafka_cluster, f"dorylus.{run_id}.")
        _check_replicated(kafka_cluster, topic)
        assert killed not in set(_leaders(kafka_cluster, [topic]).values())  # leadership moved
    finally:
        if killed is not None:
            kafka_cluster.start_node(killed)
    _summary(out)
    _check_weights(out, undisturbed)


def test_stream_under_a_broker_kill_applies_every_event_once(kafka_cluster, data_dir, tmp_path):
    cora = load_dataset("cora", data_dir)
    topic = f"cora-kill-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "stream"
    boot = kafka_cluster.bootstrap_via("roles")
    first = replay(cora, boot, topic, slices=SLICES, slice_s=1.0, start_ms=START_MS, last_slice=1)
    _check_replicated(kafka_cluster, topic)
    cmd = [sys.executable, "-m", "pipelines.cli", "stream", "--bootstrap", boot, "--events", topic, "--out",
           str(out), "--models-topic", f"models-{uuid.uuid4().hex[:8]}", "--round-interval", "1",
           "--until-idle", "20", "--num-classes", "7", "--epochs", "10", "--round-epochs", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the stream made no progress"
            time.sleep(0.2)
        # round 1 is done and the stream waits for the next slice's events: they go out through the failover
        # (the idle clock, 20 s, outlasts it: a crashed broker is fenced after 6 s)
        killed, _ = _kill_leader_of_busiest(kafka_cluster, topic)
        rest = replay(cora, boot, topic, slices=SLICES, slice_s=1.0, start_ms=START_MS, first_slice=2)
        err = _finish(proc)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if killed is not None:
            kafka_cluster.start_node(killed)
    produced = [i for s in dataset_slices(cora, SLICES, START_MS, 1000, prefix="cora")
                for i in s.events.column("event_id").to_pylist()]
    assert first["events"] + rest["events"] == len(produced) == len(set(produced))
    counts = collections.Counter(read_applied(out).column("event_id").to_pylist())
    assert set(counts) == set(produced) and max(counts.values()) == 1
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["counters"]["applied"] == len(produced)
    assert s["counters"]["dead_letters"] == 0


def test_graph_server_cut_off_for_10s_loses_nothing(kafka_cluster, data_dir, tmp_path, undisturbed):
    run_id = f"cut-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    proxy = kafka_cluster.proxy
    before = {n: l["dropped"] for n, l in proxy.status().items()}
    argv = _train_argv(kafka_cluster.bootstrap_via("roles"), out, data_dir, run_id, "--role-bootstrap",
                       f"graph-server-0={kafka_cluster.bootstrap_via('isolated')}")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_rows(out, 2, proc)
        proxy.cut("isolated-*", 10.0)
        err = _finish(proc)
    finally:
        proxy.restore("isolated-*")
    assert proc.returncode == 0, err[-3000:]
    after = proxy.status()
    # graph-server-0 (and only it) used the isolated path, and the cut closed its connections
    assert sum(after[n]["dropped"] - before[n] for n in after if n.startswith("isolated-")) > 0
    assert sum(after[n]["dropped"] - before[n] for n in after if n.startswith("roles-")) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["role_bootstrap"] == {"graph-server-0": kafka_cluster.bootstrap_via("isolated")}
    _summary(out)
    _check_weights(out, undisturbed)


def test_graph_server_cut_off_past_the_broker_timeout_fails_the_run_in_one_line(kafka_cluster, data_dir,
                                                                                 tmp_path):
    run_id = f"cutlong-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    proxy = kafka_cluster.proxy
    argv = _train_argv(kafka_cluster.bootstrap_via("roles"), out, data_dir, run_id, "--broker-timeout", "6",
                       "--role-bootstrap", f"graph-server-0={kafka_cluster.bootstrap_via('isolated')}")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_rows(out, 1, proc)
        proxy.cut("isolated-*")  # until the run has failed
        err = _finish(proc, timeout=300)
    finally:
        proxy.restore("isolated-*")
    assert proc.returncode == 1, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert line.startswith("dorylus: error: graph-server-0 ") and "lost the Kafka brokers" in line, line
    assert line.endswith(f"dorylus train --resume {out}"), line
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert not (out / "summary.json").exists()
