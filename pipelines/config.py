"""Run configuration: one dataclass for every setting, from flags and/or a TOML file, validated up front."""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import urllib.parse
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
import tomli_w

from schemas.tasks import StalenessMode, WireDtype


class ConfigError(ValueError):
    """A setting is wrong; the message names the setting and the problem."""


# Feature normalizations: auto (chosen from the features, pipelines/data/features.py), row (Kipf's), none.
FEATURE_NORMS = ("auto", "row", "none")

# Model-specific defaults (Kipf & Welling 2017 for GCN, Veličković et al. 2018 for GAT, PyG's GraphSAGE example
# for SAGE), used when unset.
MODEL_DEFAULTS = {
    "gcn": {"lr": 0.01, "hidden": 16, "dropout": 0.5, "weight_decay": 5e-4, "heads": 1, "out_heads": 1},
    "gat": {"lr": 0.005, "hidden": 8, "dropout": 0.6, "weight_decay": 5e-4, "heads": 8, "out_heads": 1},
    "sage": {"lr": 0.01, "hidden": 64, "dropout": 0.5, "weight_decay": 5e-4, "heads": 1, "out_heads": 1},
}


@dataclasses.dataclass
class TrainConfig:
    # data
    dataset: str | None = None
    data_dir: str | None = None
    prepared: str | None = None         # a graph prepared by the Beam pipeline (dorylus prepare --out DIR)
    feature_norm: str = "auto"          # auto: chosen from the features (pipelines/data/features.py)
    # model
    model: str = "gcn"
    hidden: int | None = None
    heads: int | None = None
    out_heads: int | None = None
    layers: int = 2
    dropout: float | None = None
    order: str = "auto"
    # optimization
    seed: int = 0
    epochs: int = 1000                 # a cap: early stopping (patience) ends runs, Amazon's near epoch 300
    lr: float | None = None
    weight_decay: float | None = None
    patience: int = 100
    # engine (computation separation)
    partitions: int = 1
    intervals: int = 1
    partitioner: str = "metis"
    staleness: int | None = None
    staleness_mode: str = "smooth"      # what is stale under S >= 1: smooth, predict, fresh or stale (README)
    sync_warmup: int = 20               # the first epochs run with S = 0 (fresh ghosts), then the bound applies
    wire_dtype: str = "float32"         # row tensors on the data channels: float32 or bfloat16 (half the bytes)
    wu: str = "sync"
    tensor_workers: int | str = 2       # local pool size, "auto" (autotuned local pool) or "aws" (Lambda)
    straggler_k: float = 2.0
    straggler_min_s: float = 0.5
    fail_rate: float = 0.0
    delay_rate: float = 0.0
    delay_s: float = 0.0
    task_latency_s: float = 0.0         # fixed added latency per tensor task (a remote worker's round trip)
    residual_cache_mb: int = 1024       # a local pool keeps AV forwards' residuals for their backward (0: none)
    transport: str = "memory"
    bootstrap: str | None = None
    broker_timeout: float = 120.0       # kafka: a role that no broker has answered this long (s) fails
    # serverless tensor workers (AWS Lambda) and cost
    mode: str = "serverless"            # or "cpu-only": graph servers run the tensor tasks themselves
    function: str | None = None         # Lambda function name or ARN (tensor_workers = "aws")
    bucket: str | None = None           # S3 bucket for payloads over the 6 MB invoke limit
    region: str | None = None
    s3_prefix: str = "tensor-workers"   # the prefix infra/terraform lets the function read and write
    lambda_memory_mb: int = 3008
    lambda_concurrency: int | None = None   # aws: concurrent invocations; unset: autotuned
    lambda_endpoint: str | None = None  # aws: Invoke endpoint URL[,URL...] (a local emulator fleet); one at a time each
    graph_instance: str = "c5n.2xlarge"
    ps_instance: str = "c5.xlarge"
    prices: str | None = None           # price table overriding pipelines/prices.toml
    # output
    out: str | None = None

    def resolved(self) -> "TrainConfig":
        """Fill model-specific defaults for unset settings, then validate."""
        if self.model not in MODEL_DEFAULTS:
            raise ConfigError(f"model: unknown model {self.model!r} (choose {', '.join(MODEL_DEFAULTS)})")
        c = dataclasses.replace(self)
        for k, v in MODEL_DEFAULTS[c.model].items():
            if getattr(c, k) is None:
                setattr(c, k, v)
        c.validate()
        return c

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ConfigError(msg)

        # inf and nan pass every comparison below one way or the other: an infinite latency hung the engine
        for name in ("lr", "dropout", "weight_decay", "fail_rate", "delay_rate", "delay_s", "task_latency_s",
                     "straggler_k", "straggler_min_s", "broker_timeout"):
            v = getattr(self, name)
            need(v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)),
                 f"{name} must be a finite number, got {v!r}")
        need(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")
        need(self.lr is None or self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(self.hidden is None or self.hidden >= 1, f"hidden must be >= 1, got {self.hidden}")
        need(self.heads is None or self.heads >= 1, f"heads must be >= 1, got {self.heads}")
        need(self.out_heads is None or self.out_heads >= 1, f"out_heads must be >= 1, got {self.out_heads}")
        need(self.layers >= 1, f"layers must be >= 1, got {self.layers}")
        need(self.dropout is None or 0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(self.weight_decay is None or self.weight_decay >= 0,
             f"weight_decay must be >= 0, got {self.weight_decay}")
        need(self.patience >= 0, f"patience must be >= 0 (0 disables early stopping), got {self.patience}")
        need(self.feature_norm in FEATURE_NORMS,
             f"feature_norm must be {', '.join(FEATURE_NORMS)}, got {self.feature_norm!r}")
        need(self.order in ("auto", "ga-first", "av-first"),
             f"order must be auto, ga-first or av-first, got {self.order!r}")
        need(self.partitions >= 1, f"partitions must be >= 1, got {self.partitions}")
        need(self.intervals >= 1, f"intervals must be >= 1, got {self.intervals}")
        need(self.partitioner in ("metis", "hash") or (self.partitioner == "prepared" and bool(self.prepared)),
             f"partitioner must be metis or hash (or prepared, with a prepared graph), got {self.partitioner!r}")
        need(not (self.prepared and self.dataset), "prepared and dataset exclude each other: give one")
        need(self.staleness is None or self.staleness >= 0,
             f"staleness must be none or an integer >= 0, got {self.staleness}")
        need(self.staleness_mode in [m.value for m in StalenessMode],
             f"staleness_mode must be smooth, smooth-zero, predict, fresh or stale, got {self.staleness_mode!r}")
        need(isinstance(self.sync_warmup, int) and not isinstance(self.sync_warmup, bool) and self.sync_warmup >= 0,
             f"sync_warmup must be an integer >= 0 (epochs), got {self.sync_warmup!r}")
        need(self.wire_dtype in [d.value for d in WireDtype],
             f"wire_dtype must be float32 or bfloat16, got {self.wire_dtype!r}")
        need(self.wu in ("sync", "async"), f"wu must be sync or async, got {self.wu!r}")
        need(self.tensor_workers in ("auto", "aws") or (isinstance(self.tensor_workers, int)
                                                        and not isinstance(self.tensor_workers, bool)
                                                        and self.tensor_workers >= 1),
             f"tensor_workers must be an integer >= 1, auto or aws, got {self.tensor_workers!r}")
        need(self.mode in ("serverless", "cpu-only"), f"mode must be serverless or cpu-only, got {self.mode!r}")
        need(not (self.mode == "cpu-only" and self.tensor_workers == "aws"),
             "mode cpu-only runs the tensor tasks on the graph servers; it does not take tensor_workers = aws")
        need(self.tensor_workers != "aws" or bool(self.function or self.lambda_endpoint
                                                  or os.environ.get("AWS_ENDPOINT_URL_LAMBDA")),
             "tensor_workers = aws needs a Lambda function (--function NAME)")
        parse_endpoints(self.lambda_endpoint)
        need(self.lambda_memory_mb is not None and 128 <= self.lambda_memory_mb <= 10240,
             f"lambda_memory_mb must be in [128, 10240] (Lambda's range), got {self.lambda_memory_mb}")
        need(self.lambda_concurrency is None or self.lambda_concurrency >= 1,
             f"lambda_concurrency must be >= 1, got {self.lambda_concurrency}")
        need(0.0 <= self.fail_rate < 1.0, f"fail_rate must be in [0, 1), got {self.fail_rate}")
        need(0.0 <= self.delay_rate <= 1.0, f"delay_rate must be in [0, 1], got {self.delay_rate}")
        need(self.delay_s >= 0, f"delay_s must be >= 0, got {self.delay_s}")
        need(self.task_latency_s >= 0, f"task_latency_s must be >= 0, got {self.task_latency_s}")
        need(isinstance(self.residual_cache_mb, int) and not isinstance(self.residual_cache_mb, bool)
             and self.residual_cache_mb >= 0,
             f"residual_cache_mb must be an integer >= 0 (MiB), got {self.residual_cache_mb!r}")
        need(not (self.task_latency_s > 0 and self.tensor_workers == "aws"),
             "task_latency_s models a remote worker's latency on a local pool; tensor_workers = aws has its own")
        need(self.straggler_k > 0, f"straggler_k must be > 0, got {self.straggler_k}")
        need(self.straggler_min_s >= 0, f"straggler_min_s must be >= 0 seconds, got {self.straggler_min_s}")
        need(self.transport in ("memory", "kafka"), f"transport must be memory or kafka, got {self.transport!r}")
        need(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        need(self.broker_timeout > 0, f"broker_timeout must be > 0 seconds, got {self.broker_timeout}")

    @property
    def engine(self) -> bool:
        """Whether the run needs the separated, pipelined engine rather than the whole-graph trainer."""
        return (self.partitions > 1 or self.intervals > 1 or self.staleness is not None or self.wu != "sync"
                or self.transport != "memory" or self.fail_rate > 0 or self.delay_rate > 0
                or self.task_latency_s > 0 or self.mode != "serverless" or self.tensor_workers in ("auto", "aws"))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def parse_staleness(value) -> int | None:
    """'none' (fully synchronous) or a non-negative integer number of epochs."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    try:
        s = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"staleness must be none or an integer >= 0, got {value!r}") from None
    if s < 0:
        raise ConfigError(f"staleness must be none or an integer >= 0, got {s}")
    return s


def parse_endpoints(value: str | None) -> list[str]:
    """`URL[,URL...]` as a list; each URL is http(s)://HOST:PORT (a path is not allowed)."""
    if value is None or not str(value).strip():
        return []
    urls = [u.strip().rstrip("/") for u in str(value).split(",")]
    for u in urls:
        p = urllib.parse.urlparse(u)
        try:
            bad_port = p.port is None and ":" in p.netloc.rsplit("]", 1)[-1]
        except ValueError:
            bad_port = True
        if p.scheme not in ("http", "https") or not p.hostname or p.path or bad_port:
            raise ConfigError(f"lambda_endpoint: {u!r} is not an endpoint URL (http://HOST:PORT)")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"lambda_endpoint: {value!r} names an endpoint twice")
    return urls


def parse_tensor_workers(value) -> int | str:
    """A local pool size (integer >= 1), "auto" (autotuned local pool) or "aws" (AWS Lambda)."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "aws"):
        return value.strip().lower()
    try:
        n = int(value)
        if isinstance(value, (bool, float)) or n < 1:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"tensor_workers must be an integer >= 1, auto or aws, got {value!r}") from None
    return n


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; unknown keys and wrongly typed values are errors naming the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    if "train" in raw and isinstance(raw["train"], dict):
        raw = {**{k: v for k, v in raw.items() if k != "train"}, **raw["train"]}
    out = {}
    for k, v in raw.items():
        key = k.replace("-", "_")
        if key not in FIELDS:
            raise ConfigError(f"config file {path}: unknown setting {k!r}")
        if key == "staleness":
            v = parse_staleness(v)
        elif key == "tensor_workers":
            v = parse_tensor_workers(v)
        elif v is not None and not _type_ok(FIELDS[key], v):
            raise ConfigError(f"config file {path}: setting {k!r} has the wrong type ({type(v).__name__})")
        out[key] = v
    return out


def _type_ok(field: dataclasses.Field, v) -> bool:
    t = str(field.type)
    if "bool" in t:
        return isinstance(v, bool)
    if "float" in t:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if "int" in t:
        return isinstance(v, int) and not isinstance(v, bool)
    if "str" in t:
        return isinstance(v, str)
    return True


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults, then the config file, then explicitly given flags; model defaults fill the rest."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    if "staleness" in merged:
        merged["staleness"] = parse_staleness(merged["staleness"])
    if "tensor_workers" in merged:
        merged["tensor_workers"] = parse_tensor_workers(merged["tensor_workers"])
    return TrainConfig(**merged).resolved()
