"""`dorylus report RUN_DIR [RUN_DIR ...]`: a run's summary (time, accuracy, cost, value, usage) as a table.

Several run directories print side by side, with each run's value relative to the first (Dorylus's comparison:
serverless against CPU-only, say). `--prices FILE` re-prices the recorded usage with another table; `--json`
prints the same rows as JSON.

Structure, so that the command can grow (plots come later): `load_run` reads a run directory into a `Run`;
`SECTIONS` is a list of (title, rows-function) pairs, each rows-function mapping a `Run` to (label, value) rows;
`build_table` evaluates them for every run; `render_text` prints. A new output (a plot, say) is another consumer
of the same `Run` objects, added as another flag of `register`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from pipelines.config import ConfigError


@dataclasses.dataclass
class Run:
    path: Path
    summary: dict
    metrics: list[dict]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def cost(self) -> dict:
        return self.summary.get("cost") or {}


def load_run(path: str | Path, prices: dict | None = None) -> Run:
    path = Path(path)
    f = path / "summary.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a run directory (no summary.json)")
    try:
        summary = json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None
    metrics = []
    mf = path / "metrics.jsonl"
    if mf.is_file():
        for line in mf.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line:
                try:
                    metrics.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line of an interrupted run
    if prices is not None and summary.get("cost"):
        from pipelines.engine.cost import reprice

        summary["cost"] = reprice(summary, prices)
    return Run(path, summary, metrics)


# ----------------------------------------------------------------------------------------------------- formatting
def _f(x, fmt="{:.4f}"):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return fmt.format(x)


def _usd(x):
    if x is None:
        return "-"
    return f"${x:.6f}" if abs(x) < 1 else f"${x:,.2f}"


def _bytes(n):
    if n is None:
        return "-"
    for unit, k in (("GB", 1024 ** 3), ("MB", 1024 ** 2), ("KB", 1024)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _sci(x):
    return "-" if x is None else f"{x:.4g}"


# ----------------------------------------------------------------------------------------------------- sections
def _run_rows(r: Run):
    s = r.summary
    ds = s.get("dataset", {})
    return [
        ("dataset", ds.get("name", "-") if isinstance(ds, dict) else str(ds)),
        ("model", s.get("model", "-")),
        ("mode", r.cost.get("mode", "-")),
        ("tensor workers", f"{r.cost.get('tensor_backend', '-')} ({s.get('tensor_workers', '-')})"),
        ("partitions x intervals", f"{s.get('partitions', '-')} x {s.get('intervals', '-')}"),
        ("epochs", _f(s.get("epochs"), "{}")),
        ("best val acc", _f(s.get("best_val_acc"))),
        ("test acc", _f(s.get("test_acc"))),
    ]


def _time_rows(r: Run):
    s = r.summary
    return [("time (s)", _f(s.get("time_s", s.get("seconds")), "{:.2f}")),
            ("median epoch (s)", _f(s.get("epoch_s_median"), "{:.4f}"))]


def _cost_rows(r: Run):
    usd = r.cost.get("usd", {})
    return [("graph servers", _usd(usd.get("graph_servers"))),
            ("parameter server", _usd(usd.get("param_server"))),
            ("lambda compute", _usd(usd.get("lambda_compute"))),
            ("lambda requests", _usd(usd.get("lambda_requests"))),
            ("s3 requests", _usd(usd.get("s3"))),
            ("total", _usd(usd.get("total"))),
            ("per epoch", _usd(r.cost.get("cost_per_epoch_usd")))]


def _value_rows(r: Run, first: Run | None = None):
    v = r.cost.get("value")
    v0 = first.cost.get("value") if first is not None else None
    return [(f"value 1/(s*USD)", _sci(v)),
            ("value vs first run", "-" if not v or not v0 else f"{v / v0:.3f}x")]


def _usage_rows(r: Run):
    u = r.cost.get("usage", {})
    moved = r.cost.get("bytes_moved", {})
    return [("graph instance", f"{u.get('graph_servers', '-')} x {u.get('graph_instance', '-')}"),
            ("param-server instance", f"{u.get('param_servers', '-')} x {u.get('ps_instance', '-')}"),
            ("lambda invocations", _f(u.get("lambda_invocations"), "{:,}")),
            ("lambda billed (s)", _f(None if u.get("lambda_billed_ms") is None else u["lambda_billed_ms"] / 1000,
                                     "{:.2f}")),
            ("lambda memory (MB)", _f(u.get("lambda_memory_mb"), "{}")),
            ("lambda GB-s", _f(u.get("lambda_gb_s"), "{:.2f}")),
            ("s3 PUT / GET", f"{u.get('s3_puts', '-')} / {u.get('s3_gets', '-')}"),
            ("bytes moved", _bytes(moved.get("total")))]


def _busy_rows(r: Run):
    roles = r.cost.get("busy_s_by_role") or {}
    return [(f"busy {k} (s)", _f(v, "{:.2f}")) for k, v in sorted(roles.items())]


def _autotune_rows(r: Run):
    a = r.summary.get("autotune")
    if not a:
        return []
    return [("workers start / final", f"{a['start']} / {a['final']}"),
            ("workers min / max", f"{a['min']} / {a['max']}"),
            ("second-half range", f"{a['second_half_range'][0]}..{a['second_half_range'][1]}")]


SECTIONS: list[tuple[str, Callable]] = [
    ("run", _run_rows),
    ("time", _time_rows),
    ("cost (USD)", _cost_rows),
    ("value", _value_rows),
    ("usage", _usage_rows),
    ("busy seconds", _busy_rows),
    ("autotuning", _autotune_rows),
]


def build_table(runs: list[Run]) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """[(section title, [(row label, [cell per run])])], rows in first-seen order over the runs."""
    out = []
    for title, fn in SECTIONS:
        per_run = [dict(fn(r, runs[0]) if fn is _value_rows else fn(r)) for r in runs]
        labels: list[str] = []
        for d in per_run:
            labels += [k for k in d if k not in labels]
        if labels:
            out.append((title, [(lab, [d.get(lab, "-") for d in per_run]) for lab in labels]))
    return out


def render_text(runs: list[Run], table) -> str:
    heads = [r.name for r in runs]
    wl = max([len(lab) for _, rows in table for lab, _ in rows] + [10]) + 2
    wc = [max([len(h)] + [len(cells[i]) for _, rows in table for _, cells in rows]) + 2 for i, h in enumerate(heads)]
    lines = [" " * wl + "".join(h.rjust(w) for h, w in zip(heads, wc))]
    for title, rows in table:
        lines.append(f"[{title}]")
        for lab, cells in rows:
            lines.append(("  " + lab).ljust(wl) + "".join(c.rjust(w) for c, w in zip(cells, wc)))
    return "\n".join(lines)


def cmd_report(args) -> int:
    prices = None
    if args.prices:
        from pipelines.engine.cost import load_prices

        prices = load_prices(args.prices)
    runs = [load_run(p, prices) for p in args.run_dirs]
    table = build_table(runs)
    if args.json:
        print(json.dumps({"runs": [str(r.path) for r in runs],
                          "sections": {t: {lab: cells for lab, cells in rows} for t, rows in table}}, indent=1))
    else:
        print(render_text(runs, table))
    if not args.no_plots:
        from pipelines.report_plots import write_report  # matplotlib only when plots are drawn

        for r in runs:
            index = write_report(r, build_table([r]))
            if not args.json:
                print(f"report: {index}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="print a run's summary (time, accuracy, cost, value) as a table")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: side by side)")
    p.add_argument("--prices", help="re-price the recorded usage with this price table (TOML)")
    p.add_argument("--json", action="store_true", help="the table as JSON")
    p.add_argument("--no-plots", action="store_true",
                   help="print only; by default each RUN_DIR/report/ gets PNG plots and an index.html")
    p.set_defaults(func=cmd_report)
