"""Candidate deployments: parsing (grid flags or explicit specs), simulation, and pricing by the engine's cost model.

A candidate is (graph servers P, instance type, Lambdas per graph server L, staleness S, intervals K). L = 0 is
the CPU-only deployment (`--mode cpu-only`: the graph servers run the tensor tasks, one executor each); L > 0
puts the tensor tasks on Lambdas, at most P x L in flight. Cost per epoch: `pipelines.engine.cost.price_usage`
of the simulated epoch (instances for its wall time, Lambda GB-seconds of the invocations' durations and
requests), value = 1 / (epoch time x cost per epoch), as `dorylus train` reports for measured runs.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re

from pipelines.config import ConfigError, parse_staleness
from pipelines.engine.cost import check_instances, lambda_gb_s, price_usage, value
from pipelines.plan.calibrate import Costs
from pipelines.plan.cluster import INSTANCES, Layout, LambdaSpec, Network
from pipelines.plan.shape import Shape
from pipelines.plan.sim import simulate

SPEC_KEYS = {"p": "partitions", "graph_servers": "partitions", "partitions": "partitions", "instance": "instance",
             "lambdas": "lambdas", "l": "lambdas", "s": "staleness", "staleness": "staleness", "k": "intervals",
             "intervals": "intervals"}
MAX_PARTITIONS = 256
MAX_LAMBDAS = 1000


@dataclasses.dataclass(frozen=True)
class Candidate:
    partitions: int
    instance: str
    lambdas: int              # per graph server; 0: cpu-only
    staleness: int | None
    intervals: int

    @property
    def label(self) -> str:
        s = "none" if self.staleness is None else self.staleness
        lam = f"{self.lambdas} λ/GS" if self.lambdas else "cpu-only"
        return f"{self.partitions}x{self.instance} {lam} S={s} K={self.intervals}"

    def to_json(self) -> dict:
        return {"graph_servers": self.partitions, "instance": self.instance, "lambdas_per_server": self.lambdas,
                "staleness": "none" if self.staleness is None else self.staleness, "intervals": self.intervals,
                "mode": "cpu-only" if self.lambdas == 0 else "serverless"}


def _int(key: str, v: str, lo: int, hi: int) -> int:
    try:
        n = int(v)
    except ValueError:
        raise ConfigError(f"candidate {key}: {v!r} is not an integer") from None
    if not lo <= n <= hi:
        raise ConfigError(f"candidate {key}: {n} is outside [{lo}, {hi}]")
    return n


def default_intervals(lambdas: int) -> int:
    """Intervals per graph server when not given: one per Lambda (each interval has one task in flight, so more
    Lambdas than intervals would idle), two for cpu-only (so GA of one interval overlaps AV of the other)."""
    return max(lambdas, 2)


def check(c: Candidate, prices: dict, shape_vertices: int) -> Candidate:
    if c.instance not in INSTANCES:
        raise ConfigError(f"candidate instance {c.instance!r}: no hardware figures (known: "
                          f"{', '.join(sorted(INSTANCES))})")
    if INSTANCES[c.instance].gpu:
        raise ConfigError(f"candidate instance {c.instance!r} is a GPU instance; the plan models CPU graph servers")
    check_instances(prices, c.instance)
    if c.partitions * c.intervals > shape_vertices:
        raise ConfigError(f"candidate {c.label}: {c.partitions * c.intervals} intervals exceed the graph's "
                          f"{shape_vertices} vertices")
    return c


def parse_spec(text: str) -> Candidate:
    """One candidate from `P=4,instance=c5n.2xlarge,lambdas=80,S=1[,K=80]`."""
    vals: dict = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        if "=" not in part:
            raise ConfigError(f"candidate {text!r}: {part!r} is not KEY=VALUE (keys: P, instance, lambdas, S, K)")
        k, v = (x.strip() for x in part.split("=", 1))
        if "=" in v or " " in v or not v:
            raise ConfigError(f"candidate {text!r}: {part!r} is not KEY=VALUE (separate settings with commas)")
        key = SPEC_KEYS.get(k.lower())
        if key is None:
            raise ConfigError(f"candidate {text!r}: unknown key {k!r} (keys: P, instance, lambdas, S, K)")
        if key in vals:
            raise ConfigError(f"candidate {text!r}: {k} given twice")
        vals[key] = v
    for need in ("partitions", "instance"):
        if need not in vals:
            raise ConfigError(f"candidate {text!r}: no {'P' if need == 'partitions' else need}")
    lam = _int("lambdas", vals.get("lambdas", "0"), 0, MAX_LAMBDAS)
    k = _int("K", vals["intervals"], 1, 100_000) if "intervals" in vals else default_intervals(lam)
    return Candidate(_int("P", vals["partitions"], 1, MAX_PARTITIONS), vals["instance"], lam,
                     parse_staleness(vals.get("staleness", "0")), k)


def _list(flag: str, text: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise ConfigError(f"{flag}: {text!r} is not a comma-separated list")
    return items


def grid(graph_servers: str, instances: str, lambdas: str, staleness: str, intervals: str | None) -> list:
    """The product of the grid flags (each a comma-separated list)."""
    ps = [_int("--graph-servers", x, 1, MAX_PARTITIONS) for x in _list("--graph-servers", graph_servers)]
    insts = _list("--instance", instances)
    for i in insts:
        if not re.match(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$", i):
            raise ConfigError(f"--instance: {i!r} is not an EC2 instance type (like c5n.2xlarge)")
    lams = [_int("--lambdas", x, 0, MAX_LAMBDAS) for x in _list("--lambdas", lambdas)]
    ss = [parse_staleness(x) for x in _list("--staleness", staleness)]
    ks = [_int("--intervals", x, 1, 100_000) for x in _list("--intervals", intervals)] if intervals else [None]
    out = []
    for p, inst, lam, s, k in itertools.product(ps, insts, lams, ss, ks):
        out.append(Candidate(p, inst, lam, s, k if k is not None else default_intervals(lam)))
    return list(dict.fromkeys(out))


@dataclasses.dataclass
class Prediction:
    candidate: Candidate
    epoch_s: float
    first_epoch_s: float
    usage: dict
    usd: dict
    cost_per_epoch: float
    value: float | None
    utilization: dict
    marks: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {**self.candidate.to_json(), "label": self.candidate.label, "epoch_s": self.epoch_s,
                "first_epoch_s": self.first_epoch_s, "cost_per_epoch_usd": self.cost_per_epoch,
                "value": self.value, "usd": self.usd, "usage": self.usage, "utilization": self.utilization,
                "marks": self.marks}


def evaluate(c: Candidate, shape_of, stages, costs: Costs, prices: dict, *, ps_instance: str = "c5.xlarge",
             lam: LambdaSpec = LambdaSpec(), net: Network = Network(), epochs: int = 4) -> Prediction:
    """Simulate one candidate (shape_of(P, K) gives its partition plan's sizes) and price its epoch."""
    shape: Shape = shape_of(c.partitions, c.intervals)
    layout = Layout("aws", c.partitions, c.partitions * c.lambdas, backend="lambda" if c.lambdas else "inline",
                    staleness=c.staleness, graph_instance=c.instance, ps_instance=ps_instance, lam=lam, net=net)
    r = simulate(layout, costs, shape, stages, epochs=epochs)
    t = r.epoch_time()
    steady = [e for e in sorted(r.wu_end) if e >= 1] or sorted(r.wu_end)
    billed_s = sum(r.billed_by_epoch.get(e, 0.0) for e in steady) / len(steady)
    calls = sum(r.calls_by_epoch.get(e, 0) for e in steady) / len(steady)
    usage = {"time_s": t, "graph_servers": c.partitions, "graph_instance": c.instance, "param_servers": 1,
             "ps_instance": ps_instance, "lambda_billed_ms": billed_s * 1000.0 + calls * 0.5,
             "lambda_memory_mb": lam.memory_mb, "lambda_invocations": calls, "s3_puts": 0, "s3_gets": 0}
    usage["lambda_gb_s"] = lambda_gb_s(usage["lambda_billed_ms"], lam.memory_mb)
    usd = price_usage(usage, prices)
    span = r.wu_end[max(r.wu_end)]
    util = {"graph_servers": r.busy["graph_servers"] / (span * c.partitions),
            "tensor_workers": r.busy["tensor_workers"] / (span * max(layout.workers if c.lambdas else c.partitions,
                                                                      1))}
    first = r.wu_end[min(r.wu_end)]
    return Prediction(c, t, first, usage, usd, usd["total"], value(t, usd["total"]), util)


def mark(preds: list[Prediction], budget: float | None) -> None:
    """Mark the best value and the fastest candidate whose cost per epoch is within the budget."""
    ok = [p for p in preds if budget is None or p.cost_per_epoch <= budget]
    if not ok:
        return
    best = max(ok, key=lambda p: (p.value or 0.0, -p.epoch_s))
    fast = min(ok, key=lambda p: (p.epoch_s, p.cost_per_epoch))
    best.marks.append("best-value")
    fast.marks.append("fastest")


def finite(x: float) -> bool:
    return x is not None and math.isfinite(x)
