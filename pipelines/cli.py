"""The `dorylus` command line: one subcommand per job; errors are one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import datetime
import shutil
import sys
from pathlib import Path

from pipelines.config import FEATURE_NORMS, FIELDS, ConfigError, build_config, load_toml


class UsageError(Exception):
    """A flag is wrong; the message names it."""


class Parser(argparse.ArgumentParser):
    """argparse, but a wrong flag is one line naming the problem (argparse's usage stays in --help)."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


EXIT_USAGE = 2


def _train_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", help="known name (cora, citeseer, cora-ml, amazon-computers, coauthor-cs), "
                                     "synthetic:planted?..., synthetic:rmat?..., or a file path; "
                                     "default: a generated planted-partition graph")
    g.add_argument("--data-dir", help="dataset directory (default: $DORYLUS_DATA_DIR or ~/.cache/dorylus/datasets)")
    g.add_argument("--prepared", metavar="DIR", help="a graph prepared by `dorylus prepare --out DIR` (instead of "
                                                     "--dataset); the engine uses its partitions when --partitions "
                                                     "equals theirs")
    g.add_argument("--feature-norm", choices=FEATURE_NORMS,
                   help="row (Kipf's), none, or auto (default): row unless the mean row has more than "
                        "sqrt(features) non-zeros or negative entries")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["gcn", "gat", "sage"])
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int, help="GAT attention heads of hidden layers")
    g.add_argument("--out-heads", type=int, help="GAT attention heads of the output layer")
    g.add_argument("--layers", type=int)
    g.add_argument("--dropout", type=float)
    g.add_argument("--order", choices=["auto", "ga-first", "av-first"],
                   help="GCN/GraphSAGE stage order per layer (auto: aggregate on the narrower side); "
                        "the same model in every order, dropout before the aggregation")
    g = p.add_argument_group("optimization")
    g.add_argument("--seed", type=int)
    g.add_argument("--epochs", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--patience", type=int, help="stop after this many epochs without a better validation "
                                                "accuracy (0: never)")
    g = p.add_argument_group("engine (computation separation)")
    g.add_argument("--partitions", type=int, help="graph servers (graph partitions)")
    g.add_argument("--intervals", type=int, help="vertex intervals per partition")
    g.add_argument("--partitioner", choices=["metis", "hash", "prepared"],
                   help="prepared: the partitions stored by `dorylus prepare` (needs --prepared)")
    g.add_argument("--staleness", help="none (synchronous) or S >= 0 epochs of bounded staleness")
    g.add_argument("--staleness-mode", choices=["smooth", "smooth-zero", "predict", "fresh", "stale"],
                   help="under S >= 1, epoch e uses: smooth (default) weights e, an EMA of the ghost values of "
                        "epochs <= e - S (PipeGCN-GF, bias-corrected), fresh ghost gradients; smooth-zero: that EMA "
                        "started from 0; predict: ghost values of e - S "
                        "extrapolated to e; fresh: weights e, ghost values and gradients of e - S (PipeGCN); "
                        "stale: weights e - S as well (epochs overlap; diverges on large graphs)")
    g.add_argument("--sync-warmup", type=int, metavar="W",
                   help="under S >= 1, the first W epochs read fresh ghost values and gradients (as S = 0), then the "
                        "bound applies: staleness costs most while full-batch Adam moves fastest (default 20; 0: none)")
    g.add_argument("--wire-dtype", choices=["float32", "bfloat16"],
                   help="row tensors between graph servers and tensor workers (tasks, results, ghost rows and "
                        "gradients): float32 (default) or bfloat16, half the bytes on every transport")
    g.add_argument("--wu", choices=["sync", "async"], help="WU sums the epoch's gradients when all are in (sync) or folds each in as it arrives (async)")
    g.add_argument("--tensor-workers", help="N (a local pool of N workers), auto (a local pool autotuned from "
                                            "the task backlog) or aws (AWS Lambda; needs --function)")
    g.add_argument("--fail-rate", type=float, help="injected tensor-task failure probability")
    g.add_argument("--delay-rate", type=float, help="probability that a tensor task is delayed")
    g.add_argument("--delay-s", type=float, help="mean injected delay (exponential), seconds")
    g.add_argument("--task-latency-s", type=float, help="fixed latency added to every tensor task of a local pool "
                                                        "(a remote worker's round trip; the worker sleeps)")
    g.add_argument("--residual-cache-mb", type=int, metavar="MB",
                   help="a local pool keeps each AV forward's residuals for its backward, up to MB MiB (default "
                        "1024; 0: every backward runs its forward again, as a Lambda does)")
    g.add_argument("--straggler-k", type=float, help="relaunch a late task after max(min, k x its kind's p90 time)")
    g.add_argument("--straggler-min-s", type=float)
    g.add_argument("--transport", choices=["memory", "kafka"])
    g.add_argument("--bootstrap", help="Kafka bootstrap HOST:PORT")
    g.add_argument("--broker-timeout", type=float,
                   help="kafka: seconds without an answer from any broker after which a role (or the driver) "
                        "fails, naming itself and how to --resume (default 120)")
    g.add_argument("--role-bootstrap", action="append", metavar="ROLE=HOST:PORT[,HOST:PORT]",
                   help="kafka --spawn-local: the bootstrap one role uses instead of --bootstrap (e.g. "
                        "graph-server-0 through another network path); repeatable")
    g.add_argument("--spawn-local", action="store_true",
                   help="kafka: launch the graph servers, parameter server and tensor workers as processes here")
    g.add_argument("--run-id", help="kafka: the run id naming its topics (default: generated)")
    g.add_argument("--worker-processes", type=int, default=1, help="kafka: tensor-worker processes (default 1)")
    g.add_argument("--resume", metavar="RUN_DIR", help="continue a Kafka run from its checkpoints")
    g = p.add_argument_group("serverless tensor workers (AWS Lambda) and cost")
    g.add_argument("--mode", choices=["serverless", "cpu-only"],
                   help="serverless: tensor tasks on tensor workers (Lambdas, or a local pool priced as Lambdas); "
                        "cpu-only: the graph servers run them (priced as server time)")
    g.add_argument("--function", help="Lambda function name or ARN of the tensor workers (--tensor-workers aws)")
    g.add_argument("--bucket", help="S3 bucket for task payloads over the 6 MB Lambda invoke limit")
    g.add_argument("--region", help="AWS region (default: the AWS config/environment)")
    g.add_argument("--s3-prefix", help="key prefix of the S3 payload objects (default tensor-workers, the prefix the "
                                         "Terraform deployment lets the function use)")
    g.add_argument("--lambda-memory-mb", type=int, help="the function's memory setting, for billed GB-seconds "
                                                        "of local-pool runs (default 3008)")
    g.add_argument("--lambda-concurrency", type=int, help="concurrent Lambda invocations (default: autotuned)")
    g.add_argument("--lambda-endpoint", metavar="URL[,URL...]",
                   help="Lambda Invoke endpoints (a local fleet: infra/local/lambda.sh endpoints; default "
                        "$AWS_ENDPOINT_URL_LAMBDA): one invocation at a time on each, spread over all")
    g.add_argument("--graph-instance", help="EC2 type the cost model bills graph servers as (c5n.2xlarge)")
    g.add_argument("--ps-instance", help="EC2 type the cost model bills the parameter server as (c5.xlarge)")
    g.add_argument("--prices", help="price table (TOML) overriding pipelines/prices.toml")
    g = p.add_argument_group("output")
    g.add_argument("--config", help="TOML file with the same settings (flags win)")
    g.add_argument("--out", help="run directory (default: runs/<dataset>-<model>-<time>)")
    g.add_argument("--overwrite", action="store_true", help="reuse a non-empty --out directory")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_train(args) -> int:
    from pipelines import rundir
    from pipelines.data.graph import DataError, check_trainable
    from pipelines.engine.cost import load_prices
    from pipelines.data.features import resolve_feature_norm
    from pipelines.data.registry import load_dataset

    if getattr(args, "resume", None):
        from pipelines.launch import resume_train

        graph, result = resume_train(args.resume, bootstrap=args.bootstrap,
                                     show_progress=not args.quiet and sys.stderr.isatty())
        s = result.summary
        print(f"{graph.name} {s['model']}: best val {s['best_val_acc']:.4f} (epoch {s['best_epoch']}), "
              f"test {s['test_acc']:.4f}, resumed at epoch {s['resumed_from_epoch']}, {s['epochs']} epochs "
              f"-> {args.resume}")
        return 0
    file_values = load_toml(args.config) if args.config else {}
    flags = {k: getattr(args, k) for k in FIELDS if hasattr(args, k)}
    cfg = build_config(file_values, flags)
    if args.worker_processes < 1:   # a Kafka run with no tensor-worker process would wait for one forever
        raise ConfigError(f"--worker-processes must be >= 1, got {args.worker_processes}")
    role_bootstrap = _role_bootstrap(args.role_bootstrap, cfg.partitions, args.worker_processes)
    if role_bootstrap and not (cfg.transport == "kafka" and args.spawn_local):
        raise ConfigError("--role-bootstrap sets the brokers of roles that --spawn-local launches: add "
                          "--transport kafka --spawn-local")
    if cfg.transport == "kafka":  # an unreachable broker is a clear error before anything is written
        from pipelines.transports.kafka import check_broker

        check_broker(cfg.bootstrap)
    elif getattr(args, "spawn_local", False):
        raise ConfigError("--spawn-local launches roles that talk through Kafka: add --transport kafka")
    if cfg.prepared:
        graph, run_cfg = _prepared_graph(cfg, explicit_partitioner="partitioner" in file_values or args.partitioner)
    else:
        graph, run_cfg = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed), cfg
    if cfg.partitions > graph.num_nodes:
        raise ConfigError(f"partitions ({cfg.partitions}) exceeds the graph's {graph.num_nodes} vertices")
    for warning in check_trainable(graph):  # no training/val/test vertex is a DataError, before any output
        print(f"dorylus: warning: {warning}", file=sys.stderr)
    load_prices(cfg.prices)  # a bad price table is an error now, not after training
    # config.toml records what "auto" chose, so inference normalizes block by block without the whole graph.
    cfg.feature_norm = run_cfg.feature_norm = resolve_feature_norm(graph.features, cfg.feature_norm)
    if cfg.out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.out = str(Path("runs") / f"{graph.name}-{cfg.model}-{stamp}")
    created = not Path(cfg.out).exists()
    out = rundir.prepare_out_dir(cfg.out, overwrite=args.overwrite)
    try:
        result = _run_training(args, cfg, run_cfg, graph, out, role_bootstrap)
    except (ConfigError, DataError):
        # Bad input found once the run started (a partition smaller than --intervals, say): no partial output.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    s = result.summary
    print(f"{graph.name} {cfg.model}: best val {s['best_val_acc']:.4f} (epoch {s['best_epoch']}), "
          f"test {s['test_acc']:.4f}, {s['epochs']} epochs in {s['seconds']:.1f}s -> {out}")
    return 0


def _run_training(args, cfg, run_cfg, graph, out, role_bootstrap: dict[str, str]):
    from pipelines import rundir

    rundir.atomic_write_text(out / "config.toml", cfg.to_toml())
    show = not args.quiet and sys.stderr.isatty()
    if cfg.transport == "kafka":
        from pipelines.launch import train_kafka

        result = train_kafka(cfg, graph, out, spawn_local=args.spawn_local, run_id=args.run_id,
                             workers=args.worker_processes, show_progress=show, role_bootstrap=role_bootstrap)
    elif cfg.engine:
        from pipelines.engine.runner import train_engine

        result = train_engine(run_cfg, graph, out=out, show_progress=show)
    else:
        from pipelines.train import train

        result = train(run_cfg, graph, out=out, show_progress=show)
        from pipelines.engine.cost import add_whole_graph_cost

        add_whole_graph_cost(cfg, result.summary, result.history, out)
    return result


def _role_bootstrap(specs, partitions: int, workers: int) -> dict[str, str]:
    """--role-bootstrap ROLE=HOST:PORT,... flags as {role: bootstrap}; roles are those the run launches."""
    from pipelines.launch import role_names

    roles = role_names(partitions, workers)
    out = {}
    for spec in specs or []:
        role, sep, boot = spec.partition("=")
        if not sep or not boot.strip():
            raise ConfigError(f"--role-bootstrap wants ROLE=HOST:PORT, got {spec!r}")
        if role not in roles:
            raise ConfigError(f"--role-bootstrap: no role {role!r} in this run (roles: {', '.join(roles)})")
        out[role] = boot.strip()
    return out


def _prepared_graph(cfg, explicit_partitioner):
    """The graph of cfg.prepared and the config to train with: when the engine runs with as many partitions as
    the prepare run made (and no --partitioner was given), its stored assignment (partitioner "prepared")."""
    import dataclasses

    from pipelines.data.prepared import load_graph, partition_assignment, read_manifest

    if cfg.transport == "kafka":
        raise ConfigError("--prepared with --transport kafka is not supported yet (the role processes load "
                          "--dataset); use the memory transport")
    stored = read_manifest(cfg.prepared)["num_partitions"]
    if not explicit_partitioner and cfg.partitions > 1 and cfg.partitions == stored:
        cfg.partitioner = "prepared"
    if cfg.partitioner == "prepared" and cfg.partitions != stored:
        raise ConfigError(f"partitioner prepared: {cfg.prepared} holds {stored} partitions, not {cfg.partitions}")
    graph = load_graph(cfg.prepared)
    if cfg.partitioner != "prepared":
        return graph, cfg
    from pipelines.engine.partition import PrecomputedAssignment

    return graph, dataclasses.replace(cfg, partitioner=PrecomputedAssignment(partition_assignment(cfg.prepared)))


def cmd_data_fetch(args) -> int:
    from pipelines.data.registry import fetch, resolve_data_dir

    data_dir = resolve_data_dir(args.data_dir)
    for name in args.names:
        paths = fetch(name, data_dir, base_url=args.base_url)
        print(f"{name}: {len(paths)} files verified in {data_dir}")
    return 0


def build_parser() -> Parser:
    p = Parser(prog="dorylus", description="Full-graph GNN training on graph servers and tensor workers "
                                           "(after Dorylus, OSDI 2021).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    t = sub.add_parser("train", help="train a GCN or GAT on a graph")
    _train_flags(t)
    t.set_defaults(func=cmd_train)
    d = sub.add_parser("data", help="datasets")
    dsub = d.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    f = dsub.add_parser("fetch", help="download known datasets into the data directory and verify checksums")
    f.add_argument("names", nargs="+")
    f.add_argument("--data-dir")
    f.add_argument("--base-url", help="where the files are served (default: $DORYLUS_DATASET_BASE_URL or the "
                                      "public source)")
    f.set_defaults(func=cmd_data_fetch)
    for register in _extra_commands():
        register(sub)
    return p


def _extra_commands():
    """Subcommands owned by other rooms register themselves here."""
    regs = []
    import importlib

    for mod in ("pipelines.roles", "pipelines.beam.commands", "pipelines.continuous.commands",
                "pipelines.deploy", "pipelines.report", "pipelines.lambda_package", "pipelines.plan.commands"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod or (e.name and mod.startswith(e.name + ".")) or e.name == mod.rsplit(".", 1)[0]:
                continue
            raise
        regs.append(m.register)
    return regs


def _configure_logging() -> None:
    """``DORYLUS_LOG_LEVEL`` (e.g. DEBUG, or ``kafka=DEBUG,pipelines=INFO``) turns on library logging to stderr."""
    import logging
    import os

    spec = os.environ.get("DORYLUS_LOG_LEVEL", "").strip()
    if not spec:
        return
    logging.basicConfig(format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    for part in spec.split(","):
        name, _, level = part.rpartition("=")
        try:
            logging.getLogger(name or None).setLevel(level.strip().upper())
        except ValueError:
            raise SystemExit(f"dorylus: error: DORYLUS_LOG_LEVEL: unknown level {level!r}")


def main(argv: list[str] | None = None) -> int:
    if argv is None:   # a process's own command line (not a call from Python): huge pages for XLA's buffers
        from ops.host import reexec_with_huge_pages

        reexec_with_huge_pages()
    from pipelines.data.graph import DataError
    from pipelines.engine.messages import EngineError
    from pipelines.transports.base import TransportError

    _configure_logging()
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except (ConfigError, DataError, FileExistsError, FileNotFoundError, TransportError) as e:
        print(f"dorylus: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EngineError as e:  # a role failed (a process died, a task failed for good): one line, exit 1
        print(f"dorylus: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dorylus: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
