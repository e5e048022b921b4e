"""One OS process per role: ``dorylus graph-server --partition p``, ``dorylus param-server``,
``dorylus tensor-worker``, talking through the Kafka topics of one run.

Every role reads the same config TOML and dataset and builds itself deterministically (`run_context`: the plan,
initial weights and optimizer are functions of config + seed), so nothing but messages crosses processes.

Life of a role process
----------------------
1. Build the role, connect to the run's topics (`KafkaTransport`, consumers kept open to the end).
2. Run it. Graph servers train until their last epoch and report DONE; the parameter server and the tensor
   workers serve until the driver sends STOP. A graph server then waits for its STOP.
3. Shut down in order (the driver sends the tensor workers' STOP first, the others' once the workers reported):
   read every subscribed partition to its end, discarding leftovers (duplicates of relaunched tasks), so that per
   channel the messages consumed equal those produced; then send a FINAL metrics message with the role's
   statistics and transport counters, flush, and exit 0.
4. Any error: the traceback goes to stderr (the role's log), a FAILED metrics message names the role and the
   error, exit 1. A role whose `--owner-pid` (the launching driver) dies exits at once.

Checkpoints (under ``<out>/ckpt``, written atomically at epoch ends): the parameter server writes
``param-server-<version>.npz`` (weights, optimizer state, version, its consumer offsets; the last few kept) before
it publishes that version; a graph server writes ``graph-server-<p>.json`` (the epoch it completed, its offsets);
a tensor worker ``tensor-worker-<k>.json`` (the weight versions it has seen, its offsets). ``dorylus train
--resume`` restarts every role from the parameter server's checkpoint (see `pipelines.launch`).
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from ops import params as P
from pipelines import rundir
from pipelines.engine.lambda_fleet import endpoint_share
from pipelines.engine.messages import EngineError
from schemas.tasks import Channel, Lifecycle, Message

PS_CKPT_RE = re.compile(r"^param-server-(\d+)\.npz$")
KEEP_PS_CHECKPOINTS = 3


class RoleFailed(EngineError):
    """A role process failed or died; the message names it."""


# ------------------------------------------------------------------------------------------------ checkpoints
def ckpt_dir(out: Path | str) -> Path:
    d = Path(out) / "ckpt"
    d.mkdir(parents=True, exist_ok=True)
    return d


def ps_checkpoints(out: Path | str) -> dict[int, Path]:
    """Parameter-server checkpoints of a run directory, by weight version."""
    d = Path(out) / "ckpt"
    if not d.is_dir():
        return {}
    return {int(m.group(1)): d / p.name for p in d.iterdir() if (m := PS_CKPT_RE.match(p.name))}


def save_ps_checkpoint(out: Path | str, state, offsets: dict | None = None) -> Path:
    """Weights, optimizer state and version of a `PSState`, atomically."""
    arrays = P.flatten(state.params, prefix="params/")
    for i, leaf in enumerate(jax.tree_util.tree_leaves(state.opt_state)):
        arrays[f"opt/{i}"] = np.asarray(leaf)
    meta = {"version": int(state.version), "epoch_done": int(state.version) - 1,
            "offsets": offsets or {}, "time": time.time()}
    arrays["meta"] = np.array(json.dumps(meta))
    path = ckpt_dir(out) / f"param-server-{state.version:06d}.npz"
    rundir.atomic_write_npz(path, arrays)
    for v, old in ps_checkpoints(out).items():
        if v < state.version - KEEP_PS_CHECKPOINTS + 1:
            old.unlink(missing_ok=True)
    return path


def load_ps_checkpoint(path: Path | str, tx, template_params: dict):
    """A `PSState` from a checkpoint; the optimizer state is rebuilt on the structure `tx.init` gives."""
    import jax.numpy as jnp

    from pipelines.engine.param_server import PSState

    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        params = P.read_like(z, template_params, prefix="params/")
        template = tx.init(params)
        leaves, treedef = jax.tree_util.tree_flatten(template)
        got = [jnp.asarray(z[f"opt/{i}"], dtype=jnp.asarray(t).dtype) for i, t in enumerate(leaves)]
        opt_state = jax.tree_util.tree_unflatten(treedef, got)
    v = int(meta["version"])
    return PSState(params, opt_state, v, {v: params}, {})


# ------------------------------------------------------------------------------------------------ plumbing
def _watch_owner(pid: int | None) -> None:
    """Exit at once when the launching driver is gone (no orphaned roles)."""
    if not pid:
        return

    def watch():
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print(f"dorylus: owner process {pid} is gone; exiting", file=sys.stderr, flush=True)
                os._exit(3)
            except PermissionError:
                pass

    threading.Thread(target=watch, daemon=True, name="owner-watch").start()


def _setup(args, role: str):
    from pipelines.config import build_config, load_toml
    from pipelines.data.registry import load_dataset
    from pipelines.transports.kafka import KafkaTransport
    from pipelines.transports.wire import with_wire_dtype

    _watch_owner(args.owner_pid)
    cfg = build_config(load_toml(args.config), {"bootstrap": args.bootstrap, "data_dir": args.data_dir})
    bootstrap = cfg.bootstrap
    graph = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    share = (args.worker_id, args.workers) if hasattr(args, "worker_id") else (0, 1)
    t = KafkaTransport(bootstrap, args.run_id, cfg.partitions, linger_consumers=True, client_id=role,
                       work_share=share, broker_timeout_s=cfg.broker_timeout)
    return cfg, graph, with_wire_dtype(t, cfg.wire_dtype)


def _final(t, role: str, partition: int, stats: dict) -> None:
    """The role's last message: its statistics and its transport counters (this message counted in)."""
    t.flush(timeout_s=120)
    ts = t.stats()
    ch = ts["channels"].setdefault(f"{Channel.METRICS}/0", {"produced": 0, "consumed": {}})
    ch["produced"] += 1
    ts["messages"][Channel.METRICS] = ts["messages"].get(Channel.METRICS, 0) + 1
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    t.send(Channel.METRICS, 0, Message(Lifecycle.FINAL, -1, -1, -1, partition, -1,
                                 meta={"role": role, "stats": stats, "transport": ts, "offsets": t.offsets(),
                                       "pid": os.getpid(), "cpu_s": ru.ru_utime + ru.ru_stime,
                                       "max_rss_mb": ru.ru_maxrss / 1024}))
    t.flush(timeout_s=120)


def _failed(t, role: str, partition: int, e: BaseException) -> None:
    traceback.print_exc()
    print(f"dorylus: {role} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if t is None:
        return
    try:
        t.send(Channel.METRICS, 0, Message(Lifecycle.FAILED, -1, -1, -1, partition, -1,
                                     meta={"role": role, "error": f"{type(e).__name__}: {e}"}))
        t.flush(timeout_s=30)
    except Exception:  # the broker may be the problem; the exit code and the log still say it
        pass


def _wait_stop(consumers, should_stop=None, poll_s: float = 0.1) -> None:
    """Read (and drop) what arrives until a STOP on a control channel."""
    while True:
        for c in consumers:
            for msg in c.poll(poll_s):
                if msg.kind == Lifecycle.STOP:
                    return
            c.commit()
        if should_stop is not None:
            should_stop()


def say(role: str, what: str) -> None:
    """A progress line in the role's log."""
    print(f"{time.strftime('%H:%M:%S')} {role}: {what}", file=sys.stderr, flush=True)


def _run_role(args, role: str, partition: int, body) -> int:
    from pipelines.transports.kafka_security import describe

    t = None
    # SIGUSR1 writes every thread's stack to this role's log: the driver asks for them when the run stalls
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cfg, graph, t = _setup(args, role)
        say(role, f"connected to {args.bootstrap or cfg.bootstrap} ({describe(t.security)}), topics "
                  f"dorylus.{args.run_id}.*")
        stats = body(cfg, graph, t)
        say(role, "stopping: reading my channels to their end")
        t.drain(timeout_s=120)
        _final(t, role, partition, stats)
        say(role, "final report sent")
        t.close()
        say(role, "closed")
        return _exit(0)
    except KeyboardInterrupt:
        return 130
    except BaseException as e:
        _failed(t, role, partition, e)
        return _exit(1)


def _exit(code: int) -> int:
    """Leave now: everything is flushed and closed, and the interpreter's teardown (JAX's runtime) can take
    seconds the driver would wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _span_log():
    """This process's share of the timeline; it travels in the final report, so it is kept small (the report
    draws the first epochs)."""
    from pipelines.engine.spans import SpanLog

    return SpanLog(max_epochs=20, max_spans=20_000)


# ------------------------------------------------------------------------------------------------ roles
def cmd_graph_server(args) -> int:
    from pipelines.engine.runner import build_graph_server, run_context

    p = args.partition
    role = f"graph-server-{p}"

    def body(cfg, graph, t):
        if not 0 <= p < cfg.partitions:
            raise RoleFailed(f"--partition {p} is not one of the config's {cfg.partitions} partitions")
        ctx = run_context(cfg, graph)
        gs = build_graph_server(cfg, graph, t, p, ctx=ctx, start_epoch=args.start_epoch)
        gs.spans = _span_log()
        done = threading.Event()

        def checkpoints():  # at each epoch end: the epoch every interval has completed, and the offsets
            last = args.start_epoch
            while not done.wait(0.2):
                e = min(gs.epoch)
                if e > last:
                    last = e
                    rundir.atomic_write_json(ckpt_dir(args.out) / f"{role}.json", {
                        "role": role, "epoch_done": e - 1, "next_epoch": e, "offsets": t.offsets(),
                        "time": time.time()})

        th = threading.Thread(target=checkpoints, daemon=True, name="checkpoints")
        th.start()
        try:
            gs.run()
        finally:
            done.set()
            th.join()
        if gs.error is not None:
            raise gs.error
        say(role, f"done with epoch {min(gs.epoch) - 1}; waiting for STOP")
        _wait_stop([gs.consumer, gs.wconsumer])
        return {"busy_s": dict(gs.busy_s), "relaunches": gs.inflight.relaunches,
                "duplicates": gs.inflight.duplicates, "max_staleness": gs.max_staleness, "epochs": list(gs.epoch),
                "spans": gs.spans.wall_rows(), "spans_dropped": gs.spans.dropped}

    return _run_role(args, role, p, body)


def cmd_param_server(args) -> int:
    from pipelines.engine.runner import build_param_server, run_context

    role = "param-server"

    def body(cfg, graph, t):
        ctx = run_context(cfg, graph)
        ps = build_param_server(cfg, graph, t, ctx=ctx)
        ps.spans = _span_log()
        start = args.start_epoch
        if start > 0:
            ckpts = ps_checkpoints(args.out)
            if start not in ckpts:
                raise RoleFailed(f"no parameter-server checkpoint of version {start} in {args.out}/ckpt "
                                 f"(have {sorted(ckpts)})")
            ps.state = load_ps_checkpoint(ckpts[start], ctx.tx, ps.state.params)
        publish = ps.publish

        def publish_after_checkpoint(version: int) -> None:
            if version > start:  # an epoch end: checkpoint before anyone can see the new version
                save_ps_checkpoint(args.out, ps.state, t.offsets())
            publish(version)

        ps.publish = publish_after_checkpoint
        ps.run()
        if ps.error is not None:
            raise ps.error
        return {"busy_s": ps.busy_s, "updates": ps.updates, "version": ps.state.version,
                "spans": ps.spans.wall_rows(), "spans_dropped": ps.spans.dropped}

    return _run_role(args, role, -1, body)


def cmd_tensor_worker(args) -> int:
    from pipelines.engine.runner import build_tensor_workers
    from pipelines.transports.kafka import worker_control_partition

    from pipelines.config import ConfigError

    k = args.worker_id
    if not 0 <= k < args.workers:
        raise ConfigError(f"tensor-worker: --worker-id {k} must be in 0..{args.workers - 1} (--workers "
                          f"{args.workers})")
    role = f"tensor-worker-{k}"

    def body(cfg, graph, t):
        if cfg.tensor_workers == "aws":  # each Lambda endpoint to one process only
            cfg = dataclasses.replace(cfg, lambda_endpoint=endpoint_share(cfg.lambda_endpoint, k, args.workers))
        pool = build_tensor_workers(cfg, graph, t)
        control = t.consumer([(Channel.CONTROL, worker_control_partition(cfg.partitions))], group=f"{role}-control")
        pool.start()
        seen = {"versions": 0}

        def check():
            if pool.error is not None:
                raise pool.error
            v = sorted(getattr(pool.weights, "_versions", {}))
            if v and v[-1] != seen["versions"]:
                seen["versions"] = v[-1]
                rundir.atomic_write_json(ckpt_dir(args.out) / f"{role}.json", {
                    "role": role, "latest_version": v[-1], "offsets": t.offsets(), "time": time.time()})

        try:
            _wait_stop([control], check, poll_s=0.2)
        finally:
            pool.stop()
        if pool.error is not None:
            raise pool.error
        st = pool.stats()
        return {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool, dict, list))}

    return _run_role(args, role, -1, body)


# ------------------------------------------------------------------------------------------------ CLI
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the run's config TOML (the driver writes <out>/config.toml)")
    p.add_argument("--bootstrap", help="Kafka bootstrap HOST:PORT (default: the config's)")
    p.add_argument("--run-id", required=True, help="the run's id: topics are dorylus.<run-id>.<kind>")
    p.add_argument("--out", required=True, help="directory for this role's checkpoints (the run directory)")
    p.add_argument("--data-dir", help="dataset directory (default: the config's)")
    p.add_argument("--start-epoch", type=int, default=0,
                   help="resume: the epoch to start at (the parameter server loads its checkpoint of it)")
    p.add_argument("--owner-pid", type=int, help="exit when this process (the launching driver) is gone")


def register(subparsers) -> None:
    g = subparsers.add_parser("graph-server", help="run one graph server (a partition) as a process on Kafka")
    g.add_argument("--partition", type=int, required=True)
    _common(g)
    g.set_defaults(func=cmd_graph_server)
    p = subparsers.add_parser("param-server", help="run the parameter server as a process on Kafka")
    _common(p)
    p.set_defaults(func=cmd_param_server)
    w = subparsers.add_parser("tensor-worker", help="run a tensor-worker pool as a process on Kafka")
    w.add_argument("--worker-id", type=int, default=0,
                   help="this process's index k among the run's tensor-worker processes (0-based)")
    w.add_argument("--workers", type=int, default=1,
                   help="how many tensor-worker processes the run has, W: process k reads the tensor tasks of "
                        "the graph servers p with p mod W = k")
    _common(w)
    w.set_defaults(func=cmd_tensor_worker)
