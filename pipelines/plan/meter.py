"""The CPU of a local run's graph-server loop passes that do no task work, measured on the engine's threads."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from pipelines.engine.graph_server import GraphServer

#: Where a metered run records it (read back by `calibrate.calibrate` as the run's `poll_s`).
LOOP_FILE = "loop.json"


class LoopMeter:
    """While in effect, every graph server of a local engine run counts its loop passes (one `_check_stragglers`
    per pass) and splits its thread's CPU into task work (`handle`, a `_try_step` that fired) and the rest:
    polling the channels, walking intervals whose step cannot fire, checking stragglers. With several graph
    servers waiting on the tensor workers each polls every 2 ms and every pass takes the GIL, so that rest is
    work on the process's one core (`Costs.poll_s`); an epoch-time fit cannot tell it from the other overheads
    (a run with few graph servers barely shows it), the thread's own clock can.

    It wraps the engine's methods (restored on exit), so use it around a calibration run, not a production one.
    """

    def __init__(self):
        self._orig = {}
        self._lock = threading.Lock()
        self.passes = 0
        self.total_cpu = 0.0
        self.work_cpu = 0.0
        self._depth = threading.local()

    def _timed(self, name: str, counts_as_work):
        orig = self._orig[name]
        meter = self

        def wrapped(gs, *args, **kwargs):
            depth = getattr(meter._depth, "n", 0)
            if depth:   # nested inside another metered call: the outer one times it
                return orig(gs, *args, **kwargs)
            meter._depth.n = 1
            c0 = time.thread_time()
            try:
                out = orig(gs, *args, **kwargs)
            finally:
                meter._depth.n = 0
            if counts_as_work(out):
                with meter._lock:
                    meter.work_cpu += time.thread_time() - c0
            return out
        return wrapped

    def __enter__(self):
        for name in ("run", "handle", "_try_step", "_check_stragglers"):
            self._orig[name] = getattr(GraphServer, name)
        orig_run, orig_check = self._orig["run"], self._orig["_check_stragglers"]
        meter = self

        def run(gs):
            c0 = time.thread_time()
            try:
                orig_run(gs)
            finally:
                with meter._lock:
                    meter.total_cpu += time.thread_time() - c0

        def check(gs):
            with meter._lock:
                meter.passes += 1
            return orig_check(gs)

        GraphServer.run = run
        GraphServer._check_stragglers = check
        GraphServer.handle = self._timed("handle", lambda out: True)
        GraphServer._try_step = self._timed("_try_step", bool)
        return self

    def __exit__(self, *exc):
        for name, f in self._orig.items():
            setattr(GraphServer, name, f)

    @property
    def poll_s(self) -> float:
        """CPU seconds of one loop pass outside task work."""
        return max(self.total_cpu - self.work_cpu, 0.0) / self.passes if self.passes else 0.0

    def write(self, run_dir: str | Path) -> dict:
        rec = {"poll_s": self.poll_s, "passes": self.passes, "total_cpu_s": self.total_cpu,
               "work_cpu_s": self.work_cpu}
        (Path(run_dir) / LOOP_FILE).write_text(json.dumps(rec))
        return rec


def measured_poll_s(run_dirs) -> float | None:
    """The median `poll_s` the metered runs among these (with more than one graph server) recorded, or None."""
    import numpy as np

    got = []
    for d in run_dirs:
        f = Path(d) / LOOP_FILE
        cfg = Path(d) / "summary.json"
        if not f.is_file():
            continue
        if cfg.is_file() and json.loads(cfg.read_text()).get("partition_stats", {}).get("partitions", 2) < 2:
            continue   # one graph server polls only while its task computes: its passes are not the cost here
        got.append(float(json.loads(f.read_text())["poll_s"]))
    return float(np.median(got)) if got else None

