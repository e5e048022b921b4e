"""The plots and the HTML page of `dorylus report`: `RUN_DIR/report/` with PNGs and an `index.html`.

- `loss.png`: training loss (and validation loss) per epoch, and seconds per epoch;
- `accuracy.png`: train / validation / test accuracy per epoch, the best validation epoch marked;
- `timeline.png`: the pipeline timeline from `timeline.jsonl` (engine runs): one lane per graph server (a row for
  its SC/∇SC, one per vertex interval for its GA/∇GA and the waits of its next step on a gate: ghost watermark,
  gradient watermark, weights, local intervals, sync barrier), the tensor-worker group (tasks from dispatch to
  result, packed into rows of concurrent tasks; the solid part is the worker's compute, the pale part queueing
  and transfer) and the parameter server (WU). A whole-graph run has one lane, one span per epoch;
- `staleness.png`: the observed staleness per epoch against the bound S, and the seconds intervals spent
  waiting per epoch, by gate;
- `cost.png`: the run's USD by component, and busy seconds by role and stage.

matplotlib's object API on the Agg canvas (no pyplot, no global backend state); the page is self-contained
(inline CSS, the PNGs beside it, nothing fetched from a network).
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pipelines.engine.spans import read as read_spans

DPI = 100

KIND_COLORS = {
    "GA": "#1f77b4", "GA_BWD": "#6baed6", "SC": "#2ca02c", "SC_BWD": "#98df8a",
    "AV": "#ff7f0e", "AV_BWD": "#fdae6b", "AE": "#9467bd", "AE_BWD": "#c5b0d5",
    "LAST": "#d62728", "LOSS": "#e377c2", "WU": "#8c564b", "EPOCH": "#1f77b4",
}
GATE_COLORS = {"ghosts": "#fcbba1", "ghost_grads": "#fdd0a2", "weights": "#fff3b0", "local": "#e0e0e0",
               "barrier": "#dadaeb", None: "#e0e0e0"}
GATE_LABELS = {"ghosts": "wait: ghost watermark", "ghost_grads": "wait: gradient watermark",
               "weights": "wait: weight version", "local": "wait: local intervals", "barrier": "wait: sync barrier"}


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI)


def _series(metrics: list[dict], key: str):
    xs = [m["epoch"] for m in metrics if m.get(key) is not None]
    ys = [m[key] for m in metrics if m.get(key) is not None]
    return xs, ys


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


# ------------------------------------------------------------------------------------------------------ curves
def wu_cadence(spans: list[dict]) -> tuple[list[int], list[float]]:
    """Seconds between the parameter server's publications of consecutive weight versions (the pipeline's epoch
    time as the parameter server sees it; the driver's epoch_s bunches up while it evaluates)."""
    ends = {}
    for s in spans:
        if s["kind"] == "WU":
            ends[s["epoch"]] = max(ends.get(s["epoch"], 0.0), s["t1"])
    xs, ys = [], []
    for e in sorted(ends):
        if e - 1 in ends:
            xs.append(e)
            ys.append(ends[e] - ends[e - 1])
        elif e == 0:
            xs.append(0)
            ys.append(ends[0])
    return xs, ys


def plot_loss(run, path: Path, spans: list[dict] | None = None) -> None:
    fig = Figure(figsize=(8, 5.5))
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for key, label, style in (("loss", "training loss", "-"), ("val_loss", "validation loss", "--")):
        xs, ys = _series(run.metrics, key)
        if xs:
            ax.plot(xs, ys, style, label=label, marker="." if len(xs) < 40 else None)
    if not run.metrics:
        _no_data(ax, "no metrics.jsonl")
    else:
        ax.legend(loc="upper right")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.set_title(f"{run.name}: loss per epoch")
    xs, ys = _series(run.metrics, "epoch_s")
    wx, wy = wu_cadence(spans or [])
    if xs:
        ax2.bar(xs, ys, color="#9ecae1", width=0.8, label="driver: epoch_s")
        if wx:
            ax2.plot(wx, wy, "o-", color="#8c564b", ms=3, lw=1, label="parameter server: WU to WU")
            ax2.legend(loc="upper right", fontsize=7)
        both = ys + wy
        ax2.set_yscale("log" if len(both) > 1 and max(both) > 20 * max(min(both), 1e-9) else "linear")
    ax2.set_ylabel("epoch (s)")
    ax2.set_xlabel("epoch")
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    _save(fig, path)


def plot_accuracy(run, path: Path) -> None:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for key, label in (("train_acc", "train"), ("val_acc", "validation"), ("test_acc", "test")):
        xs, ys = _series(run.metrics, key)
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 40 else None)
    best = run.summary.get("best_epoch")
    if best is not None and run.metrics:
        ax.axvline(best, color="#999999", ls=":", lw=1)
        ax.annotate(f"best val {run.summary.get('best_val_acc', 0):.3f}\ntest {run.summary.get('test_acc', 0):.3f}",
                    xy=(best, run.summary.get("best_val_acc", 0)), xytext=(5, -30), textcoords="offset points",
                    fontsize=8, color="#444444")
    if not run.metrics:
        _no_data(ax, "no metrics.jsonl")
    else:
        ax.legend(loc="lower right")
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"{run.name}: accuracy per epoch")
    fig.tight_layout()
    _save(fig, path)


# ------------------------------------------------------------------------------------------------------ timeline
def _pack(spans: list[dict]) -> list[int]:
    """Greedy interval packing: a row for each span such that spans in one row do not overlap."""
    ends: list[float] = []
    rows = []
    for s in spans:
        for r, end in enumerate(ends):
            if end <= s["t0"]:
                ends[r] = s["t1"]
                rows.append(r)
                break
        else:
            ends.append(s["t1"])
            rows.append(len(ends) - 1)
    return rows


def timeline_window(spans: list[dict], max_epochs: int = 3) -> tuple[int, int]:
    """The epochs the timeline shows: the last `max_epochs` recorded ones (the steady state), without the first
    epochs (compilation: the first tasks of every kind and the first WU compile) when later epochs exist."""
    epochs = sorted({s["epoch"] for s in spans})
    if not epochs:
        return 0, -1
    hi = epochs[-1]
    first = epochs[0] if len(epochs) == 1 else epochs[1] if len(epochs) <= 3 else epochs[2]
    return max(first, hi - max_epochs + 1), hi


def whole_graph_spans(metrics: list[dict]) -> list[dict]:
    """A whole-graph run's single lane: one span per epoch from the recorded epoch seconds."""
    out, t = [], 0.0
    for m in metrics:
        dt = float(m.get("epoch_s") or 0.0)
        out.append({"lane": "whole-graph trainer", "kind": "EPOCH", "epoch": m["epoch"], "interval": -1,
                    "t0": t, "t1": t + dt})
        t += dt
    return out


def _lane_key(name):
    if name.startswith("graph-server-"):
        return (0, int(name.rsplit("-", 1)[1]))
    return ({"tensor-workers": 1, "param-server": 2}.get(name, 3), name)


def _timeline_rows(lanes: dict[str, list[dict]], max_rows_per_lane: int):
    """(rows, placed): the (lane, row label) rows from the top, and each span with its row index."""
    rows: list[tuple[str, str]] = []
    placed: list[tuple[int, dict]] = []
    for lane in sorted(lanes, key=_lane_key):
        ss = sorted(lanes[lane], key=lambda s: s["t0"])
        base = len(rows)
        if lane.startswith("graph-server-"):
            intervals = sorted({s["interval"] for s in ss if s["interval"] >= 0})
            n_iv = min(len(intervals), max_rows_per_lane)
            rows.append((lane, "SC"))
            rows += [(lane, f"i{iv}" if n_iv == len(intervals) else f"i{k}+") for k, iv in
                     enumerate(intervals[:n_iv])]
            pos = {iv: k % n_iv for k, iv in enumerate(intervals)} if n_iv else {}
            for s in ss:
                placed.append((base if s["interval"] < 0 else base + 1 + pos[s["interval"]], s))
        elif lane == "tensor-workers":
            packed = _pack(ss)
            n = max(packed) + 1 if packed else 1
            fold = min(n, max_rows_per_lane)
            rows += [(lane, f"slot {k}") for k in range(fold)]
            placed += [(base + r % fold, s) for r, s in zip(packed, ss)]
        else:
            rows.append((lane, ""))
            placed += [(base, s) for s in ss]
    return rows, placed


def _draw_bars(ax, placed, t_origin: float, y) -> tuple[set, set]:
    """The spans as bars, grouped per (row, colour) so each group is one broken_barh call; returns the task
    kinds and wait gates drawn."""
    groups: dict[tuple, list] = {}
    for r, s in placed:
        t0, t1 = s["t0"] - t_origin, s["t1"] - t_origin
        w = max(t1 - t0, 1e-4)
        if s["kind"] == "WAIT":
            groups.setdefault((r, "wait", s.get("gate")), []).append((t0, w))
        elif s["lane"] == "tensor-workers":
            busy = s.get("busy")
            groups.setdefault((r, "queued", s["kind"]), []).append((t0, w))
            if busy:
                b = min(float(busy), w)
                groups.setdefault((r, "task", s["kind"]), []).append((t0 + w - b, b))
        else:
            groups.setdefault((r, "task", s["kind"]), []).append((t0, w))
    edge = {"EPOCH": ("white", 1.0)}  # whole-graph epochs abut: white borders tell them apart
    kinds_seen, gates_seen = set(), set()
    for (r, what, k), bars in groups.items():
        if what == "wait":
            gates_seen.add(k)
            ax.broken_barh(bars, (y(r) - 0.3, 0.6), facecolors=GATE_COLORS.get(k, "#e0e0e0"),
                           edgecolor="none")
        elif what == "queued":
            kinds_seen.add(k)
            ax.broken_barh(bars, (y(r) - 0.4, 0.8), facecolors=KIND_COLORS.get(k, "#7f7f7f"), alpha=0.3,
                           edgecolor="none")
        else:
            kinds_seen.add(k)
            ec, lw = edge.get(k, ("none", 0.0))
            ax.broken_barh(bars, (y(r) - 0.4, 0.8), facecolors=KIND_COLORS.get(k, "#7f7f7f"), edgecolor=ec,
                           linewidth=lw)
    return kinds_seen, gates_seen


def _label_lanes(ax, rows, y) -> None:
    """One tick per row (small), lane names on the left, separators between lanes."""
    ax.set_yticks([y(r) for r in range(len(rows))])
    ax.set_yticklabels([lab for _, lab in rows], fontsize=6)
    prev = None
    for r, (lane, _) in enumerate(rows):
        if lane != prev:
            if r:
                ax.axhline(y(r) + 0.5, color="#444444", lw=0.6)
            span_rows = [k for k, (ln, _) in enumerate(rows) if ln == lane]
            mid = (y(span_rows[0]) + y(span_rows[-1])) / 2
            ax.text(-0.065, mid, lane, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=8,
                    fontweight="bold")
            prev = lane


def _timeline_legend(ax, kinds_seen, gates_seen, placed, shown) -> None:
    handles = [Patch(facecolor=KIND_COLORS.get(k, "#7f7f7f"), label=k) for k in KIND_COLORS if k in kinds_seen]
    handles += [Patch(facecolor=GATE_COLORS[g], label=GATE_LABELS.get(g, "wait"))
                for g in GATE_LABELS if g in gates_seen]
    if any(s["lane"] == "tensor-workers" for _, s in placed):
        handles.append(Patch(facecolor="#ff7f0e", alpha=0.3, label="tensor task queued / in transit"))
    if any(s["kind"] == "WU" for s in shown):
        handles.append(Line2D([], [], color="#8c564b", ls=":", label="epoch published (WU)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)


def plot_timeline(run, spans: list[dict], path: Path, max_epochs: int = 3, max_rows_per_lane: int = 16) -> dict:
    """Draw the pipeline timeline of `spans` (timeline.jsonl rows) into `path`: the last `max_epochs` epochs,
    at most `max_rows_per_lane` rows a lane; returns what it drew (window, lanes, span count)."""
    lo, hi = timeline_window(spans, max_epochs)
    shown = [s for s in spans if lo <= s["epoch"] <= hi]
    lanes: dict[str, list[dict]] = {}
    for s in shown:
        lanes.setdefault(s["lane"], []).append(s)
    rows, placed = _timeline_rows(lanes, max_rows_per_lane)
    n_rows = max(len(rows), 1)
    fig = Figure(figsize=(12, max(3.0, 1.2 + 0.22 * n_rows)))
    ax = fig.subplots()
    if not placed:
        _no_data(ax, "no timeline recorded (timeline.jsonl missing or empty)")
        ax.set_title(f"{run.name}: pipeline timeline")
        fig.tight_layout()
        _save(fig, path)
        return {"window": [lo, hi], "lanes": [], "spans": 0}

    # The axis starts at the first shown task: a wait that began earlier (on the previous epochs) is cut there.
    t_origin = min((s["t0"] for _, s in placed if s["kind"] != "WAIT"), default=min(s["t0"] for _, s in placed))
    t_end = max(s["t1"] for _, s in placed)
    y = lambda r: n_rows - 1 - r  # first row on top
    kinds_seen, gates_seen = _draw_bars(ax, placed, t_origin, y)
    # Epoch ends: the parameter server's WU of each shown epoch.
    for s in shown:
        if s["kind"] == "WU":
            ax.axvline(s["t1"] - t_origin, color="#8c564b", ls=":", lw=0.8)
    _label_lanes(ax, rows, y)
    ax.set_ylim(-0.6, n_rows - 0.4)
    ax.set_xlim(-0.01 * (t_end - t_origin), 1.01 * (t_end - t_origin))
    ax.set_xlabel(f"seconds (from the first shown span, {t_origin:.2f} s into the run)")
    ep = f"epoch {lo}" if lo == hi else f"epochs {lo}-{hi}"
    skipped = f" (epochs < {lo} not shown)" if lo > 0 else ""
    ax.set_title(f"{run.name}: pipeline timeline, {ep}{skipped}", fontsize=10)
    ax.grid(alpha=0.25, axis="x")
    _timeline_legend(ax, kinds_seen, gates_seen, placed, shown)
    fig.subplots_adjust(left=0.17, right=0.83, top=1 - 0.45 / fig.get_figheight(),
                        bottom=0.55 / fig.get_figheight())
    _save(fig, path)
    return {"window": [lo, hi], "lanes": sorted(lanes, key=_lane_key), "spans": len(shown)}


# ------------------------------------------------------------------------------------------------------ staleness
def plot_staleness(run, spans: list[dict], path: Path) -> None:
    fig = Figure(figsize=(8, 5.5))
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    xs, ys = _series(run.metrics, "max_staleness_observed")
    S = run.summary.get("staleness")
    if xs:
        ax.step(xs, ys, where="mid", label="max staleness observed (epochs)", color="#d62728")
        xs2, ys2 = _series(run.metrics, "interval_epoch_spread")
        if xs2:
            ax.step(xs2, ys2, where="mid", label="interval epoch spread", color="#1f77b4", ls="--")
        if isinstance(S, int):
            ax.axhline(S, color="#555555", ls=":", label=f"bound S = {S}")
        ax.set_ylim(-0.2, max([*ys, S if isinstance(S, int) else 0, 1]) + 0.5)
        ax.legend(loc="upper left", fontsize=8)
    else:
        _no_data(ax, "no staleness recorded (the whole-graph trainer is synchronous: staleness 0)")
    ax.set_ylabel("epochs")
    bound = " (synchronous: S = none)" if S == "none" else (f" (bound S = {S})" if S is not None else "")
    ax.set_title(f"{run.name}: observed staleness per epoch{bound}")
    ax.grid(alpha=0.3)
    waits: dict[str, dict[int, float]] = {}
    for s in spans:
        if s["kind"] == "WAIT":
            d = waits.setdefault(s.get("gate") or "other", {})
            d[s["epoch"]] = d.get(s["epoch"], 0.0) + (s["t1"] - s["t0"])
    if waits:
        # As a share of the epoch's interval-time (intervals x the epoch's extent: its first span's start to its
        # last span's end), so compilation epochs do not dwarf the rest: 1.0 means every interval waited
        # throughout the epoch.
        n_iv = len({(s["lane"], s["interval"]) for s in spans if s["lane"].startswith("graph-server-")
                    and s["interval"] >= 0}) or 1
        lo_t, hi_t = {}, {}
        for s in spans:
            if s["lane"] != "param-server":
                lo_t[s["epoch"]] = min(lo_t.get(s["epoch"], s["t0"]), s["t0"])
                hi_t[s["epoch"]] = max(hi_t.get(s["epoch"], s["t1"]), s["t1"])
        epoch_s = {e: hi_t[e] - lo_t[e] for e in lo_t}
        epochs = sorted({e for d in waits.values() for e in d})
        bottom = [0.0] * len(epochs)
        for g in [g for g in GATE_LABELS if g in waits] + [g for g in waits if g not in GATE_LABELS]:
            vals = [waits[g].get(e, 0.0) / (n_iv * epoch_s[e]) if epoch_s.get(e) else 0.0 for e in epochs]
            ax2.bar(epochs, vals, bottom=bottom, color=GATE_COLORS.get(g, "#cccccc"), edgecolor="#888888",
                    lw=0.3, label=GATE_LABELS.get(g, g))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.legend(loc="upper right", fontsize=7)
        ax2.set_ylabel("share of interval time waiting")
        ax2.set_ylim(0, 1.0)
    else:
        _no_data(ax2, "no waits recorded")
    ax2.set_xlabel("epoch")
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    _save(fig, path)


# ------------------------------------------------------------------------------------------------------ cost
COST_LABELS = [("graph_servers", "graph servers"), ("param_server", "parameter server"),
               ("lambda_compute", "lambda compute"), ("lambda_requests", "lambda requests"), ("s3", "S3 requests")]


def plot_cost(run, path: Path) -> None:
    fig = Figure(figsize=(10, 4.2))
    ax, ax2 = fig.subplots(1, 2)
    usd = (run.summary.get("cost") or {}).get("usd") or {}
    if usd:
        labels = [lab for k, lab in COST_LABELS if k in usd]
        vals = [float(usd[k]) for k, _ in COST_LABELS if k in usd]
        colors = {"graph_servers": "#1f77b4", "param_server": "#8c564b", "lambda_compute": "#ff7f0e",
                  "lambda_requests": "#fdae6b", "s3": "#7f7f7f"}
        bars = ax.barh(labels[::-1], vals[::-1], color=[colors[k] for k, _ in COST_LABELS if k in usd][::-1])
        total = usd.get("total", sum(vals))
        for b, v in zip(bars, vals[::-1]):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" ${v:.4g}", va="center", fontsize=7)
        ax.set_xlim(0, max(vals + [1e-12]) * 1.35)
        value = run.summary.get("cost", {}).get("value")
        ax.set_title(f"cost: ${total:.4g} total" + (f", value {value:.3g} 1/(s*USD)" if value else ""), fontsize=9)
        ax.set_xlabel("USD")
    else:
        _no_data(ax, "no cost recorded")
        ax.set_title("cost", fontsize=9)
    busy = run.summary.get("busy_s") or (run.summary.get("cost") or {}).get("busy_s_by_role") or {}
    if busy:
        keys = sorted(busy)
        ax2.barh(keys[::-1], [busy[k] for k in keys][::-1], color="#9ecae1")
        ax2.set_xlabel("busy seconds")
        util = run.summary.get("utilization") or {}
        ttl = "\n".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in util.items())
        ax2.set_title("busy time by role/stage", fontsize=9)
        if ttl:
            ax2.text(0.97, 0.03, "utilization\n" + ttl, transform=ax2.transAxes, ha="right", va="bottom",
                     fontsize=7, color="#444444", bbox={"facecolor": "white", "edgecolor": "#dddddd"})
        ax2.tick_params(axis="y", labelsize=7)
    else:
        _no_data(ax2, "no busy time recorded")
        ax2.set_title("busy time by role/stage", fontsize=9)
    fig.suptitle(f"{run.name}: cost breakdown", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


# ------------------------------------------------------------------------------------------------------ page
PLOTS = [("loss.png", "Loss per epoch"), ("accuracy.png", "Accuracy per epoch"),
         ("timeline.png", "Pipeline timeline"), ("staleness.png", "Observed staleness"),
         ("cost.png", "Cost breakdown")]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1250px;
color:#222;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.meta{color:#666;font-size:.9em}
table{border-collapse:collapse;font-size:.88em;margin-top:.5em}
td,th{padding:.2em .8em;border-bottom:1px solid #eee;text-align:left}
td.v{text-align:right;font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
tr.sec th{background:#f4f4f4;font-weight:600;padding-top:.5em}
figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.85em}
"""


def render_html(run, table, plots: list[tuple[str, str, str]]) -> str:
    """The page: the summary table (from `pipelines.report.build_table`) and each plot with its caption."""
    e = html.escape
    rows = []
    for title, trs in table:
        rows.append(f'<tr class="sec"><th colspan="2">{e(title)}</th></tr>')
        for lab, cells in trs:
            rows.append(f'<tr><td>{e(lab)}</td><td class="v">{e(str(cells[0]))}</td></tr>')
    figs = "\n".join(f'<h2>{e(title)}</h2>\n<figure><img src="{e(fn)}" alt="{e(title)}">'
                     f"<figcaption>{e(caption)}</figcaption></figure>" for fn, title, caption in plots)
    s = run.summary
    meta = f"{s.get('engine', '-')} engine, {s.get('model', '-')}, {s.get('epochs', '-')} epochs"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dorylus report: {e(run.name)}</title>
<style>{CSS}</style></head>
<body>
<h1>dorylus report: {e(run.name)}</h1>
<p class="meta">{e(str(run.path))} &middot; {e(meta)}</p>
<h2>Summary</h2>
<table>
{chr(10).join(rows)}
</table>
{figs}
</body></html>
"""


CAPTIONS = {
    "loss.png": "Training loss (and validation loss) per epoch; below, seconds per epoch (epoch 0 includes "
                "compilation): the driver's epoch_s and, for engine runs, the time between the parameter "
                "server's publications of consecutive weight versions.",
    "accuracy.png": "Train, validation and test accuracy per epoch; the dotted line marks the best validation "
                    "epoch, whose weights are kept.",
    "timeline.png": "One lane per graph server (SC/∇SC row, then one row per vertex interval: GA/∇GA and the "
                    "waits of the interval's next step on a gate), the tensor-worker group (tasks from dispatch "
                    "to result packed into rows of concurrent tasks; solid: the worker's compute) and the "
                    "parameter server (WU; dotted lines: a new weight version is published).",
    "staleness.png": "Top: the largest staleness a gather read so far (epochs), against the bound S, and the "
                     "spread of the intervals' epochs when the epoch completed. Bottom: the share of the epoch's "
                     "interval time (intervals x the epoch's extent on the timeline) spent waiting, by gate.",
    "cost.png": "What the run costs on AWS (prices.toml) by component, and the busy seconds by role and stage.",
}


def write_report(run, table, out_dir: Path | None = None) -> Path:
    """Write `RUN_DIR/report/` (or out_dir): the PNGs and index.html. Returns the index.html path."""
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    spans = read_spans(run.path / "timeline.jsonl")
    whole = not spans
    if whole:
        spans = whole_graph_spans(run.metrics)
    plot_loss(run, out / "loss.png", None if whole else spans)
    plot_accuracy(run, out / "accuracy.png")
    drawn = plot_timeline(run, spans, out / "timeline.png", max_epochs=10 ** 9 if whole else 3)
    plot_staleness(run, [] if whole else spans, out / "staleness.png")
    plot_cost(run, out / "cost.png")
    captions = dict(CAPTIONS)
    if whole:
        captions["timeline.png"] = ("The whole-graph trainer has one lane: one span per epoch (no pipeline to "
                                    "draw; engine runs record GA/AV/SC/AE/WU spans).")
    plots = [(fn, title, captions[fn]) for fn, title in PLOTS]
    index = out / "index.html"
    index.write_text(render_html(run, table, plots), encoding="utf-8")
    (out / "report.json").write_text(json.dumps({"plots": [fn for fn, _ in PLOTS], "timeline": drawn}, indent=1),
                                     encoding="utf-8")
    return index
