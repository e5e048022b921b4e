"""What a run costs on AWS, and its value (Dorylus's performance per dollar: value = 1 / (time x cost)).

The cost model (USD; prices from `pipelines/prices.toml`, or a `--prices FILE` that overrides entries):

- graph servers: `partitions` instances of `graph_instance`, billed for the run's wall time;
- parameter server: one `ps_instance`, billed for the run's wall time;
- tensor tasks, mode "serverless": Lambda GB-seconds of billed duration (per invocation, rounded up to 1 ms)
  x the function's memory, plus the per-request price. With the AWS backend these are the durations Lambda
  reports (`Billed Duration` of each invocation's log tail); with a local pool they are the measured busy time
  of each task on this machine, i.e. what the same run would cost if each task took as long on a Lambda;
- tensor tasks, mode "cpu-only": run by the graph servers themselves, so no Lambda cost (their time is in the
  wall time the graph servers are billed for);
- S3 requests made for payloads over the invoke limit (PUT and GET prices; transfer inside a region is free).

EC2 instances bill per second: a run's server cost is hours x hourly price, with no one-minute minimum, so that
runs of different lengths compare on the same scale. Startup (instance boot, image pull) is not counted.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from pipelines.config import ConfigError

PRICES_FILE = Path(__file__).resolve().parents[1] / "prices.toml"

#: The defaults of prices.toml (used when the file is not installed beside the package).
DEFAULT_PRICES = {
    "lambda": {"gb_second": 0.0000166667, "per_million_requests": 0.20},
    "ec2": {"c5.xlarge": 0.17, "c5.2xlarge": 0.34, "c5n.2xlarge": 0.432, "c5n.4xlarge": 0.864, "p3.2xlarge": 3.06},
    "s3": {"put_per_1000": 0.005, "get_per_1000": 0.0004},
}
_FIXED_KEYS = {"lambda": ("gb_second", "per_million_requests"), "s3": ("put_per_1000", "get_per_1000")}
VALUE_UNITS = "1/(s*USD)"


def _read(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"price table {path} does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"price table {path} is not valid TOML: {e}") from None


def _validate(table: dict, source: str) -> None:
    for section, entries in table.items():
        if section not in DEFAULT_PRICES:
            raise ConfigError(f"price table {source}: unknown section [{section}] (known: lambda, ec2, s3)")
        if not isinstance(entries, dict):
            raise ConfigError(f"price table {source}: [{section}] must be a table")
        for k, v in entries.items():
            if section in _FIXED_KEYS and k not in _FIXED_KEYS[section]:
                raise ConfigError(f"price table {source}: unknown price {section}.{k} "
                                  f"(known: {', '.join(_FIXED_KEYS[section])})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"price table {source}: {section}.{k} must be a number >= 0, got {v!r}")


def load_prices(path: str | Path | None = None) -> dict:
    """The default price table, with the entries of `path` (if given) replacing the defaults one by one."""
    prices = copy.deepcopy(DEFAULT_PRICES)
    if PRICES_FILE.is_file():
        base = _read(PRICES_FILE)
        _validate(base, str(PRICES_FILE))
        for section, entries in base.items():
            prices[section].update(entries)
    prices["source"] = "default (AWS us-east-1 on-demand list prices)"
    if path is not None:
        path = Path(path)
        over = _read(path)
        _validate(over, str(path))
        for section, entries in over.items():
            prices[section].update(entries)
        prices["source"] = str(path)
    return prices


def check_instances(prices: dict, *instances: str) -> None:
    for inst in instances:
        if inst not in prices["ec2"]:
            raise ConfigError(f"instance type {inst!r} has no price in the price table "
                              f"({prices.get('source')}); known: {', '.join(sorted(prices['ec2']))}")


def lambda_gb_s(billed_ms: float, memory_mb: int) -> float:
    """GB-seconds Lambda bills: billed duration x configured memory (MB / 1024)."""
    return billed_ms / 1000.0 * memory_mb / 1024.0


def price_usage(u: dict, prices: dict) -> dict:
    """USD of a usage record (see `CostMeter.usage`): per line item and total."""
    hours = u["time_s"] / 3600.0
    gs = u["graph_servers"] * prices["ec2"][u["graph_instance"]] * hours
    ps = u["param_servers"] * prices["ec2"][u["ps_instance"]] * hours
    gb_s = lambda_gb_s(u["lambda_billed_ms"], u["lambda_memory_mb"])
    lam_c = gb_s * prices["lambda"]["gb_second"]
    lam_r = u["lambda_invocations"] * prices["lambda"]["per_million_requests"] / 1e6
    s3 = u["s3_puts"] * prices["s3"]["put_per_1000"] / 1000 + u["s3_gets"] * prices["s3"]["get_per_1000"] / 1000
    total = gs + ps + lam_c + lam_r + s3
    return {"graph_servers": gs, "param_server": ps, "lambda_compute": lam_c, "lambda_requests": lam_r, "s3": s3,
            "total": total}


def value(time_s: float, cost_usd: float) -> float | None:
    """Dorylus's value: performance per dollar, 1 / (time x cost)."""
    if time_s <= 0 or cost_usd <= 0:
        return None
    return 1.0 / (time_s * cost_usd)


class CostMeter:
    """Reads a tensor-worker pool's counters and prices the run, per epoch and in total."""

    def __init__(self, cfg, prices: dict, pool, graph_servers: int | None = None, param_servers: int = 1,
                 mode: str | None = None):
        self.cfg = cfg
        self.prices = prices
        self.pool = pool
        self.mode = mode or getattr(cfg, "mode", "serverless")
        self.graph_servers = graph_servers if graph_servers is not None else cfg.partitions
        self.param_servers = param_servers
        check_instances(prices, self.graph_instance, self.ps_instance)
        self._last = self._counters()
        self._cum = 0.0

    @property
    def graph_instance(self) -> str:
        return getattr(self.cfg, "graph_instance", "c5n.2xlarge")

    @property
    def ps_instance(self) -> str:
        return getattr(self.cfg, "ps_instance", "c5.xlarge")

    def _counters(self) -> dict:
        st = self.pool.stats() if self.pool is not None else {}
        lam = self.mode == "serverless" and self.pool is not None and st.get("billing", "lambda") == "lambda"
        return {"lambda_invocations": int(st.get("invocations", st.get("tasks", 0))) if lam else 0,
                "lambda_billed_ms": float(st.get("billed_ms", 0)) if lam else 0.0,
                "s3_puts": int(st.get("s3_puts", 0)), "s3_gets": int(st.get("s3_gets", 0)),
                "lambda_memory_mb": int(st.get("memory_mb") or getattr(self.cfg, "lambda_memory_mb", 3008))}

    def usage(self, time_s: float, counters: dict | None = None) -> dict:
        c = self._counters() if counters is None else counters
        return {"time_s": time_s, "graph_servers": self.graph_servers, "graph_instance": self.graph_instance,
                "param_servers": self.param_servers, "ps_instance": self.ps_instance, **c,
                "lambda_gb_s": lambda_gb_s(c["lambda_billed_ms"], c["lambda_memory_mb"])}

    def epoch(self, epoch_s: float) -> dict:
        """Cost and value of the epoch that just ended (epoch_s of wall time, counters since the last call)."""
        now = self._counters()
        delta = {k: (now[k] - self._last[k]) if k != "lambda_memory_mb" else now[k] for k in now}
        self._last = now
        usd = price_usage(self.usage(epoch_s, delta), self.prices)["total"]
        self._cum += usd
        return {"cost_usd": usd, "cum_cost_usd": self._cum, "value": value(epoch_s, usd),
                "lambda_invocations": delta["lambda_invocations"],
                "lambda_gb_s": lambda_gb_s(delta["lambda_billed_ms"], delta["lambda_memory_mb"])}

    def summary(self, time_s: float, epochs: int, transport_stats: dict | None = None,
                busy: dict | None = None) -> dict:
        u = self.usage(time_s)
        usd = price_usage(u, self.prices)
        moved = dict((transport_stats or {}).get("bytes", {}))
        st = self.pool.stats() if self.pool is not None else {}
        if st.get("billing") == "server":  # cpu-only: tensor tasks stay inside their graph server
            inproc = {k: moved.pop(k) for k in ("tensor", "tensor.out") if k in moved}
            if inproc:
                moved["in_process"] = inproc
        for k in ("bytes_sent", "bytes_received", "s3_bytes_put", "s3_bytes_get"):
            if k in st:
                moved[f"lambda.{k}"] = st[k]
        moved["total"] = sum(v for v in moved.values() if not isinstance(v, dict))
        out = {
            "mode": self.mode,
            "tensor_backend": st.get("backend", "local") if self.pool is not None else "none",
            "prices": self.prices.get("source"),
            "time_s": time_s,
            "epochs": epochs,
            "usage": {**u, "server_hours": time_s / 3600.0 * (self.graph_servers + self.param_servers)},
            "bytes_moved": moved,
            "usd": usd,
            "cost_usd": usd["total"],
            "cost_per_epoch_usd": usd["total"] / max(epochs, 1),
            "value": value(time_s, usd["total"]),
            "value_units": VALUE_UNITS,
        }
        rr = st.get("runtime_reports")
        if rr:  # the runtimes' own billed durations, beside the cost model's figure in usage.lambda_gb_s
            out["runtime_reported"] = {
                "source": rr["source"], "lambda_gb_s": rr["gb_s"], "lambda_billed_ms": rr["billed_ms"],
                "memory_mb": rr["memory_mb"], "invocations": rr["invocations_reported"], "unreported": rr["unreported"],
                "cost_model_lambda_gb_s": u["lambda_gb_s"]}
            # the ratio over the same invocations: those with a REPORT line, as the cost model billed each
            model_ms = rr.get("cost_model_billed_ms")
            model_gb_s = lambda_gb_s(model_ms, u["lambda_memory_mb"]) if model_ms else u["lambda_gb_s"]
            out["runtime_reported"].update(cost_model_same_invocations_gb_s=model_gb_s,
                                           ratio_to_cost_model=rr["gb_s"] / model_gb_s if model_gb_s else None)
        if busy is not None:
            roles: dict[str, float] = {}
            for k, v in busy.items():
                role = k.split(".", 1)[0]
                roles[role] = roles.get(role, 0.0) + v
            out["busy_s_by_role"] = roles
        return out


def add_whole_graph_cost(cfg, summary: dict, history: list[dict], out=None) -> dict:
    """Cost and value of a whole-graph (single machine, no separation) run: one server of `graph_instance` for
    the run's time, nothing else. Adds them to the summary and, with a run directory, to summary.json and every
    metrics.jsonl row."""
    meter = CostMeter(cfg, load_prices(getattr(cfg, "prices", None)), None, graph_servers=1, param_servers=0,
                      mode="single-machine")
    rows = [{**r, **meter.epoch(r["epoch_s"])} for r in history if "epoch_s" in r]
    summary["cost"] = meter.summary(summary["seconds"], len(history))
    summary.update(time_s=summary["seconds"], cost_usd=summary["cost"]["cost_usd"],
                   cost_per_epoch_usd=summary["cost"]["cost_per_epoch_usd"], value=summary["cost"]["value"])
    if out is not None:
        import json

        from pipelines import rundir

        rundir.atomic_write_json(Path(out) / "summary.json", summary)
        if rows and (Path(out) / "metrics.jsonl").is_file():
            rundir.atomic_write_text(Path(out) / "metrics.jsonl",
                                     "".join(json.dumps(r, default=rundir._json_default) + "\n" for r in rows))
    return summary


def reprice(summary: dict, prices: dict) -> dict:
    """The cost block of a finished run's summary, priced with another table (for `dorylus report --prices`)."""
    cost = dict(summary["cost"])
    u = cost["usage"]
    check_instances(prices, u["graph_instance"], u["ps_instance"])
    usd = price_usage(u, prices)
    cost.update(usd=usd, cost_usd=usd["total"], cost_per_epoch_usd=usd["total"] / max(cost.get("epochs", 1), 1),
                value=value(cost["time_s"], usd["total"]), prices=prices.get("source"))
    return cost


def usd_str(x: Any) -> str:
    if x is None:
        return "-"
    return f"${x:.6f}" if x < 1 else f"${x:,.2f}"
