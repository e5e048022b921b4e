"""Kafka training runs for the fault and resume tests: the `dorylus train` command line of a 2-partition Cora run
with one process per role, and its metrics.jsonl rows as they appear. The memory-engine run with the same
settings (the numbers a Kafka run must give) is the ``uninterrupted_cora_run`` fixture of tests/conftest.py."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

EPOCHS = 10


def train_argv(bootstrap, out, data_dir, run_id) -> list[str]:
    """`dorylus train` over Kafka, every role a local process: GCN on Cora, 2 partitions x 4 intervals,
    synchronous, EPOCHS epochs without early stopping."""
    return [sys.executable, "-m", "pipelines.cli", "train", "--dataset", "cora", "--data-dir", str(data_dir),
            "--model", "gcn", "--partitions", "2", "--intervals", "4", "--staleness", "none", "--epochs",
            str(EPOCHS), "--patience", "0", "--transport", "kafka", "--bootstrap", bootstrap, "--spawn-local",
            "--run-id", run_id, "--out", str(out), "--quiet"]


def metrics_rows(out) -> list[dict]:
    """The rows of ``out/metrics.jsonl`` written so far."""
    path = out / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def logs_tail(out, lines: int = 40) -> str:
    """The last lines of every role's log of the run in ``out`` (for a failing assertion's message)."""
    parts = []
    for log in sorted((out / "logs").glob("*.log")):
        parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(parts)


def wait_rows(out, n, proc, timeout=480) -> None:
    """Wait until the run in ``proc`` has written ``n`` epochs (it must stay alive and make progress)."""
    deadline = time.monotonic() + timeout
    while len(metrics_rows(out)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)


def rel(a, b) -> float:
    """max |a - b| relative to max |a|."""
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-12))


def assert_exact_accounting(summary: dict) -> None:
    """Every channel's messages were consumed exactly as often as produced, by every group; none unacknowledged."""
    tr = summary["transport"]
    assert tr["unacknowledged"] == 0 and not tr["failed_deliveries"]
    for ch, v in tr["channels"].items():
        assert v["consumed"], ch
        for group, n in v["consumed"].items():
            assert n == v["produced"], (ch, group, n, v["produced"])
