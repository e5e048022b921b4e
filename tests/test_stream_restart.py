"""Exactly once across crashes: `dorylus stream` is killed with SIGKILL mid-stream twice, then restarted. First
after a checkpoint and after it has read events the checkpoint does not cover (DORYLUS_FAULT_KILL_AFTER_ROUND
makes it kill itself right there, so the crash lands in that window every time); then inside an incremental
checkpoint, after the delta file of a round is written and before the manifest commits it
(DORYLUS_FAULT_KILL_IN_CHECKPOINT). Every produced event is applied exactly once (re-sent duplicates are dropped),
the final graph is the dataset, and the accuracy is in the batch band."""
import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from pipelines.config import TrainConfig
from pipelines.continuous import checkpoint as ckpt
from pipelines.continuous.replay import dataset_slices, replay
from pipelines.continuous.state import StreamGraph
from pipelines.continuous.stream import read_applied

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[1]
START_MS = 1_700_000_000_000


def _ckpt_meta(out: Path) -> dict | None:
    man = ckpt.read_manifest(out)
    return None if man is None else man["meta"]


def _wait(cond, timeout_s: float, what: str, proc=None, log=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"stream exited early ({proc.returncode}) waiting for {what}:\n"
                                 + (log.read_text() if log else ""))
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{log.read_text()}" if log else ""))


def test_sigkill_mid_stream_then_restart_applies_every_event_once(kafka_bootstrap, data_dir, tmp_path):
    from pipelines.data.registry import load_dataset
    from pipelines.train import train

    cora = load_dataset("cora", data_dir)
    topic = f"cora-crash-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    log = tmp_path / "stream.log"
    cmd = [sys.executable, "-m", "pipelines.cli", "stream", "--bootstrap", kafka_bootstrap, "--events", topic,
           "--out", str(out), "--models-topic", f"models-{uuid.uuid4().hex[:8]}", "--round-interval", "1",
           "--until-idle", "3", "--num-classes", "7", "--epochs", "100", "--round-epochs", "50",
           "--full-checkpoint-every", "3"]  # a base at rounds 1, 4, 7, 10; deltas between
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    first = replay(cora, kafka_bootstrap, topic, slices=10, slice_s=1.0, start_ms=START_MS, last_slice=4)
    with open(log, "w") as f:  # the stream kills itself once it has read past a checkpoint of round >= 2
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "DORYLUS_FAULT_KILL_AFTER_ROUND": "2"}, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        _wait(lambda: (_ckpt_meta(out) or {}).get("round", 0) >= 2, 240, "a checkpoint of round 2", proc, log)
        rest = replay(cora, kafka_bootstrap, topic, slices=10, slice_s=1.0, start_ms=START_MS, first_slice=5)
        again = replay(cora, kafka_bootstrap, topic, slices=10, slice_s=1.0, start_ms=START_MS, first_slice=3,
                       last_slice=3)  # a producer retrying a slice: the same event ids again
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    at_kill = _ckpt_meta(out)
    total_messages = first["messages"] + rest["messages"] + again["messages"]
    assert sum(at_kill["positions"].values()) < total_messages  # the restart must read events again
    assert at_kill["round"] < 10

    # killed again inside the delta checkpoint of round 6 (round 4 wrote a base, 5 a delta): round 6's events are
    # journalled and in an uncommitted delta file when it dies
    with open(log, "a") as f:
        f.write("---- restart, to be killed in a checkpoint ----\n")
        f.flush()
        r = subprocess.run(cmd, cwd=REPO, env={**env, "DORYLUS_FAULT_KILL_IN_CHECKPOINT": "6"}, stdout=f,
                           stderr=subprocess.STDOUT, timeout=600)
    assert r.returncode == -signal.SIGKILL, log.read_text()
    man = ckpt.read_manifest(out)
    assert man["meta"]["round"] == 5 and [c.split(".")[1] for c in man["chain"]] == ["base", "delta"], man
    orphans = [f.name for f in (out / ckpt.DIR).glob("*.npz") if f.name not in man["chain"]]
    assert len(orphans) == 1 and orphans[0].endswith(".delta.npz") and (out / "applied/round-000006.arrow").exists()

    with open(log, "a") as f:
        f.write("---- restart ----\n")
        f.flush()
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert r.returncode == 0, log.read_text()

    produced = dataset_slices(cora, 10, START_MS, 1000, prefix="cora")
    produced_ids = [i for s in produced for i in s.events.column("event_id").to_pylist()]
    applied = read_applied(out)
    counts = collections.Counter(applied.column("event_id").to_pylist())
    assert set(counts) == set(produced_ids) and len(produced_ids) == len(set(produced_ids))
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1][:5]
    assert set(applied.column("outcome").to_pylist()) == {"applied"}
    summary = json.loads((out / "summary.json").read_text())
    c = summary["counters"]
    assert summary["status"] == "complete" and summary["rounds"] == 10
    assert c["applied"] == len(produced_ids) and c["duplicates"] == produced[3].events.num_rows
    assert c["dead_letters"] == 0 and c["noop"] == 0

    state = ckpt.load(out)
    g = StreamGraph.from_arrays(state["graph"], 1)
    for t in state["deltas"]:  # the base and the deltas of the rounds since it
        g.apply_table(t, 7)
    g, ids = g.materialize("cora", 7)
    assert np.array_equal(ids, np.arange(cora.num_nodes)) and (g.adj != cora.adj).nnz == 0
    assert np.array_equal(g.labels, cora.labels) and np.array_equal(g.features, cora.features)
    assert np.array_equal(g.test_mask, cora.test_mask) and np.array_equal(g.train_mask, cora.train_mask)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r_["round"] for r_ in rows] == list(range(1, 11))  # each round once in the log, none lost
    batch = train(TrainConfig(dataset="cora").resolved(), cora).summary["test_acc"]
    print(f"after SIGKILL + restart: final test acc {rows[-1]['test_acc']:.4f} vs batch {batch:.4f}")
    assert abs(rows[-1]["test_acc"] - batch) <= 0.015
