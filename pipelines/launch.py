"""Kafka runs with one process per role: the command lines of the roles, a local launcher, and the driver.

``dorylus train --transport kafka --bootstrap HOST:PORT --spawn-local`` is `train_kafka`: the train process is
the driver (`KafkaRun` wires it: it reads METRICS and WEIGHTS and hands them to the epoch driver shared with the
in-memory engine, `pipelines.engine.driver`, which evaluates every epoch and writes metrics.jsonl; `KafkaRun`
writes weights.npz, summary.json and run.json), and `role_commands` are the processes it launches on this
machine (without ``--spawn-local`` the roles run elsewhere, e.g. on the machines `pipelines.deploy` starts,
with the same command lines).

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

from ops import params as P
from pipelines import rundir
from pipelines.config import ConfigError, TrainConfig, build_config, load_toml
from pipelines.engine.cost import CostMeter, load_prices
from pipelines.engine.driver import EpochDriver, RoleStats, add_cost, engine_summary
from pipelines.engine.messages import EngineError
from pipelines.engine.spans import merge_wall_rows, write_rows
from pipelines.epochs import EarlyStopping, TrainResult, write_weights
from pipelines.roles import RoleFailed, ps_checkpoints
from pipelines.transports.kafka import KafkaTransport, merge_stats, worker_control_partition
from schemas.tasks import Channel, Lifecycle, Message

FINAL_TIMEOUT_S = 120.0


def make_run_id(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:40] or "run"
    return f"{base}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def topic_run_id(run_id: str, incarnation: int) -> str:
    """The run id in topic names: the run's own for its first incarnation, ``<run>-r<n>`` after n resumes."""
    return run_id if incarnation == 0 else f"{run_id}-r{incarnation}"


def role_names(partitions: int, workers: int) -> list[str]:
    """The role processes of a run with `partitions` graph servers and `workers` tensor-worker processes."""
    return ["param-server", *(f"graph-server-{p}" for p in range(partitions)),
            *(f"tensor-worker-{k}" for k in range(workers))]


def role_commands(config_path: str | Path, bootstrap: str, run_id: str, *, out: str | Path,
                  partitions: int | None = None, workers: int = 1, start_epoch: int = 0,
                  owner_pid: int | None = None, entry: list[str] | None = None,
                  role_bootstrap: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The command line (argv) of every role process of a run, by role name.

    entry: how to invoke the CLI (default: this Python, ``-m pipelines.cli``; ``["dorylus"]`` where installed).
    run_id: the run id the topics are named with (`topic_run_id` of a resumed run). partitions: graph servers
    (default: the config's). workers: tensor-worker processes. start_epoch: resume point (see module doc).
    role_bootstrap: {role: bootstrap} for roles that reach the brokers at other addresses than `bootstrap`.
    """
    if partitions is None:
        partitions = build_config(load_toml(config_path), {}).partitions
    entry = list(entry or [sys.executable, "-m", "pipelines.cli"])
    role_bootstrap = role_bootstrap or {}

    def common(role):
        c = ["--config", str(config_path), "--bootstrap", role_bootstrap.get(role, bootstrap), "--run-id", run_id,
             "--out", str(out)]
        if start_epoch:
            c += ["--start-epoch", str(start_epoch)]
        if owner_pid:
            c += ["--owner-pid", str(owner_pid)]
        return c

    cmds = {"param-server": entry + ["param-server", *common("param-server")]}
    for p in range(partitions):
        cmds[f"graph-server-{p}"] = entry + ["graph-server", "--partition", str(p), *common(f"graph-server-{p}")]
    for k in range(workers):
        role = f"tensor-worker-{k}"
        cmds[role] = entry + ["tensor-worker", "--worker-id", str(k), "--workers", str(workers), *common(role)]
    return cmds


class LocalLauncher:
    """The role processes of one run on this machine; logs in <out>/logs/<role>.log."""

    def __init__(self, commands: dict[str, list[str]], log_dir: Path):
        self.commands = commands
        self.log_dir = Path(log_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.finished: set[str] = set()   # roles allowed to exit (they sent FINAL)
        # Roles sent STOP may exit cleanly before the driver has read their FINAL (it is acked, but still in
        # flight to the driver's poll): a 0 exit then is no failure; a FINAL that never comes times out.
        self.stopping: set[str] = set()

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
            if rc == 0 and (role in self.finished or role in self.stopping):
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

    def dump_stacks(self, settle_s: float = 1.0) -> None:
        """Ask every running role for its threads' stacks (SIGUSR1, `pipelines.roles`): they land in its log."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(settle_s)

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


def _last_line(path: Path, skip_stacks: bool = False) -> str:
    """A role log's last line (its last incarnation's); skip_stacks: the last one before a stack dump."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    if skip_stacks:  # faulthandler's lines
        lines = [ln for ln in lines if not ln.startswith(("Thread 0x", "Current thread 0x", "  File "))]
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
        reps = [p["runtime_reports"] for p in self.pools if p.get("runtime_reports")]
        if reps:  # the Lambda runtimes' own REPORT lines, each process's endpoints' share
            out["runtime_reports"] = {**reps[0], **{k: sum(r[k] for r in reps) for k in (
                "logs", "invocations_sent", "invocations_reported", "unreported", "billed_ms", "gb_s")}}
        return out



def train_kafka(cfg: TrainConfig, graph, out: Path | str, *, spawn_local: bool = False, run_id: str | None = None,
                workers: int = 1, resume: bool = False, show_progress: bool = False,
                stall_timeout: float = 300.0, evaluate: bool = True,
                role_bootstrap: dict[str, str] | None = None) -> TrainResult:
    """Train with one process per role over Kafka; the calling process is the driver. Returns a TrainResult.

    cfg / graph: the run's settings (cfg.bootstrap names the broker) and graph; out: the run directory (holds
    config.toml; gets run.json, logs/, ckpt/, metrics.jsonl, timeline.jsonl, weights.npz, summary.json);
    spawn_local: launch the roles here (`role_commands`); run_id: the topics' run id (default: generated);
    workers: tensor-worker processes; resume: continue the run in `out` (see the module doc); show_progress: a
    tqdm bar; stall_timeout: seconds without any report or weight version before the run fails; evaluate=False
    skips the per-epoch accuracy pass; role_bootstrap: {role: bootstrap} for roles that reach the brokers
    elsewhere (kept in run.json for --resume)."""
    run = KafkaRun(cfg, graph, Path(out), spawn_local=spawn_local, run_id=run_id, workers=workers, resume=resume,
                   show_progress=show_progress, evaluate=evaluate, role_bootstrap=role_bootstrap)
    run.run(stall_timeout)
    return run.result()


class KafkaRun:
    """The driver's wiring of one Kafka run: run.json, the launcher, the driver's consumers, the orderly
    shutdown and the final reports; the epochs themselves are `pipelines.engine.driver.EpochDriver`'s."""

    def __init__(self, cfg: TrainConfig, graph, out: Path, *, spawn_local: bool, run_id: str | None, workers: int,
                 resume: bool, show_progress: bool, evaluate: bool, role_bootstrap: dict[str, str] | None = None):
        self.cfg, self.graph, self.out = cfg, graph, out
        info, start, history, workers, spawn_local = _run_info(cfg, graph, out, resume, run_id, workers,
                                                               spawn_local, role_bootstrap)
        self.info, self.start, self.workers = info, start, workers
        rundir.atomic_write_json(out / "run.json", info)
        stopper = EarlyStopping(cfg.patience)
        for row in history:
            stopper.update(row["epoch"], row)
        self.driver_ckpt = out / "ckpt" / "driver.json"
        self.pools: list[dict] = []  # the tensor-worker processes' final pool statistics, filled at the end
        self.meter = CostMeter(cfg, load_prices(cfg.prices), _PoolsReport(self.pools))  # bad prices fail first
        self.transport = KafkaTransport(cfg.bootstrap, info["topic_run_id"], cfg.partitions, linger_consumers=True,
                                        client_id="driver", broker_timeout_s=cfg.broker_timeout)
        self.metrics = self.transport.consumer([(Channel.METRICS, 0)], group="driver")
        self.weights = self.transport.consumer([(Channel.WEIGHTS, 0)], group="driver-weights")
        self.log = rundir.MetricsLog(out / "metrics.jsonl", truncate_after_epoch=start - 1)
        self.launcher = None
        if spawn_local:
            cmds = role_commands(out / "config.toml", cfg.bootstrap, info["topic_run_id"], out=out,
                                 partitions=cfg.partitions, workers=workers, start_epoch=start,
                                 owner_pid=os.getpid(), role_bootstrap=info["role_bootstrap"])
            self.launcher = LocalLauncher(cmds, out / "logs")
            info["roles"] = {r: " ".join(c) for r, c in cmds.items()}
            rundir.atomic_write_json(out / "run.json", info)
        self.versions: dict[int, dict] = {}
        self.finals: dict[str, dict] = {}
        self.final_version = start
        self.driver = EpochDriver(cfg, graph, self.transport, log=self.log, start=start, history=history,
                                  stopper=stopper, evaluate=evaluate, show_progress=show_progress,
                                  desc=f"{graph.name} {cfg.model} P={cfg.partitions}x{cfg.intervals} kafka",
                                  row_extras=self._dead_letters, on_best=self._save_best)
        self.driver.best_params = _restored_best(out, history, stopper, self.driver_ckpt)
        self.t_start = time.perf_counter()
        self.t_start_wall = time.time()
        self.driver.t_epoch = self.t_start
        self.t_shutdown = self.t_start

    # ------------------------------------------------------------------------------------------- hooks
    def _dead_letters(self, row: dict) -> dict:
        dead = self.transport.dead_letter_count(timeout_s=2.0)
        return {} if dead is None else {"dead_letters": dead}  # values any role sent to the dead-letter topic

    def _save_best(self, epoch: int, params: dict) -> None:
        write_weights(self.out, params)
        rundir.atomic_write_json(self.driver_ckpt, {"best_epoch": epoch})

    # ------------------------------------------------------------------------------------------- reading
    def _check(self) -> None:
        if self.launcher is not None:
            self.launcher.check()

    def _handle(self, msg: Message) -> None:
        if msg.kind == Lifecycle.FAILED:
            role = msg.meta.get("role", f"graph-server-{msg.partition}")
            raise RoleFailed(f"{role} failed: {msg.meta.get('error')}; continue the run with dorylus train "
                             f"--resume {self.out}")
        if msg.kind == Lifecycle.FINAL:
            role = msg.meta["role"]
            self.finals[role] = msg.meta
            if self.launcher is not None:
                self.launcher.finished.add(role)
            return
        if not self.driver.observe(msg):
            raise EngineError(f"driver got an unexpected {msg.kind} metrics message")

    def _pump(self, timeout: float) -> None:
        for w in self.weights.poll(0.0):
            self.versions[w.version] = P.unflatten({k: np.array(v) for k, v in w.arrays.items()})
            self.final_version = max(self.final_version, w.version)
        self.weights.commit()
        for msg in self.metrics.poll(timeout):
            self._handle(msg)
        self.metrics.commit()

    def _wait_finals(self, roles: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(r not in self.finals for r in roles):
            if time.monotonic() > deadline:
                missing = [r for r in roles if r not in self.finals]
                if self.launcher is not None:
                    raise RoleFailed(f"{', '.join(missing)} did not report after STOP within {timeout_s:.0f}s")
                print(f"dorylus: warning: no final report from {', '.join(missing)}", file=sys.stderr)
                return
            self._check()
            self._pump(0.1)

    def _stop(self, partition: int) -> None:
        stop = Message(Lifecycle.STOP, self.driver.next_epoch, -1, -1, partition, -1)
        self.transport.send(Channel.CONTROL, partition, stop)

    # ------------------------------------------------------------------------------------------- running
    def run(self, stall_timeout: float) -> None:
        """Launch (with spawn_local), drive every epoch, shut the roles down in order; on failure stop them all."""
        ok = False
        try:
            if self.launcher is not None:
                self.launcher.start()
                self.info["pids"] = self.launcher.pids()
                rundir.atomic_write_json(self.out / "run.json", self.info)
            self._epochs(stall_timeout)
            self._shutdown()
            ok = True
        except BaseException as e:
            self.info.update(status="failed", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self.driver.close()
            self.log.close()
            if not ok:
                self._abort()
            try:
                self.transport.close()
            except Exception:
                if ok:
                    raise

    def _epochs(self, stall_timeout: float) -> None:
        d = self.driver
        last_progress = time.monotonic()
        while not d.finished:
            if d.next_epoch > d.stop_at and self.start > d.stop_at:
                break  # a resume with nothing left to train
            self._check()
            if time.monotonic() - last_progress > stall_timeout:
                raise EngineError(self._stall_text(stall_timeout))
            before = (d.progress_marker, len(self.versions))
            self._pump(0.05)
            if (d.progress_marker, len(self.versions)) != before:
                last_progress = time.monotonic()
            d.complete(self.versions)

    def _stall_text(self, stall_timeout: float) -> str:
        """The stall error: with local roles, each one's last log line (their thread stacks go to the logs)."""
        text = f"no progress for {stall_timeout:.0f}s (epoch {self.driver.next_epoch}); "
        if self.launcher is None:
            return text + f"are the roles running? (run id {self.info['topic_run_id']})"
        self.launcher.dump_stacks()
        last = "; ".join(f"{r}: {_last_line(self.launcher.log_dir / f'{r}.log', skip_stacks=True)}"
                         for r in self.launcher.procs)
        return text + f"the roles' last words: {last} (thread stacks in {self.launcher.log_dir})"

    def _shutdown(self) -> None:
        """Tensor workers first (nothing needs them now), then the parameter server and the graph servers, each
        reading its channels to the end before it reports."""
        partitions = self.cfg.partitions
        self.t_shutdown = time.perf_counter()
        role_names = ["param-server", *(f"graph-server-{p}" for p in range(partitions))]
        worker_names = [f"tensor-worker-{k}" for k in range(self.workers)]
        if self.launcher is not None:
            self.launcher.stopping.update(worker_names)
        self._stop(worker_control_partition(partitions))
        self.transport.flush()
        self._wait_finals(worker_names, FINAL_TIMEOUT_S)
        if self.launcher is not None:
            self.launcher.stopping.update(role_names)
        for p in range(partitions):
            self._stop(p)
        self.transport.flush()
        self._wait_finals(role_names, FINAL_TIMEOUT_S)
        if self.launcher is not None:
            codes = self.launcher.wait(60.0)
            bad = {r: c for r, c in codes.items() if c != 0}
            if bad:
                self.launcher.check()
                raise RoleFailed(f"roles did not exit cleanly: {bad}")
        self._pump(0.0)
        self.transport.drain(timeout_s=60)

    def _abort(self) -> None:
        try:  # best effort: stop whatever still runs
            for p in range(self.cfg.partitions + 1):
                self._stop(p)
            self.transport.flush(timeout_s=5)
        except Exception:
            pass
        if self.launcher is not None:
            self.launcher.terminate()
        rundir.atomic_write_json(self.out / "run.json", self.info)

    # ------------------------------------------------------------------------------------------- the end
    def role_stats(self) -> RoleStats:
        """The roles' statistics, read from their FINAL reports."""
        finals = self.finals
        self.pools.extend(finals[r]["stats"] for r in finals if r.startswith("tensor-worker-"))
        pool = {"busy_s": sum(float(s.get("busy_s", 0.0)) for s in self.pools)}
        for k in ("tasks", "injected_failures", "injected_delays", "duplicates_skipped"):
            pool[k] = sum(int(s.get(k, 0)) for s in self.pools)
        transport = merge_stats([self.transport.stats()] + [f.get("transport", {}) for f in finals.values()])
        return RoleStats(graph_servers=self.driver.reports, interval_epoch_spread=self.driver.spread, pool=pool,
                         workers=sum(int(s.get("workers", s.get("size", 1)) or 1) for s in self.pools) or 1,
                         tensor_lane="tensor_workers",
                         param_server_busy_s=float(finals.get("param-server", {}).get("stats", {})
                                                   .get("busy_s", 0.0)),
                         transport=transport)

    def result(self) -> TrainResult:
        """The summary and the run directory's last files (weights.npz, summary.json, run.json complete)."""
        seconds = time.perf_counter() - self.t_start
        d, info, start = self.driver, self.info, self.start
        if not d.history:
            raise EngineError("the run produced no epochs")
        best_params = d.best_params if d.best_params is not None else (self.versions.get(self.final_version) or {})
        final_params = self.versions.get(self.final_version, best_params)
        stats = self.role_stats()
        head = {"transport_kind": "kafka", "run_id": info["run_id"], "topic_run_id": info["topic_run_id"],
                "resumed_from_epoch": start if info["incarnation"] else None, "incarnation": info["incarnation"]}
        summary = engine_summary(self.cfg, self.graph, d, stats, self.meter, seconds, head=head,
                                 after_workers={"tensor_worker_processes": self.workers})
        summary.update(
            startup_s=d.history[start]["epoch_s"] if len(d.history) > start else None,  # launch to first epoch
            shutdown_s=seconds - (self.t_shutdown - self.t_start),
            dead_letters=stats.transport["dead_letter_total"], transport=stats.transport,
            roles={r: {k: v for k, v in f.items() if k not in ("transport",)} for r, f in sorted(self.finals.items())})
        add_cost(summary, self.meter, seconds, len(d.history), stats.transport, summary["busy_s"])
        parts = [f.get("stats", {}).pop("spans", []) for f in self.finals.values()]  # out of summary["roles"] too
        timeline = merge_wall_rows(parts, self.t_start_wall)
        summary["timeline"] = {"spans": write_rows(self.out / "timeline.jsonl", timeline), "file": "timeline.jsonl",
                               "dropped": sum(int(f.get("stats", {}).get("spans_dropped", 0))
                                              for f in self.finals.values()),
                               "clock": "each role's wall clock, merged by the driver"}
        info.update(status="complete")
        rundir.atomic_write_json(self.out / "run.json", info)
        if best_params:
            write_weights(self.out, best_params)
        rundir.atomic_write_json(self.out / "summary.json", summary)
        return TrainResult(final_params, best_params, d.history, summary)


def _run_info(cfg: TrainConfig, graph, out: Path, resume: bool, run_id: str | None, workers: int,
              spawn_local: bool, role_bootstrap: dict[str, str] | None = None):
    """run.json's content for this incarnation, the epoch it starts at, the rows before it, and the workers and
    spawn_local in force (a resume keeps the first incarnation's)."""
    if resume:
        info = read_run_info(out)
        if (out / "summary.json").exists():
            raise ConfigError(f"{out} holds a complete run (summary.json); nothing to resume")
        info["incarnation"] = int(info.get("incarnation", 0)) + 1
        workers = int(info.get("workers", workers))
        spawn_local = bool(info.get("spawn_local", spawn_local))
        role_bootstrap = info.get("role_bootstrap", role_bootstrap)
        rows = _contiguous(rundir.read_jsonl(out / "metrics.jsonl")) if (out / "metrics.jsonl").exists() else []
        start = _resume_point(out, rows)
        history = rows[:start]
    else:
        info = {"run_id": run_id or make_run_id(graph.name), "incarnation": 0}
        start, history = 0, []
    info.update(topic_run_id=topic_run_id(info["run_id"], info["incarnation"]), bootstrap=cfg.bootstrap,
                spawn_local=spawn_local, workers=workers, partitions=cfg.partitions, start_epoch=start,
                status="running", driver_pid=os.getpid(), role_bootstrap=role_bootstrap or {})
    return info, start, history, workers, spawn_local


def _restored_best(out: Path, history: list[dict], stopper: EarlyStopping, driver_ckpt: Path) -> dict | None:
    """A resumed run's best weights so far: weights.npz, when the driver's checkpoint says it is of the best
    epoch the replayed history names."""
    if history and (out / "weights.npz").exists() and driver_ckpt.exists() and \
            json.loads(driver_ckpt.read_text()).get("best_epoch") == stopper.best_epoch:
        with np.load(out / "weights.npz") as z:
            return P.from_npz(z)
    return None


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
