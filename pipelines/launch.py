"""Kafka runs with one process per role: the command lines of the roles, a local launcher, and the driver.

``dorylus train --transport kafka --bootstrap HOST:PORT --spawn-local`` is `train_kafka`: the train process is
the driver (it gathers METRICS and WEIGHTS, evaluates every epoch, writes metrics.jsonl, weights.npz and
summary.json), and `role_commands` are the processes it launches on this machine (without ``--spawn-local`` the
roles run elsewhere, e.g. on the machines `pipelines.deploy` starts, with the same command lines).

Run directory additions: ``run.json`` (run id, incarnation, the topics' run id, bootstrap, roles, status),
``logs/<role>.log`` (each role's stdout and stderr), ``ckpt/`` (the roles' checkpoints, see `pipelines.roles`).

Resume (``dorylus train --resume RUN_DIR``): every role restarts from the newest parameter-server checkpoint v
that the driver's metrics reach (weights and optimizer state of version v); graph servers start at epoch v with
fresh stores (epoch v counts as epoch 0 for staleness), metrics.jsonl keeps epochs < v, early stopping is
replayed from it. The new incarnation n uses fresh topics (run id ``<run>-r<n>``), so nothing in flight from the
failed incarnation can reach it; with ``--staleness none`` a resumed run ends exactly where an uninterrupted one
does.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from pipelines import rundir
from pipelines.config import ConfigError, TrainConfig, build_config, load_toml
from pipelines.engine import messages as M
from pipelines.engine.messages import EngineError, Message
from pipelines.roles import RoleFailed, ps_checkpoints

FINAL_TIMEOUT_S = 120.0


def make_run_id(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:40] or "run"
    return f"{base}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def topic_run_id(run_id: str, incarnation: int) -> str:
    """The run id in topic names: the run's own for its first incarnation, ``<run>-r<n>`` after n resumes."""
    return run_id if incarnation == 0 else f"{run_id}-r{incarnation}"


def role_commands(config_path: str | Path, bootstrap: str, run_id: str, *, out: str | Path,
                  partitions: int | None = None, workers: int = 1, start_epoch: int = 0,
                  owner_pid: int | None = None, entry: list[str] | None = None) -> dict[str, list[str]]:
    """The command line (argv) of every role process of a run, by role name.

    entry: how to invoke the CLI (default: this Python, ``-m pipelines.cli``; ``["dorylus"]`` where installed).
    run_id: the run id the topics are named with (`topic_run_id` of a resumed run). partitions: graph servers
    (default: the config's). workers: tensor-worker processes. start_epoch: resume point (see module doc).
    """
    if partitions is None:
        partitions = build_config(load_toml(config_path), {}).partitions
    entry = list(entry or [sys.executable, "-m", "pipelines.cli"])
    common = ["--config", str(config_path), "--bootstrap", bootstrap, "--run-id", run_id, "--out", str(out)]
    if start_epoch:
        common += ["--start-epoch", str(start_epoch)]
    if owner_pid:
        common += ["--owner-pid", str(owner_pid)]
    cmds = {"param-server": entry + ["param-server", *common]}
    for p in range(partitions):
        cmds[f"graph-server-{p}"] = entry + ["graph-server", "--partition", str(p), *common]
    for k in range(workers):
        cmds[f"tensor-worker-{k}"] = entry + ["tensor-worker", "--worker-id", str(k), "--workers", str(workers),
                                              *common]
    return cmds


class LocalLauncher:
    """The role processes of one run on this machine; logs in <out>/logs/<role>.log."""

    def __init__(self, commands: dict[str, list[str]], log_dir: Path):
        self.commands = commands
        self.log_dir = Path(log_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.finished: set[str] = set()   # roles allowed to exit (they sent FINAL)

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if "JAX_COMPILATION_CACHE_DIR" not in env:
            # The roles compile the same kernels: a shared persistent cache makes every start after the first
            # fast (same executables, so the same numbers).
            cache = Path(os.environ.get("DORYLUS_CACHE") or Path.home() / ".cache" / "dorylus") / "jax"
            cache.mkdir(parents=True, exist_ok=True)
            env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        for role, argv in self.commands.items():
            log = open(self.log_dir / f"{role}.log", "ab")
            log.write(f"\n==== {datetime.datetime.now().isoformat()} {' '.join(argv)}\n".encode())
            log.flush()
            self.procs[role] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                stdin=subprocess.DEVNULL)
            log.close()

    def pids(self) -> dict[str, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def check(self) -> None:
        """Raise RoleFailed when a role exited that should still run (or exited with an error)."""
        for role, p in self.procs.items():
            rc = p.poll()
            if rc is None:
                continue
            if rc == 0 and role in self.finished:
                continue
            log = self.log_dir / f"{role}.log"
            detail = f": {_last_line(log)}" if rc > 0 else ""
            raise RoleFailed(f"{role} {_exit_text(rc)} (log: {log}{detail}); continue the run with "
                             f"dorylus train --resume {self.log_dir.parent}")

    def wait(self, timeout_s: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {r: p.poll() for r, p in self.procs.items()}

    def terminate(self, grace_s: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines and not lines[-1].startswith("==== ") else "no output"


# ------------------------------------------------------------------------------------------------ run state
def read_run_info(out: Path) -> dict:
    path = Path(out) / "run.json"
    if not path.is_file():
        raise ConfigError(f"{out} has no run.json: not a Kafka run directory (only Kafka runs resume)")
    return json.loads(path.read_text())


def _resume_point(out: Path, history: list[dict]) -> int:
    """The newest parameter-server checkpoint the driver's metrics reach (rows of every earlier epoch)."""
    reach = (history[-1]["epoch"] + 1) if history else 0
    have = [v for v in ps_checkpoints(out) if v <= reach]
    return max(have) if have else 0


def _contiguous(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r.get("epoch") != len(out):
            break
        out.append(r)
    return out


# ------------------------------------------------------------------------------------------------ the driver
class _PoolsReport:
    """The tensor-worker processes' pool statistics as one pool's `stats()`, for the cost meter."""

    _SUMMED = ("tasks", "invocations", "billed_ms", "s3_puts", "s3_gets", "bytes_sent", "bytes_received",
               "s3_bytes_put", "s3_bytes_get", "busy_s")

    def __init__(self, pools: list[dict]):
        self.pools = pools

    def stats(self) -> dict:
        if not self.pools:
            return {}
        out = {k: v for k, v in self.pools[0].items() if k in ("billing", "backend", "memory_mb")}
        for k in self._SUMMED:
            if any(k in p for p in self.pools):
                out[k] = sum(p.get(k, 0) for p in self.pools)
        return out



def train_kafka(cfg: TrainConfig, graph, out: Path | str, *, spawn_local: bool = False, run_id: str | None = None,
                workers: int = 1, resume: bool = False, show_progress: bool = False,
                stall_timeout: float = 300.0, evaluate: bool = True):
    """Train with one process per role over Kafka; the calling process is the driver. Returns a TrainResult."""
    import jax.numpy as jnp

    from ops.sparse import Adjacency
    from pipelines.engine.param_server import unflatten
    from pipelines.train import EarlyStopping, Evaluator, TrainResult, _tree_to_npz, build_model, \
        model_inputs, npz_to_tree, progress
    from pipelines.transports.kafka import KafkaTransport, merge_stats, worker_control_partition

    out = Path(out)
    P = cfg.partitions
    if resume:
        info = read_run_info(out)
        if (out / "summary.json").exists():
            raise ConfigError(f"{out} holds a complete run (summary.json); nothing to resume")
        info["incarnation"] = int(info.get("incarnation", 0)) + 1
        workers = int(info.get("workers", workers))
        spawn_local = bool(info.get("spawn_local", spawn_local))
        rows = _contiguous(rundir.read_jsonl(out / "metrics.jsonl")) if (out / "metrics.jsonl").exists() else []
        start = _resume_point(out, rows)
        history = rows[:start]
    else:
        info = {"run_id": run_id or make_run_id(graph.name), "incarnation": 0}
        start, history = 0, []
    info.update(topic_run_id=topic_run_id(info["run_id"], info["incarnation"]), bootstrap=cfg.bootstrap,
                spawn_local=spawn_local, workers=workers, partitions=P, start_epoch=start, status="running",
                driver_pid=os.getpid())
    rundir.atomic_write_json(out / "run.json", info)

    model = build_model(cfg, graph)
    x, a = model_inputs(cfg, graph)
    adj = Adjacency.from_scipy(a).to_device()
    xj, labels = jnp.asarray(x), jnp.asarray(graph.labels)
    masks = tuple(jnp.asarray(m) for m in (graph.train_mask, graph.val_mask, graph.test_mask))
    evaluator = Evaluator(model)
    stopper = EarlyStopping(cfg.patience)
    for row in history:
        stopper.update(row["epoch"], row)
    best_params = None
    driver_ckpt = out / "ckpt" / "driver.json"
    if history and (out / "weights.npz").exists() and driver_ckpt.exists() and \
            json.loads(driver_ckpt.read_text()).get("best_epoch") == stopper.best_epoch:
        with np.load(out / "weights.npz") as z:
            best_params = {k: {n: np.asarray(v) for n, v in p.items()} for k, p in npz_to_tree(z).items()}
    stop_at = cfg.epochs - 1
    if stopper.should_stop:
        stop_at = start - 1

    from pipelines.engine.cost import CostMeter, load_prices
    from pipelines.engine.spans import merge_wall_rows, write_rows

    pools: list[dict] = []  # the tensor-worker processes' final pool statistics, filled at the end
    meter = CostMeter(cfg, load_prices(cfg.prices), _PoolsReport(pools))  # bad prices fail before any process
    t = KafkaTransport(cfg.bootstrap, info["topic_run_id"], P, linger_consumers=True, client_id="driver")
    metrics = t.consumer([(M.METRICS, 0)], group="driver")
    weights = t.consumer([(M.WEIGHTS, 0)], group="driver-weights")
    log = rundir.MetricsLog(out / "metrics.jsonl", truncate_after_epoch=start - 1)
    launcher = None
    if spawn_local:
        cmds = role_commands(out / "config.toml", cfg.bootstrap, info["topic_run_id"], out=out, partitions=P,
                             workers=workers, start_epoch=start, owner_pid=os.getpid())
        launcher = LocalLauncher(cmds, out / "logs")
        info["roles"] = {r: " ".join(c) for r, c in cmds.items()}
        rundir.atomic_write_json(out / "run.json", info)

    versions: dict[int, dict] = {}
    epoch_parts: dict[int, list] = {}
    done_parts: dict[int, Message] = {}
    last_part_stats: dict[int, dict] = {}
    finals: dict[str, dict] = {}
    spread = 0
    next_epoch = start
    t_start = time.perf_counter()
    t_start_wall = time.time()
    t_epoch = t_start
    final_version = start
    bar = progress(cfg.epochs - start, show_progress,
                   f"{graph.name} {cfg.model} P={P}x{cfg.intervals} kafka")

    def check():
        if launcher is not None:
            launcher.check()

    def handle(msg: Message):
        nonlocal spread
        if msg.kind == "FAILED":
            role = msg.meta.get("role", f"graph-server-{msg.partition}")
            raise RoleFailed(f"{role} failed: {msg.meta.get('error')}")
        if msg.kind == "FINAL":
            role = msg.meta["role"]
            finals[role] = msg.meta
            if launcher is not None:
                launcher.finished.add(role)
            return
        if msg.kind == "DONE":
            done_parts[msg.partition] = msg
            last_part_stats[msg.partition] = msg.meta
            return
        if msg.kind != "EPOCH":
            raise EngineError(f"driver got an unexpected {msg.kind} metrics message")
        epoch_parts.setdefault(msg.epoch, []).append(msg)
        last_part_stats[msg.partition] = msg.meta
        eps = [e for m in last_part_stats.values() for e in m.get("interval_epochs", [])]
        if eps:
            spread = max(spread, max(eps) - min(eps))

    def pump(timeout: float):
        nonlocal final_version
        for w in weights.poll(0.0):
            versions[w.version] = unflatten({k: np.array(v) for k, v in w.arrays.items()})
            final_version = max(final_version, w.version)
        weights.commit()
        for msg in metrics.poll(timeout):
            handle(msg)
        metrics.commit()

    def wait_finals(roles: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(r not in finals for r in roles):
            if time.monotonic() > deadline:
                missing = [r for r in roles if r not in finals]
                if launcher is not None:
                    raise RoleFailed(f"{', '.join(missing)} did not report after STOP within {timeout_s:.0f}s")
                print(f"dorylus: warning: no final report from {', '.join(missing)}", file=sys.stderr)
                return
            check()
            pump(0.1)

    ok = False
    try:
        if launcher is not None:
            launcher.start()
            info["pids"] = launcher.pids()
            rundir.atomic_write_json(out / "run.json", info)
        last_progress = time.monotonic()
        while next_epoch <= stop_at or len(done_parts) < P:
            if next_epoch > stop_at and start > stop_at:
                break  # a resume with nothing left to train
            check()
            if time.monotonic() - last_progress > stall_timeout:
                raise EngineError(f"no progress for {stall_timeout:.0f}s (epoch {next_epoch}); are the roles "
                                  f"running? (run id {info['topic_run_id']})")
            before = (len(epoch_parts), len(done_parts), len(versions))
            pump(0.05)
            if (len(epoch_parts), len(done_parts), len(versions)) != before:
                last_progress = time.monotonic()
            while (next_epoch <= stop_at and len(epoch_parts.get(next_epoch, [])) == P
                   and (next_epoch + 1) in versions):
                parts = epoch_parts.pop(next_epoch)
                loss = sum(m.meta["loss_sum"] for m in parts) / max(sum(m.meta["count"] for m in parts), 1.0)
                params = versions[next_epoch + 1]
                now = time.perf_counter()
                accs = evaluator(params, adj, xj, labels, masks) if evaluate else {
                    "train_acc": None, "val_acc": 0.0, "val_loss": 0.0, "test_acc": None}
                row = {"epoch": next_epoch, "loss": loss, **accs, "epoch_s": now - t_epoch,
                       "max_staleness_observed": max(m.meta["max_staleness"] for m in parts),
                       "relaunches": sum(m.meta["relaunches"] for m in parts)}
                dead = t.dead_letter_count(timeout_s=2.0)
                if dead is not None:
                    row["dead_letters"] = dead  # values any role sent to the dead-letter topic so far
                t_epoch = now
                history.append(row)
                log.write(row)
                if stopper.update(next_epoch, row):
                    best_params = params
                    rundir.atomic_write_npz(out / "weights.npz", _tree_to_npz(best_params))
                    rundir.atomic_write_json(driver_ckpt, {"best_epoch": next_epoch})
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", val=f"{row['val_acc']:.3f}")
                if stopper.should_stop and stop_at > next_epoch:
                    stop_at = next_epoch
                    for p in range(P):
                        t.send(M.CONTROL, p, Message("STOP_AFTER", next_epoch, -1, -1, p, -1))
                next_epoch += 1
                for v in [v for v in versions if v <= next_epoch - 1]:
                    del versions[v]
        # Orderly shutdown: tensor workers first (nothing needs them now), then the parameter server and the
        # graph servers, each reading its channels to the end before it reports.
        t_shutdown = time.perf_counter()
        role_names = ["param-server", *(f"graph-server-{p}" for p in range(P))]
        worker_names = [f"tensor-worker-{k}" for k in range(workers)]
        t.send(M.CONTROL, worker_control_partition(P), Message("STOP", next_epoch, -1, -1, P, -1))
        t.flush()
        wait_finals(worker_names, FINAL_TIMEOUT_S)
        for p in range(P):
            t.send(M.CONTROL, p, Message("STOP", next_epoch, -1, -1, p, -1))
        t.flush()
        wait_finals(role_names, FINAL_TIMEOUT_S)
        if launcher is not None:
            codes = launcher.wait(60.0)
            bad = {r: c for r, c in codes.items() if c != 0}
            if bad:
                launcher.check()
                raise RoleFailed(f"roles did not exit cleanly: {bad}")
        pump(0.0)
        t.drain(timeout_s=60)
        ok = True
    except BaseException as e:
        info.update(status="failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        bar.close()
        log.close()
        if not ok:
            try:  # best effort: stop whatever still runs
                for p in range(P + 1):
                    t.send(M.CONTROL, p, Message("STOP", next_epoch, -1, -1, p, -1))
                t.flush(timeout_s=5)
            except Exception:
                pass
            if launcher is not None:
                launcher.terminate()
            rundir.atomic_write_json(out / "run.json", info)
        try:
            t.close()
        except Exception:
            if ok:
                raise
    seconds = time.perf_counter() - t_start
    if not history:
        raise EngineError("the run produced no epochs")
    if best_params is None:
        best_params = versions.get(final_version) or {}
    final_params = versions.get(final_version, best_params)
    best = history[stopper.best_epoch]
    busy: dict[str, float] = {}
    for m in last_part_stats.values():
        for k, v in m.get("busy_s", {}).items():
            busy[f"graph_server.{k}"] = busy.get(f"graph_server.{k}", 0.0) + v
    pools.extend(finals[r]["stats"] for r in finals if r.startswith("tensor-worker-"))
    pool_busy = sum(float(s.get("busy_s", 0.0)) for s in pools)
    busy["tensor_workers"] = pool_busy
    ps_stats = finals.get("param-server", {}).get("stats", {})
    busy["param_server.WU"] = float(ps_stats.get("busy_s", 0.0))
    gs_busy = sum(v for k, v in busy.items() if k.startswith("graph_server."))
    epoch_times = [r["epoch_s"] for r in history[start + 1:]] or [history[-1]["epoch_s"]]
    transport = merge_stats([t.stats()] + [f.get("transport", {}) for f in finals.values()])
    n_workers = sum(int(s.get("workers", s.get("size", 1)) or 1) for s in pools) or 1
    summary = {
        "status": "complete",
        "dataset": graph.summary(),
        "model": cfg.model,
        "engine": "pipelined",
        "transport_kind": "kafka",
        "run_id": info["run_id"],
        "topic_run_id": info["topic_run_id"],
        "resumed_from_epoch": start if info["incarnation"] else None,
        "incarnation": info["incarnation"],
        "epochs": len(history),
        "best_epoch": stopper.best_epoch,
        "best_val_acc": best["val_acc"],
        "test_acc": best["test_acc"],
        "train_acc": best["train_acc"],
        "final_loss": history[-1]["loss"],
        "seconds": seconds,
        "startup_s": history[start]["epoch_s"] if len(history) > start else None,  # launch to first epoch
        "shutdown_s": seconds - (t_shutdown - t_start),
        "epoch_s_median": float(np.median(epoch_times)),
        "seed": cfg.seed,
        "partitions": P,
        "intervals": cfg.intervals,
        "staleness": "none" if cfg.staleness is None else cfg.staleness,
        "staleness_mode": cfg.staleness_mode,
        "wu": cfg.wu,
        "tensor_workers": cfg.tensor_workers,
        "tensor_worker_processes": workers,
        "max_staleness_observed": max([int(m.get("max_staleness", 0)) for m in last_part_stats.values()] or [0]),
        "max_interval_epoch_spread": spread,
        "relaunches": sum(int(m.get("relaunches", 0)) for m in last_part_stats.values()),
        "duplicates_discarded": sum(int(m.get("duplicates", 0)) for m in last_part_stats.values()),
        "busy_s": busy,
        "utilization": {
            "graph_servers": gs_busy / (seconds * P),
            "tensor_workers": pool_busy / (seconds * n_workers),
            "param_server": busy["param_server.WU"] / seconds,
        },
        "tensor_tasks": sum(int(s.get("tasks", 0)) for s in pools),
        "injected_failures": sum(int(s.get("injected_failures", 0)) for s in pools),
        "injected_delays": sum(int(s.get("injected_delays", 0)) for s in pools),
        "dead_letters": transport["dead_letter_total"],
        "transport": transport,
        "roles": {r: {k: v for k, v in f.items() if k not in ("transport",)} for r, f in sorted(finals.items())},
    }
    summary["cost"] = meter.summary(seconds, len(history), transport, busy)
    summary.update(time_s=seconds, cost_usd=summary["cost"]["cost_usd"],
                   cost_per_epoch_usd=summary["cost"]["cost_per_epoch_usd"], value=summary["cost"]["value"])
    parts = [f.get("stats", {}).pop("spans", []) for f in finals.values()]  # out of summary["roles"] too
    timeline = merge_wall_rows(parts, t_start_wall)
    summary["timeline"] = {"spans": write_rows(out / "timeline.jsonl", timeline), "file": "timeline.jsonl",
                           "dropped": sum(int(f.get("stats", {}).get("spans_dropped", 0)) for f in finals.values()),
                           "clock": "each role's wall clock, merged by the driver"}
    info.update(status="complete")
    rundir.atomic_write_json(out / "run.json", info)
    if best_params:
        rundir.atomic_write_npz(out / "weights.npz", _tree_to_npz(best_params))
    rundir.atomic_write_json(out / "summary.json", summary)
    return TrainResult(final_params, best_params, history, summary)


def resume_train(run_dir: str | Path, *, bootstrap: str | None = None, show_progress: bool = False):
    """`dorylus train --resume RUN_DIR`: continue a Kafka run from its checkpoints (see the module doc)."""
    from pipelines.data.registry import load_dataset
    from pipelines.transports.kafka import check_broker

    out = Path(run_dir)
    if not out.is_dir():
        raise ConfigError(f"--resume {out}: no such run directory")
    info = read_run_info(out)
    cfg = build_config(load_toml(out / "config.toml"), {"bootstrap": bootstrap or info.get("bootstrap")})
    if bootstrap and bootstrap != info.get("bootstrap"):
        rundir.atomic_write_text(out / "config.toml", cfg.to_toml())
    check_broker(cfg.bootstrap)
    graph = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    return graph, train_kafka(cfg, graph, out, resume=True, show_progress=show_progress)
