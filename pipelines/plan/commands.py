"""`dorylus plan`: predicted epoch time, cost per epoch and value of candidate deployments, before paying for one.

    dorylus plan --calibration runs/cal --vertices 232965 --edges 114615892 --features 602 --classes 41 \
        --graph-servers 2,4,8 --instance c5n.2xlarge --lambdas 0,40,80 --staleness 0,1 --out plans/reddit

The graph is a dataset spec (--dataset), a prepared directory (--prepared; both give the real partition plans)
or sizes (--vertices/--edges/--features: estimated plans). Candidates are a grid (--graph-servers x --instance x
--lambdas x --staleness [x --intervals]) or explicit --candidate P=4,instance=c5n.2xlarge,lambdas=80,S=1.
Task costs come from measured engine runs (--calibration RUN_DIR[,RUN_DIR]: their timeline.jsonl). The table marks the
best value and the fastest candidate within --budget (USD per epoch); --out writes plan.json and plan.png.
`dorylus deploy render --config base.toml --plan DIR/plan.json --row best-value` renders a chosen row.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from pipelines import rundir
from pipelines.config import ConfigError, TrainConfig
from pipelines.engine.cost import VALUE_UNITS, check_instances, load_prices, usd_str
from pipelines.plan.calibrate import calibrate
from pipelines.plan.cluster import LambdaSpec, Network
from pipelines.plan.search import Prediction, check, evaluate, grid, mark, parse_spec
from pipelines.plan.shape import build_stages, estimate, from_plan

PLAN_FILE = "plan.json"
PNG_FILE = "plan.png"


def _graph_source(args):
    """(vertices, edges, features, classes, shape_of(P, K)) of the graph the flags name."""
    sizes = [args.vertices, args.edges, args.features]
    given = sum(x is not None for x in (args.dataset, args.prepared)) + (any(x is not None for x in sizes))
    if given != 1:
        raise ConfigError("give the graph once: --dataset SPEC, --prepared DIR, or --vertices/--edges/--features")
    if any(x is not None for x in sizes):
        if any(x is None for x in sizes):
            raise ConfigError("sizes need all of --vertices, --edges and --features")
        for name, v in zip(("--vertices", "--edges", "--features"), sizes):
            if v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}")
        n, m, f, c = args.vertices, args.edges, args.features, args.classes
        if c < 2:
            raise ConfigError(f"--classes must be >= 2, got {c}")
        return n, m, f, c, functools.lru_cache(None)(
            lambda P, K: estimate(n, m, f, c, P, K, cut_fraction=args.cut_fraction))
    from pipelines.engine.partition import build_plan, layout_for
    from pipelines.train import model_inputs

    if args.prepared:
        from pipelines.beam.shards import load_graph

        graph = load_graph(args.prepared)
    else:
        from pipelines.data.registry import load_dataset

        graph = load_dataset(args.dataset, args.data_dir, seed=0)
    _, a = model_inputs(TrainConfig(model=args.model).resolved(), graph)
    n, m = graph.num_nodes, int(graph.summary()["edges"])
    f, c = graph.feature_dim, graph.num_classes
    layout = layout_for(build_stages(args.model, f, c).stages)  # the intervals the engine would run

    @functools.lru_cache(None)
    def shape_of(P, K):
        return from_plan(build_plan(a, P, K, "metis", 0, **layout), n, m, f, c)

    return n, m, f, c, shape_of


def candidates(args) -> list:
    out = [parse_spec(s) for s in args.candidate or []]
    if args.graph_servers or not out:
        out += grid(args.graph_servers or "1,2,4", args.instance, args.lambdas, args.staleness, args.intervals)
    return list(dict.fromkeys(out))


def table_text(preds: list[Prediction], budget: float | None, meta: dict) -> str:
    head = f"{'#':>3}  {'graph servers':22} {'λ/GS':>5} {'S':>4} {'K':>4} {'epoch s':>10} {'$/epoch':>12} " \
           f"{'value':>12}  marks"
    lines = [f"graph: {meta['graph']}; model {meta['model']}; calibrated from {meta['calibration']}", "", head]
    for k, p in enumerate(preds):
        c = p.candidate
        s = "none" if c.staleness is None else str(c.staleness)
        v = "-" if p.value is None else f"{p.value:.4g}"
        lines.append(f"{k:>3}  {str(c.partitions) + ' x ' + c.instance:22} {c.lambdas or '-':>5} {s:>4} "
                     f"{c.intervals:>4} {p.epoch_s:>10.4g} {usd_str(p.cost_per_epoch):>12} {v:>12}  "
                     f"{' '.join(p.marks)}")
    lines.append("")
    lines.append(f"value = 1/(epoch time x cost per epoch), {VALUE_UNITS}; "
                 + (f"budget ${budget:g} per epoch" if budget is not None else "no budget"))
    return "\n".join(lines) + "\n"


def write_png(preds: list[Prediction], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for p in preds:
        c = p.candidate
        color = "tab:blue" if c.lambdas else "tab:gray"
        ax.scatter(p.cost_per_epoch, p.epoch_s, c=color, s=40 + 80 * ("best-value" in p.marks),
                   edgecolors="black" if p.marks else "none", zorder=3)
        if p.marks or len(preds) <= 16:
            ax.annotate(c.label + (f" [{', '.join(p.marks)}]" if p.marks else ""), (p.cost_per_epoch, p.epoch_s),
                        fontsize=6, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted cost per epoch (USD)")
    ax.set_ylabel("predicted epoch time (s)")
    ax.set_title(title, fontsize=9)
    ax.scatter([], [], c="tab:blue", label="CPU + Lambdas")
    ax.scatter([], [], c="tab:gray", label="CPU only")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def cmd_plan(args) -> int:
    if args.budget is not None and not (args.budget > 0 and math.isfinite(args.budget)):
        raise ConfigError(f"--budget must be a positive number of USD per epoch, got {args.budget}")
    if args.epochs < 2:
        raise ConfigError(f"--epochs must be >= 2 (one to warm up, one to time), got {args.epochs}")
    if not (args.local_speed > 0 and math.isfinite(args.local_speed)):   # nan hung the simulation, inf divided by 0
        raise ConfigError(f"--local-speed must be a finite number > 0, got {args.local_speed}")
    if args.cut_fraction is not None and not 0.0 <= args.cut_fraction <= 1.0:
        raise ConfigError(f"--cut-fraction must be in [0, 1], got {args.cut_fraction}")
    for name, v in (("--hidden", args.hidden), ("--heads", args.heads)):
        if v is not None and v < 1:   # 0 read as "the calibration run's" before
            raise ConfigError(f"{name} must be >= 1, got {v}")
    prices = load_prices(args.prices)
    cands = candidates(args)
    n, m, f, c, shape_of = _graph_source(args)
    cands = [check(x, prices, n) for x in cands]
    check_instances(prices, args.ps_instance)
    if not (128 <= args.lambda_memory_mb <= 10240):
        raise ConfigError(f"--lambda-memory-mb must be in [128, 10240], got {args.lambda_memory_mb}")
    costs, cal = calibrate([d for d in args.calibration.split(",") if d] or [args.calibration])
    if cal.cfg.model != args.model:
        raise ConfigError(f"--calibration {args.calibration} ran {cal.cfg.model}, not {args.model}: calibrate with "
                          f"a run of the same model")
    stages = build_stages(args.model, f, c, hidden=args.hidden or cal.cfg.hidden, layers=args.layers,
                          heads=args.heads or cal.cfg.heads).stages
    lam = LambdaSpec(memory_mb=args.lambda_memory_mb)
    net = Network(local_speed=args.local_speed)
    preds = [evaluate(x, shape_of, stages, costs, prices, ps_instance=args.ps_instance, lam=lam, net=net,
                      epochs=args.epochs) for x in cands]
    mark(preds, args.budget)
    meta = {"graph": f"{n} vertices, {m} edges, {f} features, {c} classes", "model": args.model,
            "calibration": str(args.calibration), "budget_usd_per_epoch": args.budget, "prices": prices["source"],
            "lambda": {"memory_mb": lam.memory_mb, "vcpus": lam.vcpus, "bandwidth_bytes_s": lam.bandwidth_bytes_s,
                       "rtt_s": lam.rtt_s, "cold_start_s": lam.cold_start_s, "speed": lam.speed},
            "local_speed": args.local_speed, "ps_instance": args.ps_instance, "costs": costs.to_json()}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rundir.atomic_write_json(out / PLAN_FILE, {**meta, "rows": [p.to_json() for p in preds]})
        write_png(preds, out / PNG_FILE, f"{meta['graph']}, {args.model}")
    text = table_text(preds, args.budget, meta)
    print(json.dumps({**meta, "rows": [p.to_json() for p in preds]}, indent=2) if args.format == "json" else text,
          end="" if args.format != "json" else "\n")
    return 0


def row_config(plan_path: str | Path, row: str) -> dict:
    """The config settings of one row of a plan.json (an index, best-value or fastest), for `deploy render`."""
    path = Path(plan_path)
    if not path.is_file():
        raise ConfigError(f"--plan {path} does not exist (write one with dorylus plan --out DIR)")
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--plan {path} is not a plan.json written by dorylus plan") from None
    if row in ("best-value", "fastest"):
        hits = [r for r in rows if row in r.get("marks", [])]
        if not hits:
            raise ConfigError(f"--plan {path} has no row marked {row} (none was within the budget)")
        r = hits[0]
    else:
        try:
            r = rows[int(row)]
            if int(row) < 0:
                raise IndexError
        except (ValueError, IndexError):
            raise ConfigError(f"--row {row!r}: give a row number 0..{len(rows) - 1}, best-value or fastest") \
                from None
    out = {"partitions": r["graph_servers"], "graph_instance": r["instance"], "staleness": r["staleness"],
           "intervals": r["intervals"]}
    if r["lambdas_per_server"]:
        out.update(mode="serverless", tensor_workers="aws", lambda_concurrency=r["lambdas_per_server"])
    else:
        out.update(mode="cpu-only", tensor_workers=1)
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict epoch time, cost and value of candidate deployments",
                              description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("graph (one of)")
    g.add_argument("--dataset", help="a dataset spec, as for dorylus train")
    g.add_argument("--data-dir")
    g.add_argument("--prepared", metavar="DIR", help="a graph prepared by dorylus prepare")
    g.add_argument("--vertices", type=int)
    g.add_argument("--edges", type=int, help="adjacency nonzeros (directed count, without self-loops)")
    g.add_argument("--features", type=int)
    g.add_argument("--classes", type=int, default=41, help="with sizes (default 41)")
    g.add_argument("--cut-fraction", type=float, help="with sizes: share of edges crossing partitions "
                                                      "(default 0.35, METIS-like)")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["gcn", "gat"], default="gcn")
    g.add_argument("--hidden", type=int)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int)
    g = p.add_argument_group("candidates")
    g.add_argument("--graph-servers", help="comma-separated graph-server counts (default 1,2,4)")
    g.add_argument("--instance", default="c5n.2xlarge", help="comma-separated EC2 types of the graph servers")
    g.add_argument("--lambdas", default="0,32", help="comma-separated Lambdas per graph server (0: cpu-only)")
    g.add_argument("--staleness", default="0,1", help="comma-separated staleness bounds (none: synchronous)")
    g.add_argument("--intervals", help="comma-separated intervals per graph server (default: one per Lambda, "
                                       "at least 2)")
    g.add_argument("--candidate", action="append", help="an explicit candidate P=..,instance=..,lambdas=..,S=..[,K=..]"
                                                        " (repeatable)")
    g.add_argument("--ps-instance", default="c5.xlarge")
    g.add_argument("--lambda-memory-mb", type=int, default=3008)
    g = p.add_argument_group("model inputs and output")
    g.add_argument("--calibration", required=True, metavar="RUN_DIR[,RUN_DIR]",
                   help="measured engine runs (dorylus train --out RUN_DIR ...) whose timelines give task costs; "
                        "two runs of different block sizes (e.g. --intervals 2 and 6) also time each task's fixed "
                        "cost")
    g.add_argument("--local-speed", type=float, default=1.0,
                   help="the calibration machine's core speed relative to a c5 core (default 1.0)")
    g.add_argument("--epochs", type=int, default=4, help="epochs to simulate per candidate (default 4)")
    g.add_argument("--budget", type=float, help="USD per epoch: the fastest candidate within it is marked")
    g.add_argument("--prices", help="price table overriding pipelines/prices.toml")
    g.add_argument("--out", help="write plan.json and plan.png to this directory")
    g.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_plan)
