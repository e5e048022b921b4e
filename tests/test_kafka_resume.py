"""A graph-server process killed with SIGKILL mid-run: the driver fails with one line and takes the other roles
down; `dorylus train --resume` restarts every role from the checkpoints and the run ends where it would have."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("kafka")

from tests.support.kafka_runs import EPOCHS, logs_tail, metrics_rows, train_argv, wait_rows  # noqa: E402

pytestmark = pytest.mark.kafka


def test_a_killed_graph_server_is_resumed_from_checkpoints(kafka_bootstrap, data_dir, tmp_path,
                                                           uninterrupted_cora_run):
    uninterrupted = uninterrupted_cora_run
    out = tmp_path / "run"
    proc = subprocess.Popen(train_argv(kafka_bootstrap, out, data_dir, f"kill-{uuid.uuid4().hex[:8]}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_rows(out, 3, proc)
        pids = json.loads((out / "run.json").read_text())["pids"]
        os.kill(pids["graph-server-1"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "graph-server-1" in lines[0] and "SIGKILL" in lines[0], err[-2000:]
    for role, pid in pids.items():  # the driver took the other roles down with it
        with pytest.raises(ProcessLookupError):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.2)
            os.kill(pid, 0)
    assert not (out / "summary.json").exists()
    assert json.loads((out / "run.json").read_text())["status"] == "failed"

    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", "--resume", str(out), "--quiet"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:] + "\n" + logs_tail(out)
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["epochs"] == EPOCHS and s["incarnation"] == 1
    assert 1 <= s["resumed_from_epoch"] < EPOCHS
    assert [r["epoch"] for r in metrics_rows(out)] == list(range(EPOCHS))  # each epoch once
    assert s["topic_run_id"].endswith("-r1")
    assert abs(s["test_acc"] - uninterrupted.summary["test_acc"]) <= 0.005
    assert s["best_val_acc"] == pytest.approx(uninterrupted.summary["best_val_acc"])
